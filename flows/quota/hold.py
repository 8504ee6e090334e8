"""A run's turn for the GPUs: it waits in its pool's queue, holds its slots on a lease it renews while its process
lives, and gives them back once its cluster is down (the pools, their tags and who waits: flows/quota/pools.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from gpuflow.cluster.backends.local import drop_prewarmed
from gpuflow.cluster.protocol import QUOTA_LOST
from gpuflow.cluster.run.lifecycle import TeardownFailed
from gpuflow.cluster.run.monitor import progress
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.flows.quota.pools import (
    HELD_TAG_PREFIX,
    LEASE_TAG_PREFIX,
    LEASED_TAG,
    OVER_BUT_BILLING_LEASE_S,
    POLL_S,
    SLOTS_TAG_PREFIX,
    STAMP_S,
    TAKING_TAG_PREFIX,
    WAIT_TAG_PREFIX,
    accepted,
    holding,
    lease_seconds,
    lease_slots,
    need_of,
    queue_of,
    waiting_state,
)

log = logging.getLogger(__name__)


class QueueTimeout(RuntimeError):
    """Waited limits.max_queue_minutes for the quota, or it is smaller than the run: nothing started. Says why."""


class QueueCancelled(RuntimeError):
    """Cancelled from Prefect while waiting for the quota: nothing was started."""


class QuotaHold:
    """Waits its turn, then holds the slots (renewing their lease) until `release()`; a no-op without a quota.
    A cancel from Prefect while it waits ends the wait (QueueCancelled): nothing was started."""

    def __init__(self, spec: ExperimentSpec, flow_run_id: str):
        self.need, self.flow_run_id = need_of(spec), flow_run_id
        self.max_wait_s = spec.limits.max_queue_minutes * 60
        self.lease_s = lease_seconds(spec)
        self.lease_id, self.waited_s = None, 0.0
        self.renew_every_s = self.lease_s / 4  # a few renewals may fail before the lease lapses
        self.lost: str | None = None  # why the slots' lease is gone while the run holds them
        self.replacement_lease_id: str | None = None  # a second share, for a cluster billing beside the first
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
            self._retag(client, add=[WAIT_TAG_PREFIX + self.need.pool, self._slots_tag(1)])
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
            mine, ahead = queue_of(client, self.need.pool, self.flow_run_id)
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

    def _try(self, client) -> bool:
        # tagged before it can hold: a recount then never takes the slots of a run not yet tagged held for a leak
        self._retag(client, add=[TAKING_TAG_PREFIX + self.need.pool])
        self.lease_id = lease_slots(client, self.need, self.flow_run_id, self.lease_s)
        if self.lease_id is None:
            self._retag(client, remove=[TAKING_TAG_PREFIX + self.need.pool])
        return self.lease_id is not None

    def hold_for_replacement(self) -> bool:
        """Takes a second share of the run's slots for a cluster that bills beside its first (a spot notice's
        replacement), if the pool has room now: a notice leaves a minute or two, no time to queue. True without a
        quota; False when the pool is full, or its API cannot be reached."""
        from prefect.client.orchestration import get_client

        if self.lease_id is None or self.replacement_lease_id is not None:
            return True
        try:
            with get_client(sync_client=True) as client:
                # counted as held before it is: a recount between the two never frees the share as a leak
                self._retag(client, add=[self._slots_tag(2)], remove=[self._slots_tag(1)])
                self.replacement_lease_id = lease_slots(client, self.need, self.flow_run_id, self.lease_s)
                if self.replacement_lease_id is None:
                    self._retag(client, add=[self._slots_tag(1)], remove=[self._slots_tag(2)])
                    return False
                self._retag(client, add=[LEASE_TAG_PREFIX + self.replacement_lease_id])
        except Exception as exc:
            log.warning(f"quota: no second share for a replacement ({type(exc).__name__}: {str(exc)[:200]})")
            return False
        log.info(f"quota: holding {self.need.describe()} more, for the replacement cluster")
        return True

    def give_back_replacement(self) -> None:
        """Gives the second share back once one cluster bills again (the first is down): the run's own share holds
        the one left. A failure leaves it to lapse, or to the reaper once the run is over."""
        from prefect.client.orchestration import get_client

        lease_id, self.replacement_lease_id = self.replacement_lease_id, None
        if lease_id is None:
            return
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease_id)  # released before the tag says one share
                self._retag(client, add=[self._slots_tag(1)], remove=[self._slots_tag(2), LEASE_TAG_PREFIX + lease_id])
        except Exception as exc:
            log.warning(f"quota: could not give back the replacement's share ({type(exc).__name__}); it lapses")

    def _slots_tag(self, shares: int) -> str:
        """What the recount reads of the slots the run holds: `shares` times its need (2 with a replacement)."""
        return f"{SLOTS_TAG_PREFIX}{shares * self.need.slots}"

    def _leases(self) -> list[str]:
        return [lease for lease in (self.lease_id, self.replacement_lease_id) if lease is not None]

    def _retag(self, client, add: list[str] = (), remove: list[str] = ()) -> None:
        tags = set(client.read_flow_run(self.flow_run_id).tags) - set(remove)
        client.update_flow_run(self.flow_run_id, tags=sorted(tags | set(add)))

    def _renew(self) -> None:
        import httpx
        from prefect.client.orchestration import get_client

        renewed = time.monotonic()
        while not self._stop.wait(self.renew_every_s):
            try:
                with get_client(sync_client=True) as client:
                    for lease in self._leases():
                        client.renew_concurrency_lease(lease, self.lease_s)
                renewed = time.monotonic()
            except Exception as exc:
                gone = isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 410
                if gone and self._forgotten_in_a_restart():
                    return
                if gone or time.monotonic() - renewed > self.lease_s:
                    self.lost = (
                        "is gone: Prefect revoked it (it lapsed, or was given back as a dead run's)"
                        if gone
                        else f"lapsed: not renewed for {time.monotonic() - renewed:.0f} s ({type(exc).__name__})"
                    )
                    log.error(f"quota: the lease on {self.need.describe()} {self.lost}")
                    return
                # else the API blinked: the lease covers a few missed renewals

    def _forgotten_in_a_restart(self) -> bool:
        """A server that keeps leases in memory forgot this one in a restart: its slots are still counted (the recount
        keeps them while the run is not over), nothing was given to another run: it trains on."""
        from prefect.client.orchestration import get_client

        from gpuflow.cluster.util.lease_storage import leases_kept_in_memory

        try:
            with get_client(sync_client=True) as client:
                if not leases_kept_in_memory(client):
                    return False
        except Exception:
            return False
        log.warning(f"quota: the Prefect server forgot the lease on {self.need.describe()} (a restart); still counted")
        return True

    def lost_check(self) -> tuple[str, str] | None:
        """A stop check (cluster/run/limits.py): once the slots' lease is lost, Prefect may give them to another run,
        and this one would train over the team's quota: it stops instead, its checkpoints kept."""
        if self.lost is None:
            return None
        return QUOTA_LOST, (
            f"stopped: the quota lease on {self.need.describe()} {self.lost}; another run may hold those slots "
            "now. Checkpoints are kept: run it again once the quota has room"
        )

    def release(self) -> None:
        """Gives the slots back once the cluster is down, and says so on the flow run (a Cancelling one refuses)."""
        from prefect.client.orchestration import get_client
        from prefect.states import Running

        self._stop.set()
        if self.lease_id is not None:
            try:
                with get_client(sync_client=True) as client:
                    if self.lost is None:  # a lost lease holds nothing to give back
                        for lease in self._leases():
                            client.release_concurrency_slots_with_lease(lease)
                    self._retag(client, remove=[LEASED_TAG, *(LEASE_TAG_PREFIX + lease for lease in self._leases())])
                    client.set_flow_run_state(self.flow_run_id, Running(message=f"gave back {self.need.describe()}"))
            except Exception as exc:  # the API is down: the lease lapses on its own, no renewal comes
                log.warning(
                    f"quota: could not give back {self.need.describe()} ({type(exc).__name__}); "
                    f"its lease lapses within {self.lease_s:.0f} s"
                )
            self.lease_id = self.replacement_lease_id = None

    def leave_to_the_reaper(self) -> None:
        """Keeps the slots: the cluster may still bill (its teardown failed). Their lease outlasts this process until
        a reaper pass, which renews it while a backend lists the cluster and gives the slots back once it is gone."""
        from prefect.client.orchestration import get_client

        self._stop.set()
        if self.lease_id is None:
            return
        try:
            with get_client(sync_client=True) as client:
                for lease in self._leases():
                    client.renew_concurrency_lease(lease, OVER_BUT_BILLING_LEASE_S)
            log.warning(f"quota: {self.need.describe()} stay held until the reaper sees the cluster gone")
        except Exception as exc:  # the API is down: the lease lapses on its own
            log.warning(
                f"quota: could not keep {self.need.describe()} for the reaper ({type(exc).__name__}); "
                f"its lease lapses within {self.lease_s:.0f} s"
            )


@contextlib.contextmanager
def turn_for_gpus(spec: ExperimentSpec, flow_run_id: str):
    """Waits for the team's quota (when the run's pool has one) and holds it inside the block: wrap everything from
    the provision request to the cluster being down. Raises QueueTimeout, QueueCancelled before anything starts.
    A cluster the block could not down keeps its slots for the reaper: they never come back while it may bill."""
    hold = QuotaHold(spec, flow_run_id)
    hold.acquire()
    try:
        yield hold
    except TeardownFailed:
        hold.leave_to_the_reaper()
        raise
    except BaseException:
        hold.release()
        raise
    hold.release()  # nothing to give back without a quota
