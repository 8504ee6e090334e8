"""The cluster side of a flow run, one task each: provision, train (following the job's log), teardown."""

from __future__ import annotations

import contextvars
import threading
import time
from collections import deque
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed

from gpuflow.cluster.backends import ClusterHandle, Job, NoCapacity, get_backend
from gpuflow.cluster.job.reports import STEP_KEYS
from gpuflow.cluster.protocol import MARK, RESULT_LINE, RESULT_PREFIX, epoch_metrics, parse_line
from gpuflow.cluster.run.lifecycle import Lifecycle, RunStopped
from gpuflow.cluster.run.limits import Check, Watchdog
from gpuflow.cluster.run.monitor import (
    ANSI,
    FAILURE_TAIL_LINES,
    JOB_DETAIL,
    NOISE,
    JobFailed,
    JobReported,
    TrainResult,
    elastic_loss_check,
    loss_check,
    progress,
    stopped_by_the_job,
    visible,
)
from gpuflow.cluster.spec import ExperimentSpec

NO_CAPACITY = "No capacity"  # a provision task run's state when no option had capacity
MOVED = "Moved"  # a train task run's state when the run left its cluster on purpose, at a checkpoint


@dataclass
class LeftCluster:
    """What a train task that ended in a move returns: the cluster the run resumes on."""

    for_cluster: str


def worth_retrying(task, task_run, state) -> bool:
    """A broken setup fails the same way again and a cancelled launch was meant: retry only the rest."""
    try:
        state.result()
    except Exception as exc:  # SkyPilot's classes, by name: tasks/ does not import the SDK
        return type(exc).__name__ not in ("CommandError", "RequestCancelled")
    return True


@task(name="provision", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying)
def provision(spec: ExperimentSpec, cluster_name: str, job: Job | None = None) -> ClusterHandle | NoCapacity:
    """Brings the cluster up (or finds it, on a retry of the same flow run); starts `job` with it where the backend
    does (SkyPilot). No option with capacity is an answer the flow acts on (wait, go on-demand), not a failure: the
    task run ends Completed, named NO_CAPACITY, and returns the NoCapacity with each option's reason; a run that
    waits an hour for GPUs shows a quiet line per try, not a red failed task."""
    logger = get_run_logger()
    logger.info(f"provisioning {spec.compute.backend} cluster {cluster_name}: {spec.compute.num_nodes} node(s)")
    started = time.time()
    try:
        handle = get_backend(spec.compute.backend).launch(spec, cluster_name, job=job)
    except NoCapacity as answer:
        reasons = "; ".join(f"{what}: {why}" for what, why in answer.reasons)
        logger.info(f"no capacity for cluster {cluster_name}: {reasons or answer}")
        return Completed(name=NO_CAPACITY, message=str(answer), data=answer)
    logger.info(f"cluster {cluster_name} is up in {time.time() - started:.1f}s at {handle.address or 'remote'}")
    return handle


@task(name="train", cache_policy=NO_CACHE)
def train(
    spec: ExperimentSpec, handle: ClusterHandle, job: Job, life: Lifecycle, stop_checks: list[Check] = ()
) -> TrainResult | LeftCluster:
    """Runs the job on the cluster, its log streamed here; a stop check that fires stops the run through `life`. A
    job ended by the run leaving its cluster (`life.leave`) ends the task Completed, named MOVED: a planned move,
    not a red task with the job's log."""
    logger = get_run_logger()
    backend = get_backend(spec.compute.backend)
    result = TrainResult()
    started = time.time()
    done_of = f"trials done of {spec.sweep.num_trials}" if spec.sweep else f"epochs done of {spec.train.epochs}"
    bar = ProgressBar(f"{spec.name}: {done_of}", logger)

    tail: deque[str] = deque(maxlen=FAILURE_TAIL_LINES)

    def on_line(raw: str) -> None:
        line = visible(raw)
        life.output()
        event = parse_line(line)
        extra = {JOB_DETAIL: MARK not in line or RESULT_PREFIX in line}
        if event is None:
            pass
        elif event.kind == "result":
            payload = event.value
            result.metrics, result.checkpoint, result.storage = (
                payload["metrics"],
                payload["checkpoint"],
                payload["storage"],
            )
            result.sweep = payload.get("sweep")
        elif event.kind == "nodes":  # an elastic run lost (or regained) nodes and trains on
            life.nodes_alive(*event.value)
        elif event.kind == "checkpoint":  # where a resume after a loss would start: lost compute counts from here
            life.checkpointed()
        elif event.kind == "resumed":
            life.resumed()
        elif event.kind == "setup_done":  # the job's setup (SkyPilot) ended: training starts
            life.job_started()
        elif event.kind == "stop":  # the job enforced a limit itself (and closed the MLflow run)
            life.stop(*event.value)
        elif event.kind == "epoch":
            life.epoch_done(event.value)
            result.first_epoch_seconds = result.first_epoch_seconds or time.time() - started
            if not spec.sweep:
                bar.set(100.0 * (event.value + 1) / spec.train.epochs)
                extra.update(epoch_progress(spec, event.value, line, life, time.time() - started))
        elif event.kind == "trial":
            done, total = event.value
            bar.set(100.0 * done / total)
            extra.update(progress(phase="training", trial=done, trials=total))
        tail.append(line)
        if any(noise in line for noise in NOISE):
            logger.debug(line)
        else:  # the console shows gpuflow's own lines, less the result's JSON; the Prefect run and log file keep all
            logger.info(line, extra=extra)
        # The job's result line is its last act: the tail ends there, not once the job's process and Ray have
        # stopped (seconds of an idle, billing cluster). The whole line, not what a terminal shows of it: a worker's
        # line holding the same text carries Ray's prefix, and a prefix before a \r is still a prefix.
        if RESULT_LINE.match(ANSI.sub("", raw)):
            raise JobReported

    job_id = backend.exec(handle, spec, job.run_name, job.env)
    if not backend.starts_job_at_launch:
        life.job_started()
    # Where asking is cheap (local), a lost node is noticed at once and its job ended, instead of Ray's own timeouts;
    # an elastic run's job trains on without the node, down to its minimum.
    if spec.compute.min_workers:
        loss_checks = [elastic_loss_check(spec, life)]
    else:
        loss_checks = [loss_check(backend, handle.name)] if backend.loss_poll_s else []
    with (
        Watchdog(stop_checks, life.stop),
        Watchdog(loss_checks, life.end_lost_job, interval_s=backend.loss_poll_s or 1),
    ):
        try:
            exit_code = backend.tail_logs(handle, job_id, on_line)
        except JobReported:
            # The Ray driver's own shutdown takes seconds of idle cluster; the teardown that follows ends it.
            exit_code = 0
        except Exception as exc:  # the log stream broke (a node gone, its connection cut): judged like a failed job
            if life.stopped or stopped_by_the_job(job.env, life):
                raise RunStopped(life.stop_reason, life.stop_detail) from exc
            if not life.leaving_for:
                raise JobFailed(f"lost the training job's log stream: {type(exc).__name__}: {exc}") from exc
            exit_code = None  # the stream broke as the run left its cluster
        finally:
            bar.close()
    result.train_seconds = time.time() - started
    if life.stopped or (exit_code != 0 and stopped_by_the_job(job.env, life)):
        raise RunStopped(life.stop_reason, life.stop_detail)
    if exit_code != 0 and life.leaving_for:
        moved = f"left cluster {handle.name} at its checkpoint for {life.leaving_for}: training resumes there"
        logger.info(moved)
        return Completed(name=MOVED, message=moved, data=LeftCluster(life.leaving_for))
    if exit_code != 0:
        raise JobFailed(
            f"training job failed with exit code {exit_code}; the end of its log:\n" + "\n".join(tail), exit_code
        )
    logger.info(f"training finished in {result.train_seconds:.1f}s: {metrics_line(result.metrics, telemetry=False)}")
    return result


