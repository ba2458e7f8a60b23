"""`sluice model`: bring a pretrained model into the directory layout Sluice trains.

    sluice model import SRC DIR [--dtype float32|bfloat16|float16] [--force]

SRC is a GGUF file or a Hugging Face model directory; DIR receives safetensors
weights, config, generation config and tokenizer (engines/policy/importer.py). Prints
one ``sha256sum``-style line per file and a last line with the directory's digest, so
a run can be pinned to exact weights. The paths are checked before torch is imported;
``flows/cli.py`` turns a ModelImportError into its one error line and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from sluice.engines.policy.importer import DTYPES, check_paths, import_model


def add_model_parser(sub: Any) -> None:
    model = sub.add_parser("model", help="import a pretrained model for training")
    actions = model.add_subparsers(dest="model_command", required=True)
    importer = actions.add_parser(
        "import",
        help="write a GGUF file or Hugging Face directory as the directory Sluice trains",
        description="Convert SRC (a GGUF file or a Hugging Face model directory) into DIR: "
        "safetensors weights, config.json, generation_config.json and the tokenizer. Train "
        "it with --set model.path=DIR.",
    )
    importer.add_argument("src", metavar="SRC", help="a .gguf file or a Hugging Face directory")
    importer.add_argument(
        "dest", metavar="DIR", help="directory to create (must not exist or be empty)"
    )
    importer.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the written weights (default float32, what the CPU trainer uses)",
    )
    importer.add_argument(
        "--force", action="store_true", help="replace DIR if it exists and is not empty"
    )


def run_model(args: argparse.Namespace) -> int:
    """Raises ModelImportError (nothing written) for a source or destination it cannot use."""
    source_format = check_paths(args.src, args.dest, force=args.force)
    # Before torch and transformers are imported, so their progress bars stay off.
    os.environ.setdefault("TQDM_DISABLE", "1")
    print(f"importing {args.src} ({source_format}) into {args.dest} as {args.dtype}", flush=True)
    started = time.perf_counter()
    imported = import_model(args.src, args.dest, dtype=args.dtype, force=args.force)
    elapsed_s = time.perf_counter() - started
    print(
        f"{imported.architecture}, {imported.num_parameters:,} parameters, "
        f"written in {elapsed_s:.1f} s"
    )
    for name, sha in imported.files:
        print(f"{sha}  {name}")
    print(
        f"{imported.digest}  {args.dest} (directory: sha256 of the {len(imported.files)} lines above)"
    )
    return 0
