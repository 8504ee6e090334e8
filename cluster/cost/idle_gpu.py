"""The idle-GPU stop check: GPU use, from the MLflow system metrics the job logs, under limits.min_gpu_utilization
for limits.idle_gpu_minutes stops the run (`stopped_by=idle_gpu`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from mlflow import MlflowClient

from gpuflow.cluster.spec import ExperimentSpec

GPU_UTILIZATION = re.compile(r"^system/gpu_(\d+)_utilization_percentage$")
IDLE_POLL_S = 30.0  # MLflow is read at most this often: the window is minutes long


def gpu_utilization(client: MlflowClient, run_id: str) -> list[tuple[float, float]]:
    """(time s, mean utilisation % over the node's GPUs) from MLflow system metrics, oldest first."""
    keys = [key for key in client.get_run(run_id).data.metrics if GPU_UTILIZATION.match(key)]
    samples: dict[int, list[float]] = {}
    for key in keys:
        for metric in client.get_metric_history(run_id, key):
            samples.setdefault(metric.timestamp, []).append(metric.value)
    return [(timestamp / 1000, sum(values) / len(values)) for timestamp, values in sorted(samples.items())]


def idle_verdict(
    series: list[tuple[float, float]], threshold_percent: float, window_s: float, now: float
) -> str | None:
    """Why the GPUs count as idle, or None: a whole window watched, and each sample of the last under the threshold."""
    if not series or series[0][0] > now - window_s:
        return None  # not watched for a whole window yet
    recent = [value for timestamp, value in series if timestamp >= now - window_s]
    if not recent or max(recent) >= threshold_percent:
        return None
    return (
        f"stopped by idle GPU: utilisation stayed under {threshold_percent:g}% for {window_s / 60:g} min "
        f"(highest {max(recent):.0f}% over {len(recent)} samples; limits.min_gpu_utilization)"
    )


def idle_gpu_check(
    spec: ExperimentSpec, run_id: str, poll_interval_s: float = IDLE_POLL_S
) -> Callable[[], tuple[str, str] | None]:
    """A watchdog check: fires when GPU use stays under limits.min_gpu_utilization for limits.idle_gpu_minutes."""
    threshold = spec.limits.min_gpu_utilization
    window_s = spec.limits.idle_gpu_minutes * 60
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    polled_at = [float("-inf")]

    def check():
        if threshold is None or time.monotonic() - polled_at[0] < poll_interval_s:
            return None
        polled_at[0] = time.monotonic()
        detail = idle_verdict(gpu_utilization(client, run_id), threshold, window_s, time.time())
        return ("idle_gpu", detail) if detail else None

    return check
