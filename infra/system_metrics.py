"""MLflow system metrics for a run: CPU, memory, disk, network, and GPU where NVML answers.

MLflow's `log_system_metrics=True` on `mlflow.start_run` starts a `SystemMetricsMonitor`
on the fluent API's active run. Sluice has no active run (every tracking call names its
run id and URI, infra/tracking.py), so the same monitor is started here with both
spelled out. It samples every `interval_s` seconds on a daemon thread and logs the
samples as `system/cpu_utilization_percentage`, `system/system_memory_usage_megabytes`,
`system/gpu_0_utilization_percentage` ... with a step count of their own (a resumed run
goes on from its last one). The numbers are the machine's, not one process's, so one
monitor per machine is enough: the training role starts it. At 10 s a sample is one
psutil read and one MLflow write, which a 2-core machine does not notice. GPU metrics
need `nvidia-ml-py` (in the GPU lock); without it MLflow logs the rest.

MLflow's own environment variables still apply: `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`
overrides the interval, `MLFLOW_SYSTEM_METRICS_NODE_ID` prefixes the names with a node.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class SystemMetrics:
    """A running monitor; `stop()` logs what it sampled last and ends its thread."""

    def __init__(self, monitor: Any) -> None:
        self._monitor = monitor
        # MLflow's monitor counts its published samples here (mlflow pinned in
        # pyproject.toml); None where a release renames it: then no end sample.
        self._first_step = getattr(monitor, "_logging_step", None)

    def stop(self) -> None:
        """End the thread; a run that ended inside its first interval (a sample is
        published only after one) still gets one sample, taken now."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        monitor.finish()
        if self._first_step is not None and monitor._logging_step == self._first_step:
            try:
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
            except Exception as err:  # a metric of the machine never fails a run
                logger.warning("system metrics: the end sample was not logged (%s)", err)


def start_system_metrics(tracking_uri: str, run_id: str, interval_s: float) -> SystemMetrics | None:
    """Sample system metrics into MLflow run `run_id` every `interval_s` seconds until
    `stop()`. None (and nothing started) when `interval_s` is 0, there is no run id, or
    psutil, which MLflow samples with, is not installed (one warning)."""
    if interval_s <= 0 or not run_id:
        return None
    try:
        import psutil  # noqa: F401  (MLflow's CPU, disk and network monitors read it)
    except ImportError:
        logger.warning(
            "system metrics are off: MLflow samples them with psutil, which is not installed"
        )
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id,
        sampling_interval=interval_s,
        samples_before_logging=1,
        resume_logging=True,
        tracking_uri=tracking_uri,
    )
    monitor.start()
    return SystemMetrics(monitor)
