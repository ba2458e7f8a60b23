"""Figures a process reports about itself (role status documents, `/server_info`)."""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB.

    The kernel's high-water mark, so a peak between two reads is never missed; pages
    shared with a parent (a forked role) count in full, as `ps` counts them.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
