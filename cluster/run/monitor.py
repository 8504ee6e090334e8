"""Following the job from the flow: what a line of its log looks like on a terminal, how a failed job is told from
a lost cluster, and the stop checks the flow's watchdog polls. The meaning of each line is the contract's
(cluster/protocol.py); the train task (tasks/compute.py) acts on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuflow.cluster.protocol import CHECKPOINT_PERSISTED, PREEMPTED_EXIT_CODE, PREEMPTION_NOTICE_TAG, JobEnv
from gpuflow.cluster.run import limits
from gpuflow.cluster.run.lifecycle import Lifecycle
from gpuflow.cluster.run.limits import Check
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.elastic import nodes_needed
from gpuflow.cluster.util.waiting import wait_until

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, and the cursor moves of progress bars
FAILURE_TAIL_LINES = 60  # of the job's log, in the failure message: the traceback, even where the console hid it
JOB_DETAIL = "gpuflow_job_detail"  # set on the log record of a job line that is not gpuflow's own (Ray's, MLflow's)
# set on a log record that moves the run on: its fields, for the console (flows/cli/console.py)
PROGRESS = "gpuflow_progress"
# Ray Train's own per-report chatter: kept out of the INFO log, still in DEBUG.
NOISE = (
    "Reporting training result",
    "Checkpoint successfully created",
    "Failed to query Ray Train Controller",
    CHECKPOINT_PERSISTED,
)


def visible(raw: str) -> str:
    """What a terminal would show of a job's log line: progress bars redraw with \\r and cursor moves, and another
    process's line (an epoch's) can land after one on the same line."""
    shown = [part for part in ANSI.sub("", raw).split("\r") if part.strip()]
    return shown[-1].rstrip() if shown else ""


def progress(**fields) -> dict:
    """A log record's `extra` that marks it as progress: phase="training", or epoch/epochs/metrics/cost_usd..."""
    return {PROGRESS: fields}


class JobFailed(RuntimeError):
    """The training job exited non-zero; the message holds the end of its log (the traceback)."""

    def __init__(self, message: str, exit_code: int | None = None):
        self.exit_code = exit_code  # None: its log stream broke
        super().__init__(message)

    @property
    def killed(self) -> bool:
        """Ended by a signal or a broken stream, or by Ray Train on a node's preemption, not by its own error: what a
        lost node looks like at first."""
        return (
            self.exit_code is None
            or self.exit_code < 0
            or self.exit_code >= 128
            or self.exit_code == PREEMPTED_EXIT_CODE
        )


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


NOTICE_POLL_S = 2.0  # a notice leaves 30 s at least; each poll is one read of the MLflow run


def notice_check(env: dict[str, str]) -> Check:
    """Fires ("notice", what the node's watch said) once the run's spot-notice tag differs from what it was when the
    check was made: a node of the cluster that runs the job now has its cloud's notice (an earlier cluster's notice
    is on the run already). The tag, not the job's log line: every node's watch writes it, on every backend, where
    only the local backend's nodes print into the log the flow reads, and it is still read when that stream broke."""
    from mlflow import MlflowClient

    job = JobEnv.from_env(env)
    client = MlflowClient(job.tracking_uri)

    def tag() -> str | None:
        return client.get_run(job.mlflow_run_id).data.tags.get(PREEMPTION_NOTICE_TAG)

    try:
        before = tag()
    except Exception:  # MLflow blinked: a tag from before could be read as new, costing an early replacement at worst
        before = None

    def check():
        try:
            now = tag()
        except Exception:  # the next poll may do
            return None
        return ("notice", now) if now and now != before else None

    return check


LOSS_SETTLE_S = 90  # a job killed with its node: the cloud (or Slurm) may take this long to report the node gone


def elastic_loss_check(spec: ExperimentSpec, life: Lifecycle) -> Check:
    """An elastic run's cluster is lost only once it has fewer nodes than its minimum of workers needs: until then
    Ray Train trains on the nodes left (cluster/job/elastic.py)."""
    needed = nodes_needed(spec.compute)

    def check():
        if life.live_nodes is not None and life.live_nodes < needed:
            return "lost", (
                f"cluster {life.cluster_name}: {life.live_nodes} of {spec.compute.num_nodes} nodes left, "
                f"fewer than compute.num_workers' minimum of {spec.compute.min_workers} needs ({needed})"
            )
        return None

    return check


def lost_on(backend, cluster_name: str, failure: JobFailed) -> str | None:
    """Why the cluster a failed job ran on is lost, or None (the job's own error). A job Ray Train ended on a node's
    preemption has lost it whatever the backend reads: the deadline passed, the cloud takes the node any moment (or
    never does, where the notice was only an estimate), and a SkyPilot cluster whose node is still there reads UP."""
    if failure.exit_code == PREEMPTED_EXIT_CODE:
        return backend.lost(cluster_name) or f"cluster {cluster_name}: a node's spot notice ran out (preempted)"
    return lost_after(backend, cluster_name, LOSS_SETTLE_S if failure.killed else 0)


def lost_after(backend, cluster_name: str, settle_s: float) -> str | None:
    """Why the cluster is lost, asking again for up to `settle_s` (a job killed by a signal usually means a node
    went, but the cloud's view of it lags); None if it stays whole."""
    return wait_until(lambda: backend.lost(cluster_name), settle_s, interval_s=min(10.0, settle_s / 6))


def deadline_check(spec: ExperimentSpec, life: Lifecycle) -> Check:
    """limits.max_runtime_minutes bounds the job from its start on the cluster: a setup before it is not its runtime."""
    return limits.deadline_check(spec.limits.max_runtime_minutes, lambda: life.job_started_at)


def cost_check(spec: ExperimentSpec, life: Lifecycle) -> Check:
    return limits.cost_check(spec.limits.max_cost_usd, life.meter.hourly_usd, life.requested_at)
