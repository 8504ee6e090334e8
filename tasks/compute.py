"""The cluster side of a flow run: provision, train (streaming the job's logs), teardown."""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from gpuflow.cluster.run import limits
from gpuflow.cluster.backends import ClusterHandle, Job, cluster_name_for, flow_run_id_of, get_backend
from gpuflow.cluster.run.lifecycle import Lifecycle, RunStopped
from gpuflow.cluster.run.limits import Check, Watchdog
from gpuflow.cluster.protocol import MARK, RESULT_LINE, RESULT_PREFIX, JobEnv, parse_line
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.tasks.progress import ProgressBar, metrics_line

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, and the cursor moves of progress bars
FAILURE_TAIL_LINES = 60  # of the job's log, in the failure message: the traceback, even where the console hid it
JOB_DETAIL = "gpuflow_job_detail"  # set on the log record of a job line that is not gpuflow's own (Ray's, MLflow's)
# Ray Train's own per-report chatter: kept out of the INFO log, still in DEBUG.
NOISE = ("Reporting training result", "Checkpoint successfully created", "Failed to query Ray Train Controller")


def visible(raw: str) -> str:
    """What a terminal would show of a job's log line: progress bars redraw with \\r and cursor moves, and another
    process's line (an epoch's) can land after one on the same line."""
    shown = [part for part in ANSI.sub("", raw).split("\r") if part.strip()]
    return shown[-1].rstrip() if shown else ""


class JobFailed(RuntimeError):
    """The training job exited non-zero; the message holds the end of its log (the traceback)."""

    def __init__(self, message: str, exit_code: int | None = None):
        self.exit_code = exit_code  # None: its log stream broke
        super().__init__(message)

    @property
    def killed(self) -> bool:
        """Ended by a signal or a broken stream, not by its own error: what a lost node looks like at first."""
        return self.exit_code is None or self.exit_code < 0 or self.exit_code >= 128


class JobReported(Exception):
    """The job printed its result, its last act: the flow stops tailing instead of waiting for it to exit."""


@dataclass
class TrainResult:
    metrics: dict = field(default_factory=dict)
    checkpoint: str | None = None
    storage: str | None = None
    first_epoch_seconds: float | None = None
    train_seconds: float = 0.0
    sweep: dict | None = None  # a sweep's best trial (its MLflow run, values) and trial counts


def worth_retrying(task, task_run, state) -> bool:
    """A broken setup fails the same way again and a cancelled launch was meant: retry only the rest."""
    try:
        state.result()
    except Exception as exc:  # SkyPilot's classes, by name: tasks/ does not import the SDK
        return type(exc).__name__ not in ("CommandError", "RequestCancelled")
    return True


@task(name="provision", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying)
def provision(spec: ExperimentSpec, cluster_name: str, job: Job | None = None) -> ClusterHandle:
    """Brings the cluster up (or finds it, on a retry of the same flow run); starts `job` with it where the backend
    does (SkyPilot)."""
    logger = get_run_logger()
    logger.info(f"provisioning {spec.compute.backend} cluster {cluster_name}: {spec.compute.num_nodes} node(s)")
    started = time.time()
    handle = get_backend(spec.compute.backend).launch(spec, cluster_name, on_line=lambda line: logger.info(line),
                                                      job=job)
    logger.info(f"cluster {cluster_name} is up in {time.time() - started:.1f}s at {handle.address or 'remote'}")
    return handle


@task(name="train", cache_policy=NO_CACHE)
def train(spec: ExperimentSpec, handle: ClusterHandle, job: Job, life: Lifecycle,
          stop_checks: list[Check] = ()) -> TrainResult:
    """Runs the job on the cluster, its log streamed here; a stop check that fires stops the run through `life`."""
    logger = get_run_logger()
    backend = get_backend(spec.compute.backend)
    result = TrainResult()
    started = time.time()
    done_of = f"trials done of {spec.sweep.num_trials}" if spec.sweep else f"epochs done of {spec.train.epochs}"
    progress = ProgressBar(f"{spec.name}: {done_of}", logger)

    tail: deque[str] = deque(maxlen=FAILURE_TAIL_LINES)

    def on_line(raw: str) -> None:
        line = visible(raw)
        life.output()
        event = parse_line(line)
        if event is None:
            pass
        elif event.kind == "result":
            payload = event.value
            result.metrics, result.checkpoint, result.storage = payload["metrics"], payload["checkpoint"], payload["storage"]
            result.sweep = payload.get("sweep")
        elif event.kind == "setup_done":  # the job's setup (SkyPilot) ended: training starts
            life.job_started()
        elif event.kind == "stop":  # the job enforced a limit itself (and closed the MLflow run)
            life.stop(*event.value)
        elif event.kind == "epoch":
            life.epoch_done()
            result.first_epoch_seconds = result.first_epoch_seconds or time.time() - started
            if not spec.sweep:
                progress.set(100.0 * (event.value + 1) / spec.train.epochs)
        elif event.kind == "trial":
            done, total = event.value
            progress.set(100.0 * done / total)
        tail.append(line)
        if any(noise in line for noise in NOISE):
            logger.debug(line)
        else:  # the console shows gpuflow's own lines, less the result's JSON; the Prefect run and the log file keep all
            logger.info(line, extra={JOB_DETAIL: MARK not in line or RESULT_PREFIX in line})
        # The job's result line is its last act: the tail ends there, not once the job's process and Ray have
        # stopped (seconds of an idle, billing cluster). The whole line, not what a terminal shows of it: a worker's
        # line holding the same text carries Ray's prefix, and a prefix before a \r is still a prefix.
        if RESULT_LINE.match(ANSI.sub("", raw)):
            raise JobReported

    job_id = backend.exec(handle, spec, job.run_name, job.env)
    if not backend.starts_job_at_launch:
        life.job_started()
    # Where asking is cheap (local), a lost node is noticed at once and its job ended, instead of Ray's own timeouts.
    loss_checks = [loss_check(backend, handle.name)] if backend.loss_poll_s else []
    with Watchdog(stop_checks, life.stop), \
            Watchdog(loss_checks, lambda reason, why: backend.down(handle.name), interval_s=backend.loss_poll_s or 1):
        try:
            exit_code = backend.tail_logs(handle, job_id, on_line)
        except JobReported:
            # The Ray driver's own shutdown takes seconds of idle cluster; the teardown that follows ends it.
            exit_code = 0
        except Exception as exc:  # the log stream broke (a node gone, its connection cut): judged like a failed job
            if life.stopped or stopped_by_the_job(job.env, life):
                raise RunStopped(life.stop_reason, life.stop_detail) from exc
            raise JobFailed(f"lost the training job's log stream: {type(exc).__name__}: {exc}") from exc
        finally:
            progress.close()
    result.train_seconds = time.time() - started
    if life.stopped or (exit_code != 0 and stopped_by_the_job(job.env, life)):
        raise RunStopped(life.stop_reason, life.stop_detail)
    if exit_code != 0:
        raise JobFailed(f"training job failed with exit code {exit_code}; the end of its log:\n" + "\n".join(tail),
                        exit_code)
    logger.info(f"training finished in {result.train_seconds:.1f}s: {metrics_line(result.metrics, telemetry=False)}")
    return result


