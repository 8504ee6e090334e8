"""The cluster side of a flow run: provision, train (streaming the job's logs), teardown."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from cluster.backends import ClusterHandle, get_backend
from cluster.job import RESULT_PREFIX
from cluster.spec import ExperimentSpec

ANSI = re.compile(r"\x1b\[[0-9;]*m")
EPOCH_LINE = re.compile(r"\[gpuflow\] epoch (\d+):")
# Ray Train's own per-report chatter: kept out of the INFO log, still in DEBUG.
NOISE = ("Reporting training result", "Checkpoint successfully created", "Failed to query Ray Train Controller")


class JobFailed(RuntimeError):
    """The training job exited non-zero; the message holds the end of its log (the traceback)."""


class JobReported(Exception):
    """The job printed its result, its last act: the flow stops tailing instead of waiting for it to exit."""


class RunStopped(RuntimeError):
    """The job was stopped on purpose (timeout, budget, idle GPU, cancel); `reason` says which."""

    def __init__(self, reason: str, detail: str, last_line_at: float | None = None,
                 teardown_requested_at: float | None = None):
        self.reason = reason
        # for the run's bill: how long the cluster sat idle before the stop downed it
        self.last_line_at, self.teardown_requested_at = last_line_at, teardown_requested_at
        super().__init__(detail)


@dataclass
class TrainResult:
    metrics: dict = field(default_factory=dict)
    checkpoint: str | None = None
    storage: str | None = None
    first_epoch_seconds: float | None = None
    train_seconds: float = 0.0
    last_line_at: float = 0.0


def worth_retrying(task, task_run, state) -> bool:
    """A broken setup fails the same way again and a cancelled launch was meant: retry only the rest."""
    try:
        state.result()
    except Exception as exc:  # SkyPilot's classes, by name: tasks/ does not import the SDK
        return type(exc).__name__ not in ("CommandError", "RequestCancelled")
    return True


@task(name="provision", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying)
def provision(spec: ExperimentSpec, cluster_name: str) -> ClusterHandle:
    """Brings the cluster up (or finds it, on a retry of the same flow run)."""
    logger = get_run_logger()
    logger.info(f"provisioning {spec.compute.backend} cluster {cluster_name}: {spec.compute.num_nodes} node(s)")
    started = time.time()
    handle = get_backend(spec.compute.backend).launch(spec, cluster_name, on_line=lambda line: logger.info(line))
    logger.info(f"cluster {cluster_name} is up in {time.time() - started:.1f}s at {handle.address or 'remote'}")
    return handle


@task(name="train")
def train(spec: ExperimentSpec, handle: ClusterHandle, run_name: str, env: dict[str, str],
          stop_checks: list[Callable[[], tuple[str, str] | None]] = ()) -> TrainResult:
    """Runs the job on the cluster, its log streamed here; stopped and torn down if a stop check fires."""
    logger = get_run_logger()
    backend = get_backend(spec.compute.backend)
    result = TrainResult()
    started = time.time()
    progress = create_progress_artifact(0.0, description=f"{spec.name}: epochs done of {spec.train.epochs}")

    def on_line(raw: str) -> None:
        line = ANSI.sub("", raw).rstrip()
        result.last_line_at = time.time()
        if RESULT_PREFIX in line:  # SkyPilot prefixes each job line with "(task, pid=N) "
            payload = json.loads(line.split(RESULT_PREFIX, 1)[1])
            result.metrics, result.checkpoint, result.storage = payload["metrics"], payload["checkpoint"], payload["storage"]
        epoch = EPOCH_LINE.search(line)
        if epoch:
            result.first_epoch_seconds = result.first_epoch_seconds or time.time() - started
            update_progress_artifact(progress, 100.0 * (int(epoch.group(1)) + 1) / spec.train.epochs)
        (logger.debug if any(noise in line for noise in NOISE) else logger.info)(line)
        # Only a bare result line (the local backend's own log) ends the tail early: a SkyPilot line carries
        # its task prefix, and there the tail's return code is the job's outcome, which we would lose.
        if line.startswith(RESULT_PREFIX):
            raise JobReported

    job_id = backend.exec(handle, spec, run_name, env)
    watchdog = Watchdog(stop_checks, lambda: backend.down(handle.name))
    watchdog.start()
    try:
        exit_code = backend.tail_logs(handle, job_id, on_line)
    except JobReported:
        # The Ray driver's own shutdown takes seconds of idle cluster; the teardown that follows ends it.
        exit_code = 0
    finally:
        watchdog.finish()
    result.train_seconds = time.time() - started
    if watchdog.fired:
        reason, detail = watchdog.fired
        raise RunStopped(reason, detail, result.last_line_at or None, watchdog.fired_at)
    if exit_code != 0:
        raise JobFailed(f"training job failed with exit code {exit_code}; its traceback is in the log above")
    logger.info(f"training finished in {result.train_seconds:.1f}s: {result.metrics}")
    return result


@task(name="teardown", retries=2, retry_delay_seconds=[1, 5])
def teardown(spec: ExperimentSpec, cluster_name: str) -> float:
    """Downs the cluster; idempotent, so the flow's finally and the cancel/crash hooks can both call it."""
    logger = get_run_logger()
    started = time.time()
    logger.info(f"tearing down cluster {cluster_name}")
    existed = get_backend(spec.compute.backend).down(cluster_name)
    seconds = time.time() - started
    logger.info(f"cluster {cluster_name} {'is down' if existed else 'was already gone'} ({seconds:.1f}s)")
    return seconds


class Watchdog(threading.Thread):
    """Polls stop checks while the job runs; the first that fires stops the job by downing the cluster."""

    def __init__(self, checks, stop: Callable[[], object], interval_s: float = 1.0):
        super().__init__(daemon=True, name="gpuflow-watchdog")
        self.checks, self.stop, self.interval_s = list(checks), stop, interval_s
        self.fired: tuple[str, str] | None = None
        self.fired_at: float | None = None
        self._done = threading.Event()

    def run(self) -> None:
        while self.checks and not self._done.wait(self.interval_s):
            for check in self.checks:
                verdict = check()
                if verdict:
                    self.fired, self.fired_at = verdict, time.time()
                    self.stop()
                    return

    def finish(self) -> None:
        self._done.set()


def deadline_check(spec: ExperimentSpec, started: float) -> Callable[[], tuple[str, str] | None]:
    """Fires when limits.max_runtime_minutes have passed since `started` (the flow passes the job's start)."""
    limit_s = spec.limits.max_runtime_minutes * 60

    def check():
        elapsed = time.time() - started
        if elapsed >= limit_s:
            return "timeout", (f"stopped by timeout: the job ran {elapsed / 60:.1f} min, "
                               f"limits.max_runtime_minutes is {spec.limits.max_runtime_minutes}")
        return None

    return check


def cost_check(spec: ExperimentSpec, hourly_usd: float, started: float) -> Callable[[], tuple[str, str] | None]:
    """Fires when the cluster's cost since `started` (the provision request) reaches limits.max_cost_usd."""
    limit = spec.limits.max_cost_usd

    def check():
        if limit is None or hourly_usd <= 0:
            return None
        spent = hourly_usd * (time.time() - started) / 3600
        if spent >= limit:
            return "budget", f"stopped by budget: ${spent:.2f} spent of max_cost_usd={limit:.2f} (${hourly_usd:.4g}/h)"
        return None

    return check
