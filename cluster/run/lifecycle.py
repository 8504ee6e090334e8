"""One owner of a run's cluster: why and when it stopped, what it cost, how the run ended.

    with Lifecycle(cluster_name, down=backend.down, meter=Meter(estimate)) as life:
        ...                       # the watchdog, the cancel watcher, the job's own stop: all call life.stop(reason)
        life.teardown()           # or leave the block: teardown runs whatever happened, then the run is closed

`stop(reason, detail)` is idempotent and thread-safe: the first reason wins and downs the cluster at once.
Leaving the block tears down (with retries), then hands the outcome (MLflow status, stopped_by) and the bill
to `close`, even when the teardown failed: then the error is raised after the run is closed, and the reaper
downs the cluster on its next pass. What the clusters cost is the meter's (`life.meter`); the lifecycle says when.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuflow.cluster.cost.deadline_run import Progress
from gpuflow.cluster.cost.pricing import Estimate
from gpuflow.cluster.protocol import STATUS_FOR_STOP
from gpuflow.cluster.run.losses import LostCompute
from gpuflow.cluster.run.meter import Meter

log = logging.getLogger(__name__)

TEARDOWN_DELAYS_S = (1, 5)


class RunStopped(RuntimeError):
    """The run was stopped on purpose or lost (timeout, budget, idle GPU, cancel, orphaned); `reason` says which."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(detail)


class TeardownFailed(RuntimeError):
    """The cluster could not be downed after retries; the reaper will try again."""


@dataclass(frozen=True)
class Outcome:
    status: str  # MLflow: FINISHED, FAILED, KILLED
    stopped_by: str | None
    message: str


