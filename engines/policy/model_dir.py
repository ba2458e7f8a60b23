"""What a policy directory declares, read from its JSON files alone (no torch, no transformers).

`sluice train` checks a user's ``model.path`` with these before anything starts, so a
directory that cannot be trained fails in one line naming the directory and the missing
piece, and nothing (no run, no version 0) is created. The roles read the same facts:
the end tokens every generation stops on, and whether the tokenizer has a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from sluice.engines.policy.importer import TOKENIZER_FILES  # one list: import checks it too

ChatTemplateMode = Literal["auto", "always", "never"]

CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where newer Hugging Face saves put the chat template instead of tokenizer_config.json."""


class ModelDirError(ValueError):
    """A model directory that cannot be trained; the message names it and what is missing."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"cannot read '{path}': {exc}") from exc
    if not isinstance(data, dict):
        raise ModelDirError(f"'{path}' is not a JSON object")
    return data


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the directory's tokenizer carries a chat template."""
    where = Path(model_dir)
    if any((where / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    config_file = where / "tokenizer_config.json"
    if not config_file.is_file():
        return False
    return bool(_read_json(config_file).get("chat_template"))


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def declared_end_token_ids(model_dir: str | Path) -> frozenset[int]:
    """The EOS ids ``generation_config.json`` and ``config.json`` name (either may be absent).

    A chat model often ends its turn with a token its base config does not call EOS
    (``<|im_end|>``, ``<|eot_id|>``): the generation config is where the model's authors
    list every token that ends a response, so generation stops on all of them.
    """
    where = Path(model_dir)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        if (where / name).is_file():
            ids |= _ids(_read_json(where / name).get("eos_token_id"))
    return frozenset(ids)


def check_model_dir(model_dir: str | Path, chat_template: ChatTemplateMode = "auto") -> None:
    """Raise ModelDirError, in one line, when `model_dir` cannot be trained as asked.

    Checks what can be known without loading anything: the directory exists and is a
    Hugging Face model directory (config.json with an architecture, weights), it has
    a tokenizer, and it has a chat template when `chat_template` is ``always``.
    """
    where = Path(model_dir)
    if not where.exists():
        raise ModelDirError(f"model.path '{where}' does not exist")
    if not where.is_dir():
        hint = (
            f"; import it first: sluice model import {where} DIR" if where.suffix == ".gguf" else ""
        )
        raise ModelDirError(f"model.path '{where}' is a file, expected a model directory{hint}")
    if not (where / "config.json").is_file():
        raise ModelDirError(
            f"model.path '{where}' is not a Hugging Face model directory (no config.json)"
        )
    config = _read_json(where / "config.json")
    if not config.get("architectures") and not config.get("model_type"):
        raise ModelDirError(f"'{where / 'config.json'}' names no architecture or model_type")
    weights = [*where.glob("*.safetensors"), where / "pytorch_model.bin"]
    if not any(path.is_file() for path in weights):
        raise ModelDirError(
            f"model.path '{where}' holds no weights (*.safetensors or pytorch_model.bin)"
        )
    if not any((where / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"model.path '{where}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save the model's tokenizer into the same directory"
        )
    if chat_template == "always" and not has_chat_template(where):
        raise ModelDirError(
            f"model.chat_template=always, but the tokenizer in '{where}' has no chat template; "
            "use model.chat_template=never (plain prompts) or a chat model"
        )
