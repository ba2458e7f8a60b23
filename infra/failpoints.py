"""Failpoints: named places where a fault-injection run can kill the process on purpose.

Off unless the environment names a failpoint file (`SLUICE_FAILPOINTS=/path.json`, a
JSON object of failpoint name -> how many more times to fire), so production pays one
environment lookup. A process reaching an armed failpoint counts it down and appends
its name and pid to the file's `fired` list under a file lock, then SIGKILLs itself: the crash
lands exactly between two steps that a kill from outside would hit only by luck, such
as between uploading a checkpoint's weights and its manifest, or between creating a
registry version and moving the alias to it. The soak (`python -m tests.soak`) arms them.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal

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
            if int(plan.get(name, 0)) <= 0:
                return
            plan[name] = int(plan[name]) - 1
            plan["fired"] = [*plan.get("fired", []), {"name": name, "pid": os.getpid()}]
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps(plan))
            fh.flush()
            os.fsync(fh.fileno())
    except (OSError, ValueError):
        return  # no plan to follow: carry on
    os.kill(os.getpid(), signal.SIGKILL)
