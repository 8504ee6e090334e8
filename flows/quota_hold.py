"""The team's GPU quota: runs wait their turn for the GPUs their clusters will hold, on Prefect's global
concurrency limits, so every process that talks to the same Prefect server shares one queue.

    gpuflow quota set aws-h100 8          # at most 8 GPUs held at once by the team's runs in pool aws-h100
    compute.quota: aws-h100               # the pool a spec's runs count against (default: pool_of below)

A run holds its cluster's GPUs (nodes × GPUs per node; on the local backend, its workers) from before it provisions
until its cluster is down, first submitted first served. Its flow run's tags say where it is: `quota:<pool>` from its
start, `quota-wait:` while it waits (its state stamped "Waiting for GPUs" with its place; a stale stamp is passed
over), `quota-taking:` while it asks, `quota-held:`, `quota-slots:<n>` and `quota-lease:<id>` while it holds. The
lease, renewed while the run's process lives, lasts as long as its cluster may outlive it; the reaper's recount
(flows/reconcile/quota_recount.py) gives a dead run's slots back once its cluster is gone, a leaked one at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from gpuflow.cluster.backends.local import drop_prewarmed
from gpuflow.cluster.protocol import triggered_by
from gpuflow.cluster.run.monitor import progress
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.options import compute_options

log = logging.getLogger(__name__)

LIMIT_PREFIX = "gpuflow-quota-"
POOL_TAG_PREFIX = "quota:"  # every run, from its start (flows/run_tags.py)
WAIT_TAG_PREFIX = "quota-wait:"  # while it waits
HELD_TAG_PREFIX = "quota-held:"  # once it holds
TAKING_TAG_PREFIX = "quota-taking:"  # while it asks for slots: it may hold them from the server's answer on
SLOTS_TAG_PREFIX = "quota-slots:"  # the slots it asks for (read by the recount)
LEASE_TAG_PREFIX = "quota-lease:"  # + its lease's id, with LEASED_TAG, until it gives the slots back: the recount
LEASED_TAG = "quota-leased"  # gives a dead run's back by them
WAITING = "Waiting for GPUs"  # the state's name while it waits, in the UI and `gpuflow status`
POLL_S = 2.0
STAMP_S = 20.0  # a waiter re-stamps its state this often, even with nothing new to say
STALE_S = 75.0  # a waiter not stamped for this long is dead
JOIN_S = 120.0  # a run of the pool that started this recently and has not reached the queue yet (validating) is ahead
TEARDOWN_MARGIN_S = 30.0  # the lease outlives the job's orphan grace by this: time for the cluster to go
CLOUD_DOWN_S = 600.0  # after its autostop, SkyPilot's down of a cloud cluster: minutes at worst


class QueueTimeout(RuntimeError):
    """Waited limits.max_queue_minutes for the quota, or it is smaller than the run: nothing started. Says why."""


class QueueCancelled(RuntimeError):
    """Cancelled from Prefect while waiting for the quota: nothing was started."""


@dataclass(frozen=True)
class Need:
    pool: str
    slots: int
    unit: str  # "GPU" or "worker"

    @property
    def limit_name(self) -> str:
        return LIMIT_PREFIX + self.pool

    def amount(self) -> str:
        return f"{self.slots} {self.unit}{'s' * (self.slots != 1)}"

    def describe(self) -> str:
        return f"{self.amount()} of quota {self.pool!r}"


def need_of(spec: ExperimentSpec) -> Need:
    """What the run's cluster holds: its GPUs, or on the local backend (no GPUs) its workers."""
    compute = spec.compute
    option = compute_options(compute)[0]  # the first place to run (its accelerator, its cloud) names the pool
    first = option.accelerators
    if compute.backend == "local" or not first:
        return Need(compute.quota or compute.backend, compute.num_workers, "worker")
    name, _, count = first.partition(":")
    where = option.cloud or (option.infra or "").split("/")[0] or "any"
    return Need(compute.quota or f"{where}-{name}".lower(), compute.num_nodes * int(count or 1), "GPU")


def lease_seconds(spec: ExperimentSpec) -> float:
    """Prefect's lease on the slots, from the last renewal: as long as the cluster may outlive its run (the orphan
    grace and teardown; on a cloud, SkyPilot's autostop and down too): a dead run's GPUs never bill past it."""
    after = spec.limits.orphan_grace_minutes * 60 + TEARDOWN_MARGIN_S
    if spec.compute.backend == "skypilot":
        after += spec.limits.idle_minutes_to_autostop * 60 + CLOUD_DOWN_S
    return max(60.0, after)


def set_quota(pool: str, slots: int) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(LIMIT_PREFIX + pool, slots)


