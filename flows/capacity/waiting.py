"""Getting a cluster when GPUs are scarce: SkyPilot fails over across the spec's options itself; when none has
capacity, the run waits (not billed: no cluster exists) and tries again for up to limits.max_queue_minutes, its
Prefect state saying what it waits for; after compute.spot_fallback_after spot losses it goes on-demand, once the
budget allows the dearer price; with a deadline (limits.deadline), each launch is spot, on-demand or a wait for
spot as the run's progress against the deadline says (cluster/cost/deadline_run.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import cached_property

from gpuflow.cluster.backends import ClusterHandle, Job
from gpuflow.cluster.cost.deadline import Decision
from gpuflow.cluster.cost.deadline_run import DeadlineClock
from gpuflow.cluster.cost.pricing import hourly_cost, option_price
from gpuflow.cluster.protocol import ENV_NAMES
from gpuflow.cluster.run.lifecycle import Lifecycle, RunStopped
from gpuflow.cluster.run.record import RunRecord
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.options import compute_options, on_demand_spec
from gpuflow.flows.quota.hold import QuotaHold
from gpuflow.tasks.compute import provision

log = logging.getLogger(__name__)

WAITING = "Waiting for capacity"  # the flow run's state while no option has capacity
WAITING_FOR_SPOT = "Waiting for spot"  # a deadline's run ahead of its pace, with no spot to be had
RETRY_S = 30.0  # between two tries of every option: SkyPilot's own failover already tried each


class CapacityTimeout(RuntimeError):
    """No option had capacity within limits.max_queue_minutes; the message lists each option and its reason."""


class Capacity:
    def __init__(
        self,
        record: RunRecord,
        life: Lifecycle,
        set_state: Callable[[str | None, str], None] | None = None,
        quota: QuotaHold | None = None,
    ):
        """quota: the run's hold on the team's quota, if it has one: a replacement cluster takes a share of its own."""
        self.spec, self.flow_run_id, self.life, self.record = record.spec, record.flow_run_id, life, record
        self.quota = quota
        self.set_state = set_state or prefect_state(record.flow_run_id)
        self.spot_losses = 0
        self.on_demand = False
        self.attempt = 0

    @property
    def launch_spec(self) -> ExperimentSpec:
        return on_demand_spec(self.spec) if self.on_demand else self.spec

    def provision(self, cluster_name: str, job: Job | None) -> ClusterHandle:
        """Launches on the first option with capacity, waiting for one for up to limits.max_queue_minutes."""
        started, waited_said, spot_available = time.monotonic(), False, True
        limit_s = self.spec.limits.max_queue_minutes * 60
        while True:
            tried_at = time.time()
            if self.deadline and not self.follow_deadline(spot_available):  # ahead of its pace: no spot, no cost
                job, spot_available = self.wait_unbilled(RETRY_S, job, tried_at), True  # then try spot again
                continue
            # return_state: a direct call hands back the State the task chose (NO_CAPACITY), not its answer
            answer = provision(self.launch_spec, cluster_name, job, return_state=True).result()
            if isinstance(answer, ClusterHandle):
                if waited_said:
                    self.set_state(None, f"capacity found after {(time.monotonic() - started) / 60:.1f} min")
                self.launched(answer)
                return answer
            self.life.meter.not_billed_until(time.time())  # no cluster exists: the wait is not billed
            if self.life.stopped:
                raise answer
            if answer.spot and self.deadline:
                spot_available = False  # the deadline decides: on-demand at once, or wait for spot
                continue
            if answer.spot and self.spot_lost(f"no spot capacity ({len(answer.reasons)} option(s))"):
                continue  # on-demand now: try at once
            waited = time.monotonic() - started
            if waited >= limit_s:
                raise CapacityTimeout(
                    f"limits.max_queue_minutes: no capacity for {waited / 60:.1f} min (limit "
                    f"{self.spec.limits.max_queue_minutes:g}); nothing is running and nothing was billed. "
                    + "; ".join(f"{what}: {why}" for what, why in answer.reasons)
                    + ". Add options (compute.options), raise limits.max_queue_minutes, or run later"
                )
            message = (
                f"no option has capacity: waiting for one of {len(answer.reasons)} option(s), "
                f"{(limit_s - waited) / 60:.1f} min left of limits.max_queue_minutes"
            )
            log.info(message)
            self.set_state(WAITING, message)
            waited_said = True
            job = self.wait_unbilled(min(RETRY_S, max(0.0, limit_s - waited)), job, tried_at)

    def wait_unbilled(self, seconds: float, job: Job | None, since: float) -> Job | None:
        """Waits `seconds` with no cluster (a stop ends the wait: RunStopped), billing nothing from `since`; returns
        the job, its own cost check told to skip the wait too."""
        self.life.stopped_wait(seconds)
        if self.life.stopped:
            raise RunStopped(self.life.stop_reason, self.life.stop_detail) from None
        self.life.meter.not_billed_until(time.time())
        return billed_later(job, time.time() - since)

    def launched(self, handle: ClusterHandle) -> None:
        """Meters the cluster at the price of the option that launched, and records which it was."""
        self.attempt += 1
        info, price = handle.info, None
        options = {o.index: o for o in compute_options(self.launch_spec.compute)}
        if info.get("option") in options:
            price = option_price(self.launch_spec, options[info["option"]])
        text = f"{info['option']}: {info['option_text']}" if info.get("option") else None
        self.life.launched(info.get("hourly_cost_usd"), price, text)
        self.record.launched(self.attempt, info, self.life.meter.price)
        if text:
            log.info(f"launched option {text}, metered at ${self.life.meter.hourly_usd():.4g}/h")

    @cached_property
    def deadline(self) -> DeadlineClock | None:
        """The run's deadline, if it has one, timed from its provision request, with the validate task's prediction."""
        return DeadlineClock.of(self.spec, self.record.prediction, self.life.requested_at)

    def follow_deadline(self, spot_available: bool) -> bool:
        """Sets what the next launch is on (spot, or on-demand once the budget allows it), as the deadline's policy
        says from the run's progress; False: wait for spot. The Prefect state says each choice."""
        choice = self.deadline.choose(time.time(), self.life.progress(self.spec.train.epochs), spot_available)
        if choice.decision is Decision.WAIT:
            message = f"deadline: {choice.reason} (retrying in {RETRY_S:g} s); {self.deadline.lines(time.time())[0]}"
            log.info(message)
            self.set_state(WAITING_FOR_SPOT, message)
            return False
        on_demand = choice.decision is Decision.ON_DEMAND
        if on_demand and not self.on_demand:
            self.check_budget(hourly_cost(on_demand_spec(self.spec)).hourly_usd)
        self.on_demand = on_demand
        message = f"deadline: {choice.reason}: launching {'on-demand' if on_demand else 'spot'}"
        log.info(message)
        self.set_state(None, message)
        return True

    def spot_lost(self, why: str) -> bool:
        """A spot cluster lost (or no spot capacity): past compute.spot_fallback_after, go on-demand (True)."""
        after = self.spec.compute.spot_fallback_after
        if self.on_demand or after is None:
            return False
        self.spot_losses += 1
        if self.spot_losses < after:
            return False
        price = hourly_cost(on_demand_spec(self.spec))
        self.check_budget(price.hourly_usd)
        self.on_demand = True
        log.info(
            f"{why}: {self.spot_losses} spot loss(es) of compute.spot_fallback_after={after}; relaunching "
            f"on-demand at up to ${price.hourly_usd:.4g}/h"
        )
        return True

    def check_budget(self, hourly_usd: float) -> None:
        """Stops the run (stopped_by=budget, checkpoints kept) when the on-demand price could take it past
        limits.max_cost_usd: what was spent, plus the new price for the rest of limits.max_runtime_minutes."""
        limit = self.spec.limits.max_cost_usd
        if limit is None:
            return
        spent = self.life.bill()["cost_usd"]
        ran_s = time.time() - self.life.job_started_at if self.life.job_started_at else 0.0
        left_h = max(0.0, self.spec.limits.max_runtime_minutes * 60 - ran_s) / 3600
        worst = spent + hourly_usd * left_h
        if worst > limit:
            detail = (
                f"stopped by budget: on-demand at ${hourly_usd:.4g}/h for the {left_h * 60:.0f} min left could "
                f"cost ${worst:.2f} in all (${spent:.2f} spent), more than max_cost_usd={limit:.2f}; "
                "the checkpoints are kept"
            )
            self.life.stop("budget", detail)
            raise RunStopped("budget", detail)


def billed_later(job: Job | None, seconds: float) -> Job | None:
    """The job, its bill (what its guard's cost check counts from) starting `seconds` later."""
    key = ENV_NAMES["requested_at"]
    if job is None or key not in job.env:
        return job
    return Job(job.run_name, {**job.env, key: str(float(job.env[key]) + seconds)})


def prefect_state(flow_run_id: str) -> Callable[[str | None, str], None]:
    """Sets the flow run's state: RUNNING named `name` (or plain Running), with `message`; never forced, so a
    cancel (Cancelling) refuses it and the cancel watcher stops the run."""

    def set_state(name: str | None, message: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.objects import StateType
        from prefect.states import State

        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(
                    flow_run_id, State(type=StateType.RUNNING, name=name or "Running", message=message)
                )
        except Exception:  # the API blinked: the console line said it already
            pass

    return set_state
