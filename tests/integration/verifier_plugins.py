"""Verifier plugins that misbehave on purpose, for tests/integration/test_verifier_pool.py
(importable by the pool's spawned workers as tests.integration.verifier_plugins:NAME)."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any


def unruly(row: dict[str, Any], text: str) -> float:
    """1.0 for "ok"; for "die" the worker process exits at once, for "segfault" it
    crashes on a null pointer, for "exit" the plugin calls sys.exit(), for "hang" it
    never returns, for "slow" it takes 0.6 s."""
    if text == "die":
        os._exit(3)
    if text == "segfault":
        ctypes.string_at(0)
    if text == "exit":
        sys.exit(2)
    if text == "hang":
        time.sleep(3600)
    if text == "slow":
        time.sleep(0.6)
    return 1.0


def never_ready() -> Any:
    """A worker loader that never finishes: no call is ever taken (test_call_pool.py)."""
    time.sleep(3600)
