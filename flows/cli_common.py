"""What every `sluice` command shares: its one error line, how a stop is worded and what
it exits with, and the CONFIG / --set arguments. `flows/cli.py` re-exports these; the
command modules (`flows/cli_*.py`) import them from here, so none imports the entry point.
"""

from __future__ import annotations

import argparse
import signal
import sys


def fail(err: Exception | str, code: int = 2) -> int:
    """One error line on stderr, credentials of the config hidden; the exit code."""
    from sluice.infra.secrets import redact_text

    print(f"sluice: error: {redact_text(str(err))}", file=sys.stderr)
    return code


def interruption(stop: BaseException) -> str:
    """What stopped a command, in words: Ctrl-C or the signal's name."""
    signum = getattr(stop, "signal", signal.SIGINT)
    return (
        "interrupted (Ctrl-C)"
        if signum == signal.SIGINT
        else f"{signal.Signals(signum).name} received"
    )


def exit_code(stop: BaseException) -> int:
    """128 + the signal's number, as a shell reports a command a signal ended."""
    return 128 + int(getattr(stop, "signal", signal.SIGINT))


def add_overrides_arg(
    parser: argparse.ArgumentParser, example: str = "staleness.max_staleness=4"
) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one config key, e.g. --set {example} (repeatable; a bare "
        "KEY=VALUE after the command does the same)",
    )


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=None,  # `default`, once the bare words are sorted out (flows/cli.py)
        help="YAML config file, or the name of one in flows/configs (default: default)",
    )
    add_overrides_arg(parser)
