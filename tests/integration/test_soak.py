"""The fault soak, short: every role killed once, both failpoints, one S3 and one MLflow
outage during a real `sluice train` on S3 and an MLflow server; the run finishes and
its books are clean (`python -m tests.soak` runs the longer one)."""

from __future__ import annotations

import pytest

from tests.soak.soak import run_soak

pytestmark = [pytest.mark.integration, pytest.mark.soak]


@pytest.mark.usefixtures("shared_prefect_api")
def test_a_short_soak_recovers_from_every_fault_and_loses_nothing(tmp_path) -> None:
    # Over shared memory: a failpoint kills the trainer between a version's offer to
    # the servers' fast path and its durable write.
    result = run_soak(
        steps=32, kills=1, outages=1, seed=1, root=tmp_path, weight_transfer="shared_memory"
    )
    print(result.line())
    assert result.returncode == 0, result.output[-4000:]
    kinds = {f.kind for f in result.injected}
    assert {"kill", "failpoint", "s3", "mlflow"} <= kinds, result.line()
    fired = {f.target for f in result.injected if f.kind == "failpoint"}
    assert "train.offered_not_durable" in fired, result.line()
    assert all(f.recovered for f in result.injected), result.line()
    assert result.audit.problems() == []
    assert result.audit.duplicated == 0 and result.audit.groups_lost == []
