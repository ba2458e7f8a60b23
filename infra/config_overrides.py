"""`--set key.sub=value` overrides, applied to a config's nested dict before validation."""

from __future__ import annotations

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
