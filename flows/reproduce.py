"""The `reproduce` flow: run a pinned config and hold its final metrics to a reference band.

The band lives next to the config (`flows/configs/{name}.reference.json`) and was
measured on the reference machine; a run outside it fails the flow run loudly, which
is what a scheduled reproduction pipeline is for.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from sluice.flows.train import train
from sluice.infra.config.overrides import ConfigError
from sluice.infra.config.run import CONFIG_DIR, load_config


class ReproductionFailed(AssertionError):
    """A reproduced metric fell outside its reference band."""


def load_reference(config_name: str) -> dict[str, list[float]]:
    path = CONFIG_DIR / f"{config_name}.reference.json"
    if not path.exists():
        raise ConfigError(f"no reference band for '{config_name}' (expected {path})")
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    bands = document.get("bands") if isinstance(document, dict) else None
    if not isinstance(bands, dict) or not bands:
        raise ConfigError(f'{path}: needs a non-empty "bands" mapping of metric -> [low, high]')
    for key, band in bands.items():
        numeric = isinstance(band, list) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in band
        )
        if not (numeric and len(band) == 2 and band[0] <= band[1]):
            raise ConfigError(f"{path}: band for '{key}' must be [low, high], got {band!r}")
    return bands


def compare(
    result: dict[str, Any], bands: dict[str, list[float]]
) -> list[tuple[str, float | None, list[float], bool]]:
    rows = []
    for key, (low, high) in bands.items():
        value = result.get(key)
        rows.append((key, value, [low, high], value is not None and low <= value <= high))
    return rows


@flow(name="sluice-reproduce", log_prints=True)
def reproduce(config_name: str = "reproduce", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the pinned config, compare final metrics with the stored band, fail if outside."""
    bands = load_reference(config_name)
    config = load_config(config_name, overrides or [])
    result = train(config)
    rows = compare(result, bands)
    table = "\n".join(
        f"| {key} | {'-' if value is None else f'{value:.4f}'} | [{low}, {high}] | {'ok' if ok else '**OUT OF BAND**'} |"
        for key, value, (low, high), ok in rows
    )
    create_markdown_artifact(
        f"# Reproduction of `{config_name}`\n\n| metric | value | band | verdict |\n|---|---|---|---|\n{table}\n",
        key="reproduction",
        description=f"Reproduction of {config_name}",
    )
    failed = [
        f"{key}={value} not in [{low}, {high}]" for key, value, (low, high), ok in rows if not ok
    ]
    if failed:
        get_run_logger().error("reproduction out of band: %s", "; ".join(failed))
        raise ReproductionFailed(f"{config_name}: " + "; ".join(failed))
    return result
