"""A config's nested dict before validation: read from a YAML file, then changed by
`--set key.sub=value` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot run, with a one-line message that says how to fix it."""


def parse_value(text: str) -> Any:
    """A `--set` value: YAML scalars/lists/maps (`4`, `true`, `null`, `[a, b]`), else a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one `key.sub=value` to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got '{assignment}'")
    key, _, raw = assignment.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got '{assignment}'")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"cannot set '{key}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = parse_value(raw)


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping in the YAML file at `path` (empty for an empty file); ConfigError
    naming the file (and line) for anything that is not one."""
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}:{where} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: top level must be a mapping of config sections")
    return loaded
