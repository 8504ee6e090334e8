"""One experiment as one unit: the Prefect flow run, the cluster and the MLflow run live and die together.

    gpuflow run experiments/digits.yaml            # or: python -m flows.experiment experiments/digits.yaml
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger, runtime
from prefect.states import Cancelled

from cluster.backends import cluster_name_for, get_backend
from cluster.cost import hourly_cost, launched_price
from cluster.spec import ExperimentSpec
from flows.run_info import flow_run_ui_url, run_name_for, spec_from, tag_flow_run
from tasks.cancel import CancelWatcher
from tasks.compute import RunStopped, cost_check, deadline_check, provision, teardown, train
from tasks.cost import cost_metrics, idle_gpu_check, record_estimate, settle_budget
from tasks.prepare import stage_data, validate
from tasks.tracking import (
    close_mlflow_run, close_runs_of_flow_run, mlflow_status_for, open_mlflow_run, publish_summary, register_model,
)


def run_name() -> str:
    """Says what ran and when, e.g. digits-mlp-2026-11-21-0300."""
    return run_name_for(runtime.flow_run.parameters)


def release(flow, flow_run, state) -> None:
    """Cancel and crash hooks: may run in another process, so they find the cluster and MLflow run by flow-run id."""
    spec = spec_from(flow_run.parameters.get("spec"), flow_run.parameters.get("spec_file"))
    get_backend(spec.compute.backend).down(cluster_name_for(flow_run.id))
    close_runs_of_flow_run(spec, str(flow_run.id), "KILLED" if state.is_cancelled() else "FAILED")


@flow(name="run-experiment", flow_run_name=run_name, on_cancellation=[release], on_crashed=[release], log_prints=True)
def run_experiment(spec: ExperimentSpec, spec_file: str | None = None):
    """Validate → stage data + open the MLflow run + provision (side by side) → train → teardown → register.

    Args:
        spec: The experiment: what to train, on what data and compute, tracked where, within which limits.
        spec_file: Path of a YAML spec on the machine that runs the flow; when set, it is used instead of spec.
    """
    logger = get_run_logger()
    spec = spec_from(spec, spec_file)  # a bad YAML file fails the run here, naming the field
    tag_flow_run(runtime.flow_run.id, runtime.flow_run.tags, spec)
    spec = validate(spec)  # refuses a bad spec, or a run over budget, before anything starts
    estimate = hourly_cost(spec)
    cluster_name = cluster_name_for(runtime.flow_run.id)
    this_run = {"id": str(runtime.flow_run.id), "name": runtime.flow_run.name,
                "url": flow_run_ui_url(runtime.flow_run.id), "deployment": runtime.deployment.name}
    backend = get_backend(spec.compute.backend)
    started = time.time()
    phases: dict[str, float] = {}
    run_id, failure = None, None
    last_line_at = teardown_requested_at = None

    # A cancel from the UI reaches a `gpuflow run` process only through the API: downing the
    # cluster ends whatever step is running (launch or job), and the flow then ends Cancelled.
    cancel_watcher = CancelWatcher(runtime.flow_run.id, on_cancel=lambda: backend.down(cluster_name))
    cancel_watcher.start()

    # Data, tracking and the cluster have no order between them: start them together.
    data = stage_data.submit(spec)
    mlflow_run = open_mlflow_run.submit(spec, cluster_name, this_run)
    cluster = provision.submit(spec, cluster_name)
    try:
        run_id = mlflow_run.result()
        record_estimate(spec, run_id, estimate)
        data.result()
        handle = cluster.result()
        phases["provision_seconds"] = time.time() - started

        # The bill runs from the provision request; max_runtime_minutes bounds the job itself.
        if handle.info.get("hourly_cost_usd") is not None:  # what actually launched, where the backend knows it
            estimate = launched_price(estimate, handle.info["hourly_cost_usd"])
        stop_checks = [cost_check(spec, estimate.hourly_usd, started), deadline_check(spec, time.time()),
                       idle_gpu_check(spec, run_id)]
        env = {"MLFLOW_TRACKING_URI": spec.tracking_uri, "GPUFLOW_MLFLOW_RUN_ID": run_id}
        result = train(spec, handle, run_name=runtime.flow_run.name, env=env, stop_checks=stop_checks)
        phases["train_seconds"] = result.train_seconds
        if result.first_epoch_seconds:
            phases["first_epoch_seconds"] = result.first_epoch_seconds

        # The cluster is idle from the job's end: down it before registering, which needs only MLflow.
        last_line_at, teardown_requested_at = result.last_line_at or None, time.time()
        phases["teardown_seconds"] = teardown(spec, cluster_name)
        if spec.tracking.register_model:
            register_model(spec, run_id)
    except BaseException as exc:
        failure = RunStopped("cancelled", "cancelled from Prefect") if cancel_watcher.cancelled else exc
        if not cancel_watcher.cancelled:
            raise
    finally:
        cancel_watcher.stop()
        if "teardown_seconds" not in phases:
            if isinstance(failure, RunStopped) and failure.teardown_requested_at:  # the watchdog asked already
                last_line_at, teardown_requested_at = failure.last_line_at, failure.teardown_requested_at
            teardown_requested_at = teardown_requested_at or time.time()
            phases["teardown_seconds"] = teardown(spec, cluster_name)  # also cancels a launch still in flight
        if not cluster.state.is_final():
            cluster.wait()  # a launch that outran the teardown must not outlive the flow
            teardown(spec, cluster_name)
        phases["wall_seconds"] = time.time() - started
        costs = cost_metrics(estimate, started, time.time(), phases.get("provision_seconds"),
                             last_line_at, teardown_requested_at)
        status = mlflow_status_for(failure)
        if run_id:
            close_mlflow_run(spec, run_id, status, {**{f"gpuflow.{key}": value for key, value in phases.items()}, **costs},
                             tags={"stopped_by": failure.reason} if isinstance(failure, RunStopped) else None)
        elif failure is not None:
            close_runs_of_flow_run(spec, this_run["id"], status)
        settle_budget(spec, this_run["id"])  # the daily-budget reservation gives way to the cost just logged

    if cancel_watcher.cancelled:
        return Cancelled(message="cancelled from Prefect: cluster torn down, MLflow run KILLED")
    summary = {"run_id": run_id, "metrics": result.metrics, "checkpoint": result.checkpoint, "phases": phases,
               "experiment": spec.experiment_name, "tracking_uri": spec.tracking_uri, "cluster": cluster_name,
               "cost": costs, "price": estimate.describe()}
    publish_summary(spec, run_id, summary)
    logger.info(f"done in {phases['wall_seconds']:.1f}s: {result.metrics}")
    return summary


if __name__ == "__main__":
    import sys

    from cluster.spec import load_spec

    run_experiment(load_spec(sys.argv[1], sys.argv[2:]))
