"""Each role's status document carries the process's peak resident memory."""

from __future__ import annotations

import json
import subprocess
import sys

# Run in a fresh process: the test runner's own peak may already be far above anything
# this test allocates.
SCRIPT = """
import json, os, uuid
from sluice.infra.config.run import RunConfig
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.status import StatusReporter, read_statuses

config = RunConfig(storage={"url": f"memory://status-{uuid.uuid4().hex}"})
paths = run_paths(config, "run")
reporter = StatusReporter(config, paths, "train")
reporter.update(force=True)
before = read_statuses(config, paths)["train"]["peak_rss_mb"]
# Imports peak above what stays resident: touch enough to rise 200 MiB over that peak,
# then free it before the next write (only a high-water mark still sees it).
resident_mb = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
block = bytearray(int((before - resident_mb + 200) * 2**20))
for i in range(0, len(block), 4096):
    block[i] = 1
del block
reporter.update(force=True)
after = read_statuses(config, paths)["train"]["peak_rss_mb"]
print(json.dumps([before, after]))
"""


def test_status_reports_a_peak_that_covers_memory_already_freed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout.splitlines()[-1])
    assert before > 10  # a Python process with pydantic and fsspec loaded
    assert after >= before + 190
