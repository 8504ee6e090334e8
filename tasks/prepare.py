"""Before any cluster exists: check the spec, and put the data where the cluster can read it."""

import time

from prefect import get_run_logger, runtime, task

from gpuflow.cluster.backends.skypilot.infra import check_infra
from gpuflow.cluster.cost.budget import check_budget
from gpuflow.cluster.cost.deadline_run import checked_deadline, resolved
from gpuflow.cluster.cost.history import prediction_for
from gpuflow.cluster.cost.predict import Prediction
from gpuflow.cluster.data import ensure_data
from gpuflow.cluster.spec import ExperimentSpec, validate_spec
from gpuflow.cluster.spec.probes import TRACKING_WAIT_S
from gpuflow.cluster.util.local_store import ready_local_store


@task(name="validate")
def validate(spec: ExperimentSpec) -> tuple[ExperimentSpec, Prediction]:
    """Fails with every problem listed (field, value, fix) before anything is started or billed. Returns the spec
    and the run's time and cost predicted from past runs of its loop on its hardware (logged when its run opens)."""
    spec = validate_spec(spec, patience_s=TRACKING_WAIT_S, say=get_run_logger().warning)  # outlives its restart
    spec = resolved(check_infra(spec), created_at())  # a deadline within hours: from the run's start
    prediction = prediction_for(spec)
    deadline = checked_deadline(spec, prediction)
    # reserves, then refuses here, before any cluster exists
    estimate = check_budget(spec, runtime.flow_run.id, prediction)
    ready_local_store(spec.tracking_uri)  # runs started at once on a fresh store must not all create it
    get_run_logger().info(
        f"spec {spec.name!r} is valid: backend={spec.compute.backend} nodes={spec.compute.num_nodes} "
        f"workers={spec.compute.num_workers} precision={spec.precision}; "
        f"price {estimate.describe()}, at most ${estimate.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes"
    )
    get_run_logger().info("\n".join(prediction.lines(estimate) + (deadline.lines(time.time()) if deadline else [])))
    return spec, prediction


def created_at() -> float:
    """When this flow run was created: the same on every retry of it."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    created = context and context.flow_run.created
    return created.timestamp() if created else time.time()


@task(name="stage-data", retries=2, retry_delay_seconds=[2, 10])
def stage_data(spec: ExperimentSpec) -> dict[str, str | None]:
    """Writes the Parquet data with data.generate when it is missing; returns the resolved locations."""
    uris = ensure_data(spec)
    get_run_logger().info("data ready: " + " ".join(f"{split}={uri}" for split, uri in uris.items() if uri))
    return uris
