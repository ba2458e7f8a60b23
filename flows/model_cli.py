"""`sluice model`: bring a pretrained model into the directory layout Sluice trains.

    sluice model import SRC DIR [--dtype float32|bfloat16|float16] [--force]
    sluice model merge BASE ADAPTER DIR

SRC is a GGUF file or a Hugging Face model directory; DIR receives safetensors
weights, config, generation config and tokenizer (engines/policy/importer.py). Prints
one ``sha256sum``-style line per file and a last line with the directory's digest, so
a run can be pinned to exact weights. The paths are checked before torch is imported;
``flows/cli.py`` turns a ModelImportError into its one error line and exit code 2.

``merge`` folds a LoRA run's adapter version (PEFT's files) into its base, version 0,
and writes the plain Hugging Face directory any engine (SGLang, transformers) loads.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from sluice.engines.policy.importer import DTYPES, ModelImportError, check_paths, import_model


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
    merge = actions.add_parser(
        "merge",
        help="fold a LoRA adapter version into its base as a plain Hugging Face directory",
        description="Write BASE with ADAPTER (a LoRA run's version: adapter_config.json and "
        "adapter_model.safetensors) folded in, W + alpha/r * B A, as DIR.",
    )
    merge.add_argument("base", metavar="BASE", help="the base model directory (version 0)")
    merge.add_argument("adapter", metavar="ADAPTER", help="the adapter version's directory")
    merge.add_argument("dest", metavar="DIR", help="directory to create (must not exist)")


def run_merge(args: argparse.Namespace) -> int:
    """Raises ModelImportError naming what is wrong (nothing written)."""
    from pathlib import Path

    from sluice.engines.policy.adapter import AdapterError, is_adapter_dir, merge_adapter_dir

    base, adapter, dest = Path(args.base), Path(args.adapter), Path(args.dest)
    if not (base / "config.json").is_file():
        raise ModelImportError(f"{base} is not a Hugging Face model directory (no config.json)")
    if not is_adapter_dir(adapter):
        raise ModelImportError(f"{adapter} is not a LoRA adapter (no adapter_config.json)")
    if dest.exists():
        raise ModelImportError(f"{dest} exists; name a new directory")
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        merge_adapter_dir(base, adapter, dest)
    except (AdapterError, ValueError) as err:
        import shutil

        shutil.rmtree(dest, ignore_errors=True)
        raise ModelImportError(str(err)) from err
    print(f"{adapter} merged into {base}: {dest}")
    return 0


def run_model(args: argparse.Namespace) -> int:
    """Raises ModelImportError (nothing written) for a source or destination it cannot use."""
    if args.model_command == "merge":
        return run_merge(args)
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