def quotas() -> list:
    """The team's quotas: Prefect's global concurrency limits named gpuflow-quota-*."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limits = client.read_global_concurrency_limits(limit=200)
    return [limit for limit in limits if limit.name.startswith(LIMIT_PREFIX)]


def holding(client, pool: str) -> str:
    """ ", held by <run> (<who triggered it>), ...": the live runs holding the pool's slots ("" when none)."""
    from prefect.client.schemas import filters as f

    runs = client.read_flow_runs(
        flow_run_filter=f.FlowRunFilter(
            tags=f.FlowRunFilterTags(all_=[HELD_TAG_PREFIX + pool]),
            state=f.FlowRunFilterState(type=f.FlowRunFilterStateType(any_=["RUNNING"])),
        ),
        limit=20,
    )
    named = [run.name + (f" ({who})" if (who := triggered_by(run.tags)) else "") for run in runs]
    return f", held by {', '.join(named)}" if named else ""


def waiting_runs(pool: str, client=None) -> list:
    """The live runs waiting for the pool's quota, first submitted first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with contextlib.nullcontext(client) if client else get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[WAIT_TAG_PREFIX + pool])), limit=200
        )
    now = datetime.now(timezone.utc)
    return sorted(
        (
            run
            for run in runs
            if run.state and run.state.name == WAITING and (now - run.state.timestamp).total_seconds() < STALE_S
        ),
        key=submitted,
    )


class QuotaHold:
    """Waits its turn, then holds the slots (renewing their lease) until `release()`; a no-op without a quota.
    A cancel from Prefect while it waits ends the wait (QueueCancelled): nothing was started."""

    def __init__(self, spec: ExperimentSpec, flow_run_id: str):
        self.need, self.flow_run_id = need_of(spec), flow_run_id
        self.max_wait_s = spec.limits.max_queue_minutes * 60
        self.lease_s = lease_seconds(spec)
        self.lease_id, self.waited_s = None, 0.0
        self._stop = threading.Event()

    def acquire(self) -> bool:
        """Blocks until the slots are held (True), or returns False when the pool has no quota. Raises QueueTimeout."""
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        with get_client(sync_client=True) as client:
            try:
                limit = client.read_global_concurrency_limit_by_name(self.need.limit_name)
            except ObjectNotFound:
                return False
            if self.need.slots > limit.limit:
                raise QueueTimeout(
                    f"the run needs {self.need.amount()}, quota {self.need.pool!r} is {limit.limit}"
                    f"{holding(client, self.need.pool)}: it can never start; make the cluster smaller "
                    f"(compute), or raise the quota: gpuflow quota set {self.need.pool} {self.need.slots}"
                )
            started = time.monotonic()
            self._retag(client, add=[WAIT_TAG_PREFIX + self.need.pool, f"{SLOTS_TAG_PREFIX}{self.need.slots}"])
            try:
                self._wait(client, started)
            finally:
                self.waited_s = time.monotonic() - started
                held = [HELD_TAG_PREFIX + self.need.pool, LEASED_TAG, f"{LEASE_TAG_PREFIX}{self.lease_id}"]
                self._retag(
                    client,
                    add=held if self.lease_id else [],
                    remove=[WAIT_TAG_PREFIX + self.need.pool, TAKING_TAG_PREFIX + self.need.pool],
                )
        threading.Thread(target=self._renew, daemon=True, name="gpuflow-quota-lease").start()
        return True

    def _wait(self, client, started: float) -> None:
        from prefect.states import Running

        said, stamped = None, 0.0
        while True:
            mine, ahead = self._queue(client)
            if mine.state and mine.state.type.value in ("CANCELLING", "CANCELLED"):
                raise QueueCancelled()
            if not ahead and self._try(client):
                if not accepted(
                    client.set_flow_run_state(self.flow_run_id, Running(message=f"holding {self.need.describe()}"))
                ):
                    self.release()  # cancelled in the instant between
                    raise QueueCancelled()
                log.info(
                    f"quota: holding {self.need.describe()} after {time.monotonic() - started:.0f} s",
                    extra=progress(phase="waiting for GPUs"),
                )
                return
            if said is None:
                drop_prewarmed()  # a waiting run holds nothing, not even a warm cluster
            held = client.read_global_concurrency_limit_by_name(self.need.limit_name)
            message = (
                f"waiting for {self.need.describe()}: {len(ahead)} run(s) ahead, "
                f"{held.active_slots} of {held.limit} held"
            )
            if message != said or time.monotonic() - stamped > STAMP_S:
                # not forced: a cancel (Cancelling) refuses it, and the next look at the state ends the wait
                client.set_flow_run_state(self.flow_run_id, waiting_state(message))
                if message != said:
                    log.info(message, extra=progress(phase="waiting for GPUs"))
                said, stamped = message, time.monotonic()
            if time.monotonic() - started > self.max_wait_s:
                raise QueueTimeout(
                    f"the run needs {self.need.amount()}, quota {self.need.pool!r} is {held.limit} "
                    f"with {held.active_slots} held{holding(client, self.need.pool)}, "
                    f"{len(ahead)} run(s) ahead; waited {self.max_wait_s / 60:g} min "
                    f"(limits.max_queue_minutes) and started nothing; raise limits.max_queue_minutes "
                    f"or the quota (gpuflow quota set {self.need.pool} N), or run later"
                )
            time.sleep(POLL_S)

    def _queue(self, client) -> tuple:
        """This run, and the runs of the pool submitted before it that wait, or are on their way to the queue."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )

        mine = client.read_flow_run(self.flow_run_id)
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[POOL_TAG_PREFIX + self.need.pool]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["RUNNING"])),
            ),
            limit=200,
        )
        now = datetime.now(timezone.utc)

        def ahead(run) -> bool:
            if (
                str(run.id) == self.flow_run_id
                or submitted(run) >= submitted(mine)
                or HELD_TAG_PREFIX + self.need.pool in run.tags
            ):
                return False
            if run.state.name == WAITING:
                return (now - run.state.timestamp).total_seconds() < STALE_S  # else killed while it waited
            return run.start_time is not None and (now - run.start_time).total_seconds() < JOIN_S

        return mine, [run for run in runs if ahead(run)]

    def _try(self, client) -> bool:
        import httpx
        from prefect.client.schemas.objects import ConcurrencyLeaseHolder

        # tagged before it can hold: a recount then never takes the slots of a run not yet tagged held for a leak
        self._retag(client, add=[TAKING_TAG_PREFIX + self.need.pool])
        try:
            response = client.increment_concurrency_slots_with_lease(
                names=[self.need.limit_name],
                slots=self.need.slots,
                mode="concurrency",
                lease_duration=self.lease_s,
                holder=ConcurrencyLeaseHolder(type="flow_run", id=self.flow_run_id),
            )
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 423:  # not enough free slots yet
                self._retag(client, remove=[TAKING_TAG_PREFIX + self.need.pool])
                return False
            raise
        self.lease_id = response.json()["lease_id"]
        return True

    def _retag(self, client, add: list[str] = (), remove: list[str] = ()) -> None:
        tags = set(client.read_flow_run(self.flow_run_id).tags) - set(remove)
        client.update_flow_run(self.flow_run_id, tags=sorted(tags | set(add)))

    def _renew(self) -> None:
        from prefect.client.orchestration import get_client

        while not self._stop.wait(self.lease_s / 4):
            try:
                with get_client(sync_client=True) as client:
                    client.renew_concurrency_lease(self.lease_id, self.lease_s)
            except Exception:  # the API blinked: the lease covers a few missed renewals
                pass

    def release(self) -> None:
        """Gives the slots back once the cluster is down, and says so on the flow run (a Cancelling one refuses)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Running

        self._stop.set()
        if self.lease_id is not None:
            try:
                with get_client(sync_client=True) as client:
                    client.release_concurrency_slots_with_lease(self.lease_id)
                    self._retag(client, remove=[LEASED_TAG, LEASE_TAG_PREFIX + self.lease_id])
                    client.set_flow_run_state(self.flow_run_id, Running(message=f"gave back {self.need.describe()}"))
            except Exception as exc:  # the API is down: the lease lapses on its own, no renewal comes
                log.warning(
                    f"quota: could not give back {self.need.describe()} ({type(exc).__name__}); "
                    f"its lease lapses within {self.lease_s:.0f} s"
                )
            self.lease_id = None


@contextlib.contextmanager
def turn_for_gpus(spec: ExperimentSpec, flow_run_id: str):
    """Waits for the team's quota (when the run's pool has one) and holds it inside the block: wrap everything from
    the provision request to the cluster being down. Raises QueueTimeout, QueueCancelled before anything starts."""
    hold = QuotaHold(spec, flow_run_id)
    hold.acquire()
    try:
        yield hold
    finally:
        hold.release()  # nothing to give back without a quota


def accepted(result) -> bool:
    return result.status.value == "ACCEPT"


def waiting_state(message: str):
    from prefect.states import Running

    return Running(name=WAITING, message=message)


def submitted(run) -> tuple:
    """Submission order: a scheduled run counts from its scheduled time, any other from its creation."""
    return (run.expected_start_time or run.created, run.created, str(run.id))