class Lifecycle:
    def __init__(
        self,
        cluster_name: str,
        down: Callable[[str], object],
        meter: Meter,
        close: Callable[[Outcome, dict], None] | None = None,
        workers: int = 1,
    ):
        self.cluster_name, self.down, self.meter, self.close = cluster_name, down, meter, close
        self._launches: list = []  # (future of a launch in flight, anything with .wait(); its cluster's name or None)
        self.replacements: dict[str, float] = {}  # a cluster asked for on a spot notice, not used yet: its request
        self.launched_at: float | None = None
        self.job_started_at: float | None = None  # the training job's first start (after setup): limits count from it
        self.last_output_at: float | None = None  # the job's last log line: idle from here to the teardown
        self.teardown_requested_at: float | None = None
        self.teardown_seconds: float | None = None
        self.teardown_error: BaseException | None = None
        self.recoveries = 0
        self.live_nodes: int | None = None  # an elastic run's nodes left, as its job says; None: all of them
        self.lost = LostCompute(workers)  # what the losses cost (cluster/run/losses.py)
        self.epochs_seen: tuple[int, int] | None = None  # the first epoch reported (past 0 on a continuation), last + 1
        self.epochs_at_checkpoint = 0  # epochs_seen's last when the last checkpoint was persisted
        self._loss_seen_at: float | None = None  # the loss check's first sight of the loss being relaunched
        self.leaving_for: str | None = None  # the cluster the run is moving to, leaving this one on purpose
        self.ended_at: float | None = None
        self.stop_reason: str | None = None
        self.stop_detail = ""
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def requested_at(self) -> float:
        """The provision request: the bill runs from here."""
        return self.meter.requested_at

    # -- during the run ----------------------------------------------------------------------------
    def launching(self, future, replacement: str | None = None) -> None:
        """A launch in flight (of the run's cluster, or of the `replacement` named): the end waits for it, so that a
        launch outrunning the teardown cannot outlive the run."""
        if replacement:
            self.replacements[replacement] = time.time()
        self._launches.append((future, replacement))

    def launched(
        self, hourly_usd: float | None = None, price: Estimate | None = None, option: str | None = None
    ) -> None:
        """The cluster is up; the meter prices it (Meter.launched)."""
        self.launched_at = self.launched_at or time.time()
        self.meter.launched(hourly_usd, price, option)

    def job_started(self) -> None:
        self.job_started_at = self.job_started_at or time.time()

    def epoch_done(self, epoch: int | None = None) -> None:
        """An epoch (its index) reported: the end of a recovery's `recovery_seconds`."""
        self.lost.epoch()
        if epoch is not None:
            first, seen = self.epochs_seen or (epoch, 0)
            self.epochs_seen = (min(first, epoch), max(seen, epoch + 1))

    def checkpointed(self) -> None:
        """A checkpoint is persisted: where a resume would start from."""
        self.lost.checkpointed()
        self.epochs_at_checkpoint = self.epochs_seen[1] if self.epochs_seen else 0

    def progress(self, epochs: int) -> Progress:
        """How far training is (a deadline's decisions): its productive seconds, and the share of its `epochs` the
        last checkpoint holds."""
        done_s = self.lost.productive_s(self.job_started_at, time.time())
        if self.epochs_seen is None:
            return Progress(done_s)
        first = self.epochs_seen[0]
        return Progress(done_s, max(0, self.epochs_at_checkpoint - first) / max(1, epochs - first))

    def resumed(self) -> None:
        """The loop restored a checkpoint and trains again."""
        self.lost.resumed()

    def nodes_alive(self, alive: int, of: int) -> None:
        """An elastic run's cluster has `alive` of its `of` nodes: billed for those from now (it is not relaunched)."""
        if alive != self.live_nodes:
            log.warning(
                f"cluster {self.cluster_name}: {alive} of {of} nodes alive; training goes on, billed for {alive}"
            )
        if alive < (self.live_nodes or of):  # Ray Train restarts the workers from the last checkpoint on the rest
            self.lost.lost(time.time(), self.job_started_at or self.launched_at, self.lost.workers * alive // of)
        self.live_nodes = alive
        self.meter.resized(alive)

    def lost_cluster(self, why: str, job_ended_at: float | None = None) -> None:
        """The cluster was lost mid-job: the work since the last checkpoint is gone, and a recovery begins. The loss
        counts from the loss check's first sight of it, else from the job's end (its node's loss may be confirmed
        only seconds later)."""
        at = min(t for t in (self._loss_seen_at, job_ended_at, time.time()) if t is not None)
        self._loss_seen_at = None
        self.lost.lost(
            at,
            self.job_started_at or self.launched_at,
            replacements_requested=tuple(t for t in self.replacements.values() if t < at),
        )
        self.recoveries += 1
        log.warning(f"cluster {self.cluster_name} lost: {why}")

    def end_lost_job(self, reason: str, why: str) -> None:
        """A node of the cluster is gone: what is left of it is downed now, so that its job ends at once instead of
        after Ray's own timeouts. Whether the run relaunches is the flow's call once the job has ended."""
        self._loss_seen_at = self._loss_seen_at or time.time()
        log.warning(f"cluster {self.cluster_name}: {why}; ending its job")
        try:
            self.down(self.cluster_name)
        except Exception:  # the relaunch, or the teardown at the end, downs it again
            pass

    def leave(self, for_cluster: str) -> None:
        """The run leaves its cluster for `for_cluster` (a deadline's move back to spot, at a checkpoint): downing it
        ends its job, a move and not a loss."""
        self.leaving_for = for_cluster
        self.down(self.cluster_name)

    def relaunching(self, cluster_name: str, price: Estimate | None = None) -> dict:
        """The lost cluster is downed; from now on the run's cluster is the relaunched one, metered at `price` until
        it launches (from its request: a replacement asked for on a notice bills from then). Returns the attempt
        that ended: its option, price and cost."""
        self.down(self.cluster_name)
        self.cluster_name, self.live_nodes, self.leaving_for = cluster_name, None, None
        return self.meter.relaunched(price, self.replacements.pop(cluster_name, None))

    def output(self) -> None:
        self.last_output_at = time.time()

    def stop(self, reason: str, detail: str) -> bool:
        """Stops the run for `reason`: downs the cluster now (ending whatever step runs). Only the first call acts."""
        with self._lock:
            if self.stop_reason is not None:
                return False
            self.stop_reason, self.stop_detail = reason, detail
            self.teardown_requested_at = time.time()
        self._stopped.set()
        log.warning(f"{detail}: tearing down cluster {self.cluster_name}")
        try:
            self.down(self.cluster_name)
        except Exception:  # the teardown at the end retries, and says why if it still fails
            pass
        return True

    def stopped_wait(self, seconds: float) -> bool:
        """Sleeps `seconds`, or less if the run is stopped meanwhile; True when it was."""
        return self._stopped.wait(seconds)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    # -- the end --------------------------------------------------------------------------------------
    def teardown(self) -> float:
        """Downs the cluster (idempotent; retried); returns the seconds it took. Raises TeardownFailed."""
        if self.teardown_seconds is not None:
            return self.teardown_seconds
        self.teardown_requested_at = self.teardown_requested_at or time.time()
        started = time.time()
        log.info(f"tearing down cluster {self.cluster_name}")
        # after a failed teardown (the block then ends with it), one more try, not the whole series again
        for delay in (None,) if self.teardown_error else (*TEARDOWN_DELAYS_S, None):
            try:
                for name in (self.cluster_name, *self.replacements):
                    self.down(name)
                for launch, name in self._launches:  # downing cancelled it; wait, and down whatever it still made
                    launch.wait()
                    self.down(name or self.cluster_name)
                self._launches.clear()
                self.teardown_error = None
                break
            except Exception as exc:
                self.teardown_error = exc
                log.warning(f"teardown of {self.cluster_name} failed: {type(exc).__name__}: {exc}")
                if delay is None:
                    raise TeardownFailed(
                        f"could not tear down cluster {self.cluster_name} after {len(TEARDOWN_DELAYS_S) + 1} tries: "
                        f"{type(exc).__name__}: {exc}. The reaper (flows/reaper.py) downs it on its next pass; "
                        f"or run `gpuflow down {self.cluster_name}`"
                    ) from exc
                time.sleep(delay)
        self.teardown_seconds = time.time() - started
        for requested_at in self.replacements.values():
            self.meter.unused(requested_at, time.time())
        self.replacements.clear()
        log.info(f"cluster {self.cluster_name} is down ({self.teardown_seconds:.1f}s)")
        return self.teardown_seconds

    def outcome(self, error: BaseException | None) -> Outcome:
        if self.stop_reason:
            return Outcome(STATUS_FOR_STOP.get(self.stop_reason, "FAILED"), self.stop_reason, self.stop_detail)
        if error is None:
            return Outcome("FINISHED", None, "finished")
        if not isinstance(error, Exception):  # Ctrl-C, SIGTERM, the runner's TerminationSignal
            return Outcome("KILLED", "interrupted", f"interrupted ({type(error).__name__})")
        return Outcome("FAILED", None, str(error))

    def bill(self, ended: float | None = None) -> dict[str, float]:
        """The run's cost (the meter's: each cluster from its provision request to the end of its teardown) and
        its times: provisioning, idle before the teardown, the teardown, the recoveries."""
        metrics = self.meter.cost(ended)
        if self.launched_at:
            metrics["provision_seconds"] = self.launched_at - self.requested_at
        if self.last_output_at and self.teardown_requested_at:
            metrics["idle_seconds_before_teardown"] = max(0.0, self.teardown_requested_at - self.last_output_at)
        if self.teardown_seconds is not None:
            metrics["teardown_seconds"] = self.teardown_seconds
        if self.recoveries:
            metrics["recoveries"] = self.recoveries
        return {**metrics, **self.lost.metrics()}

    def __enter__(self) -> Lifecycle:
        return self

    def __exit__(self, exc_type, error, tb) -> bool:
        teardown_failure = None
        try:
            self.teardown()
        except TeardownFailed as exc:
            teardown_failure = exc
        outcome = self.outcome(error)
        self.ended_at = time.time()  # the bill and each attempt's cost end at the same instant
        if self.close:
            self.close(outcome, self.bill(self.ended_at))
        if teardown_failure:
            raise teardown_failure from error
        if self.stop_reason == "cancelled":
            return True  # meant: the flow reports Cancelled
        if self.stop_reason:
            raise RunStopped(self.stop_reason, self.stop_detail) from error
        return False
