"""The reuse step: a run whose work key is a FINISHED run's trains nothing (cluster/rerun/reuse.py decides)."""

from __future__ import annotations

from prefect import get_run_logger, task

from gpuflow.cluster.cost.spend import COST_METRICS
from gpuflow.cluster.protocol import CHECKPOINTS_TAG, HOURLY_METRIC, PHASE_METRIC_PREFIX
from gpuflow.cluster.rerun.reuse import Twin, finished_twin
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.tasks.tracking import publish_summary


@task(name="find-finished-twin")
def find_finished_twin(spec: ExperimentSpec, force: bool) -> Twin:
    """The FINISHED run with this run's work key, if any; says in the run's log why it trains or not."""
    twin = finished_twin(spec, force)
    get_run_logger().info(("reusing it: nothing to train; " if twin.run else "training: ") + twin.why)
    return twin


def reused_summary(spec: ExperimentSpec, twin: Twin, seconds: float) -> dict:
    """The summary of a run that reused its twin (no cluster, no MLflow run of its own), as a run's own would be
    shaped; published on the flow run, its link and metrics those of the run it reused."""
    run = twin.run
    summary = {
        "run_id": run.info.run_id,
        "reused": True,
        "metrics": trained_metrics(run.data.metrics),
        "checkpoint": run.data.tags.get(CHECKPOINTS_TAG),
        "phases": {"wall_seconds": seconds},
        "experiment": spec.experiment_name,
        "tracking_uri": spec.tracking_uri,
        "cluster": None,
        "cost": None,
        "price": None,
        "sweep": None,
    }
    publish_summary(spec, run.info.run_id, summary)
    return summary


# What the flow and MLflow log beside the loop's reports (its bill, its phases, the node's system metrics)
RECORD_METRICS = (*COST_METRICS, HOURLY_METRIC, "teardown_seconds")
RECORD_PREFIXES = ("system/", PHASE_METRIC_PREFIX, "attempt_")


def trained_metrics(metrics: dict) -> dict:
    """The loop's last reports, as the run's own summary showed them."""
    return {k: v for k, v in metrics.items() if k not in RECORD_METRICS and not k.startswith(RECORD_PREFIXES)}
