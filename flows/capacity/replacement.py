"""A cluster provisioned beside the one training, for the relaunch to take: on a spot notice (the relaunch after the
loss then starts on a cluster already up), and for a deadline's run on on-demand far enough ahead to go back to spot
(the on-demand cluster is then left at the loop's next checkpoint)."""

from __future__ import annotations

import logging
import threading
import time

from gpuflow.cluster.backends import ClusterHandle
from gpuflow.cluster.cost.deadline import Decision, Mode
from gpuflow.cluster.job.spot_watch import notices_possible
from gpuflow.cluster.run.limits import Watchdog
from gpuflow.cluster.run.monitor import NOTICE_POLL_S, notice_check
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.flows.capacity.waiting import RETRY_S, Capacity
from gpuflow.tasks.compute import provision

log = logging.getLogger(__name__)

REPLACING = "Replacing"  # the flow run's state from a spot notice until the run resumes on the replacement
CHECKPOINT_POLL_S = 0.2  # a move back to spot leaves the on-demand cluster this soon after the loop's checkpoint


def relaunches_on_notice(spec: ExperimentSpec, recovery: int) -> bool:
    """Whether a spot notice provisions the replacement cluster at once: when a relaunch is left, and the workers
    have no elastic range (`compute.num_workers: [min, max]` carries on without the node instead)."""
    return recovery < spec.compute.max_recoveries and not spec.compute.min_workers


class Replacement:
    """The cluster the next relaunch will use (`name`), provisioned when a node of the current one has its spot notice
    instead of after the loss: the resume then starts on a cluster already up. While the job trains, a watch reads
    the notice (the MLflow run's tag, `notice_check`). The relaunch takes it (`take`); if no loss comes (the job
    ended before the deadline, or failed on its own), the run's teardown downs it with the rest (`life.launching`)."""

    def __init__(self, capacity: Capacity, name: str, env: dict[str, str], recovery: int):
        self.capacity, self.name, self.quota = capacity, name, capacity.quota
        self.future, self.on_demand = None, capacity.on_demand
        self._done, self._next_spot_try = threading.Event(), 0.0
        watched = notices_possible(capacity.spec) and relaunches_on_notice(capacity.spec, recovery)
        checks = [notice_check(env)] if watched else []
        if capacity.deadline and capacity.on_demand:
            checks.append(self.spot_is_up)
        self.watch = Watchdog(checks, self.act, NOTICE_POLL_S, name="gpuflow-notice-watch")

    def act(self, reason: str, detail: str) -> None:
        if reason == "spot_is_up":
            self.leave_at_next_checkpoint(detail)
        else:
            self.provision(reason, detail)

    def spot_is_up(self) -> tuple[str, str] | None:
        """A deadline's run on on-demand, ahead of its pace by two changeovers (Uniform Progress's hysteresis): spot
        pays again. A spot cluster is launched beside (without spot capacity, tried again RETRY_S later); fires once
        it is up."""
        capacity = self.capacity
        if time.time() < self._next_spot_try:
            return None
        progress = capacity.life.progress(capacity.spec.train.epochs)
        choice = capacity.deadline.choose(time.time(), progress, True, Mode.ON_DEMAND)
        if choice.decision is not Decision.SPOT:
            return None
        if self.quota and not self.quota.hold_for_replacement():  # no room for a second cluster: ask again later
            self._next_spot_try = time.time() + RETRY_S
            return None
        log.info(f"deadline: {choice.reason}, ahead by two changeovers: launching spot beside on-demand: {self.name}")
        future = provision.submit(capacity.spec, self.name, None)  # the spec's own options: spot
        capacity.life.launching(future, self.name)
        if not isinstance(outcome := launch_outcome(future), ClusterHandle):  # no spot capacity, mostly
            log.info(f"deadline: no spot cluster beside on-demand ({type(outcome).__name__}); again in {RETRY_S:g} s")
            capacity.life.replacements.pop(self.name, None)  # nothing launched: nothing to bill
            if self.quota:
                self.quota.give_back_replacement()
            self._next_spot_try = time.time() + RETRY_S
            return None
        self.future, self.on_demand = future, False
        return "spot_is_up", f"spot cluster {self.name} is up"

    def leave_at_next_checkpoint(self, why: str) -> None:
        """Downs the on-demand cluster once the loop persists its next checkpoint (nothing is redone): its job ends,
        and the relaunch resumes from that checkpoint on the spot cluster, in the same MLflow run."""
        life = self.capacity.life
        message = f"deadline: {why}: moving to it at the next checkpoint"
        log.info(message)
        self.capacity.set_state(REPLACING, message)
        since = life.lost.checkpoint_at or 0.0
        while (life.lost.checkpoint_at or 0.0) <= since and not self._done.wait(CHECKPOINT_POLL_S):
            pass
        if self._done.is_set() or life.stopped:  # the job ended first: the spot cluster goes down with the run
            return
        log.info(f"deadline: checkpoint persisted: leaving on-demand cluster {life.cluster_name} for {self.name}")
        life.leave(self.name)

    def provision(self, _reason: str, notice: str) -> None:
        # two clusters bill from here: never on one share of the team's quota
        if self.quota and not self.quota.hold_for_replacement():
            log.warning(
                f"notice: no replacement cluster yet ({notice}): quota {self.quota.need.pool!r} has no room for a "
                "second cluster beside the one training; the relaunch provisions after the loss, on the run's slots"
            )
            return
        message = f"notice: replacement cluster provisioning: {self.name}, beside the one still training ({notice})"
        log.warning(message)
        self.capacity.set_state(REPLACING, message)
        self.future = provision.submit(self.capacity.launch_spec, self.name, None)
        self.capacity.life.launching(self.future, self.name)

    def take(self) -> ClusterHandle | None:
        """The replacement, once up (metered from its request); None when no notice asked for one, or it cannot
        serve (its launch failed, or the run went on-demand since): the relaunch then provisions as before."""
        if self.future is None:
            return None
        handle = launch_outcome(self.future)
        if not isinstance(handle, ClusterHandle):
            log.warning(
                f"replacement cluster {self.name} did not launch ({type(handle).__name__}: {handle}): provisioning "
                "it now"
            )
            handle = None
        if handle is not None and self.capacity.deadline:
            self.capacity.follow_deadline(spot_available=True)  # a spot cluster is up: unless the deadline's too near
        if handle is not None and self.on_demand != self.capacity.on_demand:  # spot, and the run is on-demand now
            self.capacity.life.down(self.name)
            handle = None
        if self.quota:
            self.quota.give_back_replacement()  # the lost cluster is down: the run's own share holds this one
        self.capacity.set_state(None, f"resuming on {self.name}")
        if handle is not None:
            self.capacity.launched(handle)
        return handle

    def __enter__(self) -> Replacement:
        self.watch.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self.watch.finish()
        self.watch.join(timeout=60)  # a notice being acted on: `take` must see its launch, not start a second one


def launch_outcome(future) -> ClusterHandle | Exception:
    """What a provision task submitted beside the training gave: its cluster, or why there is none (no capacity,
    which it returns, or what it raised)."""
    try:
        return future.result()
    except Exception as exc:
        return exc