def epoch_progress(spec: ExperimentSpec, epoch: int, line: str, life: Lifecycle, seconds: float) -> dict:
    """What the console makes of an epoch's line: epoch i of N, its metrics, the time so far and the bill."""
    return progress(
        phase="training",
        epoch=epoch + 1,
        epochs=spec.train.epochs,
        metrics=epoch_metrics(line),
        train_seconds=seconds,
        cost_usd=life.bill()["cost_usd"],
        hourly_usd=life.meter.live_hourly_usd(),
    )


@task(name="teardown", cache_policy=NO_CACHE)
def teardown(life: Lifecycle) -> float:
    """Downs the cluster (retried inside; idempotent, so the cancel/crash hooks and the reaper may call down too).
    The lifecycle says when it starts and when the cluster is down, on every path: not said twice here; its lines
    are this task's (its logger writes into the run that is current), so the console shows the run tearing down."""
    return life.teardown()


# -- the train task's progress bar in the Prefect UI ------------------------------------------------------------
# Each update is a call to Prefect's API. Made from the thread that reads the job's log, a Prefect server that is down
# or restarting would stall that thread for its client's retries (over a minute), and an update that fails at last
# would end the training it only reports on. So the bar is drawn by a thread of its own, with the latest value only,
# and a bar that cannot be drawn is skipped: training goes on without it.
TELEMETRY_PREFIX = "perf/"  # the step timer's figures (cluster/telemetry.py): in each epoch's line and the summary


def metrics_line(metrics: dict, telemetry: bool = True) -> str:
    """Metrics as a person reads them, `val_accuracy=0.975 train_loss=0.08`: without the loop's step counter (its
    epoch 9 is the console's 10/10), and without the telemetry figures on request."""
    return " ".join(
        f"{key}={value:.4g}" if isinstance(value, (int, float)) else f"{key}={value}"
        for key, value in metrics.items()
        if key not in STEP_KEYS and (telemetry or not key.startswith(TELEMETRY_PREFIX))
    )


class ProgressBar:
    def __init__(self, description: str, logger):
        self.logger = logger
        self._percent: float | None = None
        self._changed = threading.Event()
        self._closed = False
        context = contextvars.copy_context()  # the task run's: the bar belongs to it
        self._thread = threading.Thread(
            target=context.run, args=(self._draw, description), daemon=True, name="gpuflow-progress"
        )
        self._thread.start()

    def set(self, percent: float) -> None:
        self._percent = percent
        self._changed.set()

    def close(self, wait_s: float = 5.0) -> None:
        """Stops drawing once the last value set is drawn, waiting for that at most `wait_s`."""
        self._closed = True
        self._changed.set()
        self._thread.join(timeout=wait_s)

    def _draw(self, description: str) -> None:
        try:
            artifact_id, drawn = create_progress_artifact(0.0, description=description), 0.0
            while True:
                self._changed.wait()
                self._changed.clear()
                if self._percent is not None and self._percent != drawn:
                    drawn = self._percent
                    update_progress_artifact(artifact_id, drawn)
                if self._closed:
                    return
        except Exception as exc:  # Prefect's API is gone or refuses: the run goes on, its bar does not
            self.logger.warning(f"progress bar in Prefect stopped: {type(exc).__name__}: {exc}")
