"""An outage is logged once per quiet period, not once per retry."""

from __future__ import annotations

import logging

from sluice.tasks.run.logs import RetryLogOnce


def test_retries_after_the_first_are_counted_not_logged(caplog, monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("sluice.tasks.run.logs.time.monotonic", lambda: clock[0])
    logger = logging.getLogger("test.urllib3.connectionpool")
    logger.addFilter(RetryLogOnce(quiet_s=60))
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for attempt in range(5):
            logger.warning("Retrying (Retry(total=%d)) after connection broken", 5 - attempt)
            clock[0] += 1
        logger.warning("something else entirely")
        clock[0] += 60
        logger.warning("Retrying (Retry(total=4)) after connection broken")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("Retrying (Retry(total=5))") and "not logged" in lines[0]
    assert lines[1] == "something else entirely"
    assert "4 retries since the last note" in lines[2]
