"""The job's own guard on the cluster: the run's limits and the flow's lease, enforced with no flow at all.

The flow enforces `limits.max_runtime_minutes` and `limits.max_cost_usd` while it lives; this guard enforces
them again inside the job, and stops the job when the flow stops renewing its lease (cluster/run/lease.py) for
`limits.orphan_grace_minutes`, or at once when the local cluster's owner process dies (SIGUSR1 from the
local backend's supervisor), or when the loop stops reporting (cluster/job/hung.py: its workers' stacks are saved).
Stopping: say why on the log, end the MLflow run with the reason (the checkpoints of every report are already in
storage), release the cluster, exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable

from gpuflow.cluster.job.hung import HungWatch
from gpuflow.cluster.protocol import (
    OWNER_DIED,
    STATUS_FOR_STOP,
    STOP_DETAIL_TAG,
    STOPPED_BY_TAG,
    JobEnv,
    stop_line,
    trained_then_orphaned,
    true_status,
)
from gpuflow.cluster.run.lease import LeaseWatch
from gpuflow.cluster.run.limits import Watchdog, cost_check, deadline_check
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.util.preload import after_background_imports

SELF_STOP_EXIT_CODE = 3
ABORT_TIMEOUT_S = 20.0  # for the training to stop and its tracker to log what it holds: within the owner's wait


def block_owner_signal() -> None:
    """The job's first act: OWNER_DIED is blocked in every thread (threads inherit the mask), so that only our
    sigwait takes it. A thread started before this would let it through, and its default action kills the job."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {OWNER_DIED})


class JobGuard:
    """Watches the job's limits and lease from a thread; the first that fires stops the job for good."""

    def __init__(self, spec: ExperimentSpec, job: JobEnv, release: Callable[[], None] = lambda: None):
        """`release` frees the cluster once the job is gone: the backend's way (the job's entry point chooses it)."""
        self.spec, self.release = spec, release
        self.run_id = job.mlflow_run_id
        self.requested_at = job.requested_at or time.time()
        self.hourly_usd = job.hourly_usd or 0.0
        self.notify_json = job.notify_json
        self.started = time.time()
        self._stopping = threading.Lock()
        checks = [
            deadline_check(spec.limits.max_runtime_minutes, self.started),
            cost_check(spec.limits.max_cost_usd, lambda: self.hourly_usd, self.requested_at),
        ]
        if self.run_id:
            lease = LeaseWatch(self.client(), self.run_id, spec.limits.orphan_grace_minutes * 60)
            checks.append(lease.check)
            if not spec.sweep:  # a sweep's trials report to runs of their own
                checks.append(HungWatch(lambda: lease.run, spec.limits.hung_minutes).check)
        self.watchdog = Watchdog(checks, self.stop, interval_s=lease_poll_s(spec), name="gpuflow-job-guard")

    @after_background_imports  # an early job's preload may be loading MLflow (cluster/util/preload.py)
    def client(self):
        from mlflow import MlflowClient

        return MlflowClient()

    def start(self) -> JobGuard:
        """Watches from two threads; `block_owner_signal()` must have run before any thread started."""
        threading.Thread(target=self._wait_for_owner_death, daemon=True, name="gpuflow-owner-watch").start()
        self.watchdog.start()
        return self

    def _wait_for_owner_death(self) -> None:
        signal.sigwait({OWNER_DIED})
        self.stop("orphaned", "stopped: the process that owned the cluster died (the flow was killed)")

    @after_background_imports  # from a watch thread: its imports (MLflow's, Ray Train's) after the preload's
    def stop(self, reason: str, detail: str) -> None:
        if not self._stopping.acquire(blocking=False):
            return
        if reason == "hung":  # before the stop line: the flow tears the cluster down once it reads that
            self.save_stacks()
        print(stop_line(reason, detail), flush=True)
        try:
            self.keep_what_was_made()
            self.close_run(reason, detail)
        finally:
            self.release()  # the cluster must not idle once the job is gone
            os._exit(SELF_STOP_EXIT_CODE)

    def settle(self) -> None:
        """Where the job's main thread ends, training over: while this guard stops the run (its abort ends the
        training), the guard ends the process once the run is closed; the main thread must not end it first."""
        if self._stopping.locked():
            threading.Event().wait()

    def keep_what_was_made(self) -> None:
        """Before the run is closed: its training stopped as Ctrl-C stops it (the reports the tracker still holds are
        logged), then what Ray Train persisted with a checkpoint and MLflow still lacks (cluster/job/reports.py)."""
        from gpuflow.cluster.util.ray_train_internals import abort_training

        abort_training(ABORT_TIMEOUT_S)
        if not self.run_id:
            return
        from gpuflow.cluster.job.reports import fill_from_checkpoints

        try:
            if filled := fill_from_checkpoints(self.client(), self.client().get_run(self.run_id)):
                print(f"[gpuflow] {filled} metric(s) logged from the persisted checkpoints", flush=True)
        except Exception as exc:  # the close goes on: a pass of the reaper cannot fill a closed run, say so
            print(f"[gpuflow] could not log the checkpoints' metrics: {type(exc).__name__}: {exc}", flush=True)

    def save_stacks(self) -> None:
        """Each worker's stacks, to the run's artifacts (hung/stacks.txt) and this log, before anything stops."""
        from gpuflow.cluster.job.stacks import worker_stacks

        try:
            stacks = worker_stacks(self.run_id) or "no worker answered: none had registered for stack dumps"
            print(stacks, flush=True)
            self.client().log_text(self.run_id, stacks, "hung/stacks.txt")
        except Exception as exc:  # the stop goes on: the run must not stay up for want of its stacks
            print(f"[gpuflow] could not save the workers' stacks: {type(exc).__name__}: {exc}", flush=True)

    def close_run(self, reason: str, detail: str) -> None:
        """Ends the MLflow run with the reason; the flow, if it still lives, keeps this status and adds its bill."""
        if not self.run_id:
            return
        from gpuflow.cluster.run.mlflow_run import close_run  # MLflow loads here only if the guard stops the run

        seconds = time.time() - self.requested_at
        bill = {"cost_usd": self.hourly_usd * seconds / 3600, "cluster_hours": seconds / 3600}
        status = STATUS_FOR_STOP.get(reason, "FAILED")
        if reason == "orphaned":  # the training may have ended well just before its flow's end was seen
            with contextlib.suppress(Exception):  # unread, the run is closed as stopped: the reaper reads it again
                tags = self.client().get_run(self.run_id).data.tags
                if (status := true_status(status, tags)) == "FINISHED":
                    detail = trained_then_orphaned(tags)
        close_run(
            self.client(),
            self.run_id,
            status,
            bill,
            {STOPPED_BY_TAG: reason, STOP_DETAIL_TAG: detail[:500]},
        )
        if reason == "orphaned" and self.notify_json:  # no flow is left to tell anyone
            from gpuflow.cluster.run.webhook import notify_orphaned

            failure = notify_orphaned(self.client(), self.run_id, self.notify_json, detail, bill["cost_usd"])
            if failure:
                print(f"[gpuflow] {failure}", flush=True)


def lease_poll_s(spec: ExperimentSpec) -> float:
    """How often the guard looks: a few times per grace period (and hung limit), at most every 10 s."""
    return max(0.5, min(10.0, spec.limits.orphan_grace_minutes * 60 / 6, (spec.limits.hung_minutes or 60) * 60 / 6))