def stopped_by_the_job(env: dict[str, str], life: Lifecycle) -> bool:
    """Whether the job stopped the run itself (a limit, or its lease gone stale while this process was frozen),
    even if its stop line never reached us: it closed the MLflow run with the reason. Never relaunch such a run."""
    from mlflow import MlflowClient

    from gpuflow.cluster.run.mlflow_run import stop_of_closed_run

    job = JobEnv.from_env(env)
    stop = stop_of_closed_run(MlflowClient(job.tracking_uri), job.mlflow_run_id)
    if stop:
        life.stop(*stop)
    return stop is not None


def loss_check(backend, cluster_name: str) -> Check:
    def check():
        why = backend.lost(cluster_name)
        return ("lost", why) if why else None

    return check


LOSS_SETTLE_S = 90  # a job killed with its node: the cloud (or Slurm) may take this long to report the node gone


def lost_after(backend, cluster_name: str, settle_s: float) -> str | None:
    """Why the cluster is lost, asking again for up to `settle_s` (a job killed by a signal usually means a node
    went, but the cloud's view of it lags); None if it stays whole."""
    deadline = time.monotonic() + settle_s
    while True:
        why = backend.lost(cluster_name)
        if why or time.monotonic() >= deadline:
            return why
        time.sleep(min(10.0, settle_s / 6))


def train_resuming(spec: ExperimentSpec, handle: ClusterHandle, job: Job, life: Lifecycle,
                   stop_checks: list[Check] = ()) -> TrainResult:
    """Trains; if the cluster is lost meanwhile (spot preemption, a node gone), relaunches it (named -r1, -r2, ...)
    and resumes from the last checkpoint, in the same MLflow run, up to compute.max_recoveries times.

    A job that fails on a cluster that is still whole is the loop's own error: it fails the run at once."""
    backend = get_backend(spec.compute.backend)
    for recovery in range(spec.compute.max_recoveries + 1):
        try:
            return train(spec, handle, job, life, stop_checks)
        except JobFailed as failure:
            lost = None if life.stopped else lost_after(backend, handle.name, LOSS_SETTLE_S if failure.killed else 0)
            if not lost:
                raise
            life.lost_cluster(lost)
            if recovery == spec.compute.max_recoveries:
                detail = f"stopped: {lost}; compute.max_recoveries={spec.compute.max_recoveries} relaunches used up"
                life.stop("preempted", detail)
                raise RunStopped("preempted", detail) from None
            get_run_logger().warning(f"{lost}: relaunching it and resuming from the last checkpoint "
                                     f"(recovery {recovery + 1} of at most {spec.compute.max_recoveries})")
            life.relaunching(cluster_name_for(flow_run_id_of(handle.name), recovery + 1))  # downs the lost one
            handle = provision(spec, life.cluster_name, job)
    raise AssertionError("unreachable")


@task(name="teardown", cache_policy=NO_CACHE)
def teardown(life: Lifecycle) -> float:
    """Downs the cluster (retried inside; idempotent, so the cancel/crash hooks and the reaper may call down too).
    The lifecycle says when it starts and when the cluster is down, on every path: not said twice here."""
    return life.teardown()


def deadline_check(spec: ExperimentSpec, life: Lifecycle) -> Check:
    """limits.max_runtime_minutes bounds the job from its start on the cluster: a setup before it is not its runtime."""
    return limits.deadline_check(spec.limits.max_runtime_minutes, lambda: life.job_started_at)


def cost_check(spec: ExperimentSpec, life: Lifecycle) -> Check:
    return limits.cost_check(spec.limits.max_cost_usd, life.hourly_usd, life.requested_at)
