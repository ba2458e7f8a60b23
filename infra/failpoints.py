"""Failpoints: named places where a fault-injection run can kill the process on purpose.

Off unless the environment names a failpoint file (`SLUICE_FAILPOINTS=/path.json`, a
JSON object of failpoint name -> how many more times to fire), so production pays one
environment lookup. A process reaching an armed failpoint counts it down and appends
its name and pid to the file's `fired` list under a file lock, then SIGKILLs itself: the crash
lands exactly between two steps that a kill from outside would hit only by luck, such
as between uploading a checkpoint's weights and its manifest, or between creating a
registry version and moving the alias to it. The soak (`python -m tests.soak`) arms them.

A failpoint armed with ``{"sleep_s": S}`` (optionally ``"times": N``) sleeps S seconds
instead, each time it is reached, and records itself the same way: slow storage on
purpose (the benchmark's slow-storage arm, the storage-outage test).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time

ENV = "SLUICE_FAILPOINTS"


def failpoint(name: str) -> None:
    """Kill this process here if `name` is armed in the failpoint file."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        with open(path, "r+", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            plan = json.loads(fh.read() or "{}")
            armed = plan.get(name, 0)
            if isinstance(armed, dict):
                sleep_s = float(armed.get("sleep_s", 0.0))
                times = armed.get("times")
                if times is not None and int(times) <= 0:
                    return
                if times is not None:
                    armed["times"] = int(times) - 1
            elif int(armed) <= 0:
                return
            else:
                plan[name] = int(armed) - 1
                sleep_s = -1.0
            plan["fired"] = [*plan.get("fired", []), {"name": name, "pid": os.getpid()}]
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps(plan))
            fh.flush()
            os.fsync(fh.fileno())
    except (OSError, ValueError):
        return  # no plan to follow: carry on
    if sleep_s >= 0:
        time.sleep(sleep_s)
        return
    os.kill(os.getpid(), signal.SIGKILL)
