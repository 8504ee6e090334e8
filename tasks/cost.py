"""The flow's side of cost control: budget checks before launch, the idle-GPU stop check, the run's bill in MLflow.

    gpuflow run experiments/digits.yaml --set limits.hourly_rate_usd=3 --set limits.max_cost_usd=1
"""

from __future__ import annotations

import re
import time
from typing import Callable

from mlflow import MlflowClient

from gpuflow.cluster.cost.pricing import Estimate, check_daily_budget, check_run_budget, daily_budget_usd, hourly_cost
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.cost.budget import committed_since_usd, release_reservations_of, reserve_within_budget
from gpuflow.cluster.cost.spend import HOURLY_METRIC, start_of_today_utc

GPU_UTILIZATION = re.compile(r"^system/gpu_(\d+)_utilization_percentage$")
IDLE_POLL_S = 30.0  # MLflow is read at most this often: the window is minutes long


def check_budget(spec: ExperimentSpec, flow_run_id: str | None = None) -> Estimate:
    """Prices the cluster and refuses the run if it could break limits.max_cost_usd or the daily budget.

    With a flow run id the run's most is reserved first (write, then read), so that runs started together
    cannot all pass a budget that fits one; the flow calls settle_budget(spec, flow_run_id) at its end.
    Without one (`gpuflow validate`), it only reads."""
    estimate = hourly_cost(spec)
    check_run_budget(spec, estimate)
    budget = daily_budget_usd()
    if budget is not None:
        if flow_run_id:
            reserve_within_budget(spec, estimate, budget, str(flow_run_id))
        else:
            committed, _ = committed_since_usd(spec.tracking_uri, start_of_today_utc())
            check_daily_budget(spec, estimate, committed, budget)
    return estimate


def settle_budget(spec: ExperimentSpec, flow_run_id: str) -> None:
    """At the run's end: its budget reservation gives way to the real cost logged in its MLflow run (cost_usd)."""
    if daily_budget_usd() is not None:
        release_reservations_of(spec.tracking_uri, str(flow_run_id))


def record_estimate(spec: ExperimentSpec, run_id: str, estimate: Estimate) -> None:
    """Logs the price when the run opens, so a run still going (or killed with its flow) can be priced later."""
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    client.log_metric(run_id, HOURLY_METRIC, estimate.hourly_usd)
    client.set_tag(run_id, "spot", str(estimate.use_spot).lower())
    client.set_tag(run_id, "gpuflow.price_source", estimate.source)
    if estimate.instance_type:
        client.set_tag(run_id, "gpuflow.instance_type", estimate.instance_type)


# -- idle GPU -------------------------------------------------------------------------------------

def gpu_utilization(client: MlflowClient, run_id: str) -> list[tuple[float, float]]:
    """(time s, mean utilisation % over the node's GPUs) from MLflow system metrics, oldest first."""
    keys = [key for key in client.get_run(run_id).data.metrics if GPU_UTILIZATION.match(key)]
    samples: dict[int, list[float]] = {}
    for key in keys:
        for metric in client.get_metric_history(run_id, key):
            samples.setdefault(metric.timestamp, []).append(metric.value)
    return [(timestamp / 1000, sum(values) / len(values)) for timestamp, values in sorted(samples.items())]


def idle_verdict(series: list[tuple[float, float]], threshold_percent: float, window_s: float,
                 now: float) -> str | None:
    """Why the GPUs count as idle, or None: every sample of the last window under the threshold, and a full window seen."""
    if not series or series[0][0] > now - window_s:
        return None  # not watched for a whole window yet
    recent = [value for timestamp, value in series if timestamp >= now - window_s]
    if not recent or max(recent) >= threshold_percent:
        return None
    return (f"stopped by idle GPU: utilisation stayed under {threshold_percent:g}% for {window_s / 60:g} min "
            f"(highest {max(recent):.0f}% over {len(recent)} samples; limits.min_gpu_utilization)")


def idle_gpu_check(spec: ExperimentSpec, run_id: str,
                   poll_interval_s: float = IDLE_POLL_S) -> Callable[[], tuple[str, str] | None]:
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

