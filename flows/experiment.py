"""One experiment as one unit: the Prefect flow run, the cluster and the MLflow run live and die together.

gpuflow run experiments/digits.yaml            # or: python -m gpuflow.flows.experiment experiments/digits.yaml
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from prefect import allow_failure, flow, get_run_logger, runtime
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Failed

from gpuflow.cluster.backends import (
    ClusterHandle,
    NoCapacity,
    cluster_name_for,
    cluster_names_for,
    flow_run_id_of,
    get_backend,
)
from gpuflow.cluster.cost.idle_gpu import idle_gpu_check
from gpuflow.cluster.cost.pricing import hourly_cost
from gpuflow.cluster.protocol import triggered_by
from gpuflow.cluster.rerun.for_flow import prepare_rerun
from gpuflow.cluster.rerun.reuse import reuse_off
from gpuflow.cluster.run.lifecycle import RunStopped
from gpuflow.cluster.run.limits import Check, Watchdog
from gpuflow.cluster.run.monitor import JobFailed, TrainResult, cost_check, deadline_check, lost_on
from gpuflow.cluster.run.record import close_runs_of_flow_run
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.flows.cancel_watch import CANCEL_POLL_S, cancel_check
from gpuflow.flows.capacity.replacement import Replacement
from gpuflow.flows.experiment_run import ExperimentRun
from gpuflow.flows.local_stack.prefect_api import stop_retrying_if_gone
from gpuflow.flows.prefect_internals import end_without_heartbeat_wait, quiet_on_broken_pipe
from gpuflow.flows.quota.hold import QueueCancelled, QueueTimeout, turn_for_gpus
from gpuflow.flows.run_logs import attach_gpuflow_loggers
from gpuflow.flows.run_messages import notify_end, notify_recovered, webhook_for
from gpuflow.flows.run_spec import form_policy_of_this_run, hooks_spec, spec_from
from gpuflow.flows.run_tags import REUSED_TAG_PREFIX, flow_run_ui_url, source_stamp_of, tag_flow_run
from gpuflow.tasks.compute import LeftCluster, metrics_line, provision, teardown, train
from gpuflow.tasks.prepare import stage_data, validate
from gpuflow.tasks.reuse import find_finished_twin, reused_summary
from gpuflow.tasks.tracking import open_mlflow_run, publish_summary, register_model

end_without_heartbeat_wait()  # a second at most, after every run


def run_name() -> str:
    """Says what ran, when and which: <spec name>-<UTC time>-<the flow run id's first 4 hex digits>, e.g.
    digits-mlp-2026-11-21-030000-3f9a: two runs started in the same second differ. A spec that does not parse still
    names its run."""
    parameters = runtime.flow_run.parameters
    try:
        name = spec_from(parameters.get("spec"), parameters.get("spec_file")).name
    except Exception:  # the flow itself reports the bad spec, with the field named
        name = "experiment"
    return f"{name}-{datetime.now(timezone.utc):%Y-%m-%d-%H%M%S}-{str(runtime.flow_run.id)[:4]}"


def release(flow, flow_run, state) -> None:
    """Cancel and crash hooks: may run in another process, so they find the cluster and MLflow run by flow-run id."""
    spec = hooks_spec(flow_run.parameters)
    backend = get_backend(spec.compute.backend)
    for cluster_name in cluster_names_for(flow_run.id, spec.compute.max_recoveries):
        backend.down(cluster_name)
    close_runs_of_flow_run(spec, str(flow_run.id), "KILLED" if state.is_cancelled() else "FAILED")


def this_flow_run() -> dict[str, str | None]:
    from prefect.context import FlowRunContext

    creator = FlowRunContext.get().flow_run.created_by  # self-hosted Prefect: a schedule or an automation, no person
    return {
        "id": str(runtime.flow_run.id),
        "name": runtime.flow_run.name,
        "url": flow_run_ui_url(runtime.flow_run.id),
        "deployment": runtime.deployment.name,
        "created_by": f"{(creator.type or '').lower()}:{creator.display_value}"
        if creator and creator.display_value
        else None,
        "triggered_by": triggered_by(FlowRunContext.get().flow_run.tags),
    }


def prepare_and_provision(run: ExperimentRun) -> ClusterHandle:
    """Stages the data, then opens the MLflow run (its work key digests the data), while the cluster is provisioned
    beside them; where the job starts with the cluster (SkyPilot: setup and training are one job), its data and
    MLflow run must exist before the launch."""
    spec, life = run.spec, run.life
    data = stage_data.submit(spec)
    # the run's work key digests the data: it opens once the data is staged (or staging failed, which it records)
    mlflow_run = open_mlflow_run.submit(spec, life.cluster_name, run.flow_run, wait_for=[allow_failure(data)])
    if run.backend.starts_job_at_launch:
        data.result()
        run.record.opened(mlflow_run.result(), life.meter.price)
        # the data and the MLflow run exist: launch on the first option with capacity, waiting for one if need be
        return run.capacity.provision(life.cluster_name, run.job())
    cluster = provision.submit(spec, life.cluster_name, None)
    life.launching(cluster)
    run.record.opened(mlflow_run.result(), life.meter.price)
    data.result()
    handle = cluster.result()
    if isinstance(handle, NoCapacity):  # a backend that starts no job at launch waits for no capacity
        raise handle
    run.capacity.launched(handle)
    return handle


def train_with_recovery(run: ExperimentRun, handle: ClusterHandle, stop_checks: list[Check]) -> TrainResult:
    """Trains; if the cluster is lost meanwhile (spot preemption, a node gone), relaunches it (named -r1, -r2, ...)
    and resumes from the last checkpoint, in the same MLflow run, up to compute.max_recoveries times. A spot notice
    starts the relaunched cluster before the loss (`Replacement`); so does a deadline's run on on-demand that can go
    back to spot, which then leaves its cluster at a checkpoint (a move, not a loss: no recovery is counted).

    A job that fails on a cluster that is still whole is the loop's own error: it fails the run at once."""
    spec, life, capacity, job = run.spec, run.life, run.capacity, run.job()
    recovery, clusters = 0, 1
    while True:
        replacement = Replacement(capacity, cluster_name_for(flow_run_id_of(handle.name), clusters), job.env, recovery)
        clusters += 1
        lost = None
        try:
            with replacement:  # on a spot notice, the next cluster is provisioned while this one trains
                # return_state: a direct call hands back the State the task chose (MOVED), not its answer
                trained = train(spec, handle, job, life, stop_checks, return_state=True).result()
            if not isinstance(trained, LeftCluster):
                return trained
        except JobFailed as failure:
            ended_at = time.time()
            lost = None if life.stopped else lost_on(run.backend, handle.name, failure)
            if not lost:
                raise
            relaunch_after(run, lost, ended_at, recovery)
            recovery += 1
            if handle.info.get("launched", {}).get("spot") == "true":
                capacity.spot_lost(lost)  # past compute.spot_fallback_after: on-demand, if the budget allows it
        # downs the lost (or left) one; the next is priced at the dearest option it may get, until it launches
        life.relaunching(replacement.name, hourly_cost(capacity.launch_spec))
        run.record.relaunched(life.meter.attempts)
        handle = replacement.take() or capacity.provision(life.cluster_name, job)
        if lost:
            notify_recovered(run, lost, recovery)


def relaunch_after(run: ExperimentRun, lost: str, ended_at: float, recovery: int) -> None:
    """Counts the loss; stops the run (`preempted`) when it was the last relaunch compute.max_recoveries allows."""
    spec, life = run.spec, run.life
    life.lost_cluster(lost, ended_at)
    if recovery == spec.compute.max_recoveries:
        detail = f"stopped: {lost}; compute.max_recoveries={spec.compute.max_recoveries} relaunches used up"
        life.stop("preempted", detail)
        raise RunStopped("preempted", detail) from None
    get_run_logger().warning(
        f"{lost}: relaunching it and resuming from the last checkpoint "
        f"(recovery {recovery + 1} of at most {spec.compute.max_recoveries})"
    )


@flow(
    name="run-experiment",
    flow_run_name=run_name,
    on_cancellation=[release],
    on_crashed=[release, notify_end],
    on_failure=[notify_end],
    on_completion=[notify_end],
    log_prints=True,
)
def run_experiment(
    spec: ExperimentSpec, spec_file: str | None = None, rerun_of: str | None = None, force: bool = False
):
    """Validate → reuse a finished run of the same work, if any → wait for the team's GPU quota → stage data + open
    the MLflow run + provision (side by side) → train → teardown → register.

    Args:
        spec: The experiment: what to train, on what data and compute, tracked where, within which limits.
        spec_file: Path of a YAML spec on the machine that runs the flow; when set, it is used instead of spec.
        rerun_of: An MLflow run id (or a Prefect flow run id) to run again as it ran: its spec, its commit and
            uncommitted changes, its data checked by digest (`gpuflow rerun`); the two runs are linked both ways.
            From the UI, `spec` then says only where the run is tracked.
        force: Train from scratch even when a FINISHED run has this run's work key (its code, data and training
            fields); off, such a run is reused: linked, with no cluster and nothing billed, and one that trained
            fewer epochs of the same is continued from its last checkpoint (the spec's `reuse: never` turns both off).
    """
    started = time.time()
    attach_gpuflow_loggers()  # gpuflow's own lines (the cluster's, the quota's) in this run's logs
    quiet_on_broken_pipe()  # a served run outlives its runner killed -9: its console goes quiet, not the run
    spec = spec_from(spec, spec_file)  # a bad YAML file fails the run here, naming the field
    if rerun_of:  # the run as it ran: its spec, its code checked out, its data checked; then a run as any other
        spec = prepare_rerun(rerun_of, spec, form_policy_of_this_run(), source_stamp_of)
    tags = tag_flow_run(runtime.flow_run.id, runtime.flow_run.tags, spec)
    spec, prediction = validate(spec)  # refuses a bad spec, or a run over budget, before anything starts
    webhook = webhook_for(spec)  # notify.block: a block that does not load refuses the run here
    twin = find_finished_twin(spec, force or bool(rerun_of))  # a rerun reproduces a run: it always trains
    if twin.run:
        tag_flow_run(runtime.flow_run.id, [*tags, REUSED_TAG_PREFIX + twin.run.info.run_id], spec)
        return reused_summary(spec, twin, time.time() - started)
    flow_run = {**this_flow_run(), "rerun_of": rerun_of, "reuse": not reuse_off(spec, force or bool(rerun_of))}
    if twin.continues:  # more epochs of a finished run: it starts from that run's last checkpoint
        flow_run.update(continues=twin.continues.info.run_id, continue_from=twin.checkpoint)
    try:
        # the quota's GPUs are held from before the provision request until the cluster is down
        with turn_for_gpus(spec, flow_run["id"]) as quota:
            run = ExperimentRun.begin(spec, flow_run, webhook, quota)
            run.record.prediction = prediction
            if quota.lease_id:  # it held a quota
                run.record.phases["queue_seconds"] = quota.waited_s
            return run_on_a_cluster(run)
    except (KeyboardInterrupt, TerminationSignal):  # stopped (a signal, Ctrl-C), torn down by now
        stop_retrying_if_gone()
        raise
    except QueueCancelled:
        return Cancelled(message="cancelled while waiting for the team's GPU quota: nothing was started")
    except QueueTimeout as exc:  # the sentence whole, not Prefect's "QueueTimeout: ..." with a traceback in the log
        get_run_logger().error(str(exc))
        return Failed(message=str(exc))


def run_on_a_cluster(run: ExperimentRun):
    """Provision → train (relaunching a lost cluster) → teardown → register, as one unit with the MLflow run."""
    spec, life, record = run.spec, run.life, run.record
    # A cancel from the UI reaches a `gpuflow run` process only through the API: a watchdog polls it, stops the run.
    with (
        life,
        Watchdog([cancel_check(run.flow_run["id"])], life.stop, CANCEL_POLL_S, name="gpuflow-cancel-watch"),
        record.phase("wall"),
    ):  # ends before the lifecycle closes the MLflow run, which logs the phases
        with record.phase("provision"):
            handle = prepare_and_provision(run)
        # max_runtime_minutes bounds the job itself; the bill counts from the provision request.
        stop_checks = [
            cost_check(spec, life),
            deadline_check(spec, life),
            idle_gpu_check(spec, run.run_id),
            run.capacity.quota.lost_check,  # the run's hold on the team's quota is gone
        ]
        result = train_with_recovery(run, handle, stop_checks)
        record.phases.update(train_seconds=result.train_seconds, first_epoch_seconds=result.first_epoch_seconds or 0)

        # The cluster is idle from the job's end: it goes down while the model is registered, which needs only MLflow.
        model_run_id = (result.sweep or {}).get("best_run_id") or run.run_id  # a sweep's model is its best trial's
        registering = register_model.submit(spec, model_run_id) if spec.tracking.register_model else None
        with record.phase("teardown"):
            teardown(life)  # down now, before the registration ends
        if registering:
            registering.result()

    if life.stop_reason == "cancelled":
        return Cancelled(message="cancelled from Prefect: cluster torn down, MLflow run KILLED")
    summary = {
        "run_id": run.run_id,
        "metrics": result.metrics,
        "checkpoint": result.checkpoint,
        "phases": record.phases,
        "experiment": spec.experiment_name,
        "tracking_uri": spec.tracking_uri,
        "cluster": life.cluster_name,
        "cost": life.bill(),
        "price": life.meter.price.describe(),
        "sweep": result.sweep,
    }
    publish_summary(spec, run.run_id, summary)
    get_run_logger().info(
        f"done in {record.phases['wall_seconds']:.1f}s: {metrics_line(result.metrics, telemetry=False)}"
    )
    return summary


if __name__ == "__main__":
    import sys

    from gpuflow.cluster.spec import load_spec

    run_experiment(load_spec(sys.argv[1], sys.argv[2:]))
