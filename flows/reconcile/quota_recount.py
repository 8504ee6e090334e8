"""The quota's recount: gives back slots that Prefect counts as held and no run holds (a leak).

    recount()                     # every gpuflow-quota-* limit; run by the reaper's pass and `gpuflow quota list`

A slot leaks when Prefect forgets the lease it was held on: a server restart with the in-memory lease storage
(Prefect's default). Then neither the holder's release nor the lease's expiry gives it back, and the runs of the
pool wait for good. The recount counts what the runs truly hold: a run tagged `quota-held:` or `quota-taking:`
(flows/quota/) that is not over, or whose cluster a backend still lists; a run that is over gives its slots back
only once no backend lists its cluster. Prefect's count above that is lowered to it.

Two recounts at once (the reaper, a `gpuflow quota list`) take turns on a one-slot limit named gpuflow-recount,
whose slot decays in LOCK_S should a recount die holding it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gpuflow.cluster.backends import Backend, flow_run_id_of
from gpuflow.flows.quota.pools import (
    HELD_TAG_PREFIX,
    LEASE_TAG_PREFIX,
    LEASED_TAG,
    LIMIT_PREFIX,
    OVER_BUT_BILLING_LEASE_S,
    SLOTS_TAG_PREFIX,
    TAKING_TAG_PREFIX,
    every_flow_run,
    need_of,
    quotas,
)
from gpuflow.flows.reconcile.turns import Turn

log = logging.getLogger(__name__)

LOCK = "gpuflow-recount"
LOCK_S = 60.0  # a recount's few API calls take far less
BACKENDS = ("local", "skypilot")
FINAL = ["COMPLETED", "FAILED", "CANCELLED", "CRASHED"]
PAGE = 200
BACKEND_TAG = "backend:"  # every run's backend (flows/run_tags.py)


@dataclass
class Recount:
    pool: str
    size: int
    counted: int  # Prefect's count of held slots, before the recount
    held: int  # what the runs truly hold
    freed: int = 0
    note: str = ""  # why a leak was left as it is


def recount(backend_for: Callable[[str], Backend] | None = None, dry_run: bool = False) -> list[Recount]:
    """Recounts every quota; frees its leaked slots unless dry_run. backend_for: a backend by name (raising when it
    cannot be used here); by default a new one, closed after the recount."""
    from prefect.client.orchestration import get_client

    opened: dict[str, Backend] = {}

    def backend(name: str) -> Backend:
        if name not in opened:
            opened[name] = backend_for(name) if backend_for else get_backend_here(name)
        return opened[name]

    listed = cluster_lister(backend)
    try:
        # One recount at a time gives slots back: Prefect's release of a lease reads, decrements and revokes in steps
        # of their own, so two at once could both decrement, and free another run's slot. A dry run gives nothing back.
        with get_client(sync_client=True) as client, contextlib.nullcontext(False) if dry_run else turn(client) as ours:
            if ours:
                give_back_dead_holders(client, listed)
            first = [count_pool(client, limit, {}) for limit in quotas()]
            if not any(found.counted > found.held for found in first):
                return first
            clusters = listed_clusters(listed, {found.pool for found in first if found.counted > found.held}, client)
            results = [count_pool(client, limit, clusters or {}) for limit in quotas()]
            for found in results:
                free(client, found, clusters, "dry run" if dry_run else None if ours else "another recount is on")
            return results
    finally:
        if backend_for is None:
            for made in opened.values():
                getattr(made, "close", lambda: None)()


def give_back_dead_holders(client, listed: Callable[[str | None], set[str] | None]) -> list[str]:
    """Gives back the lease of each run that is over and whose cluster no backend lists any more, by its id, as the
    run would have; while its cluster is listed, renews it: a dead run's slots come back once its GPUs stop billing,
    never before. Returns the runs given back."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )

    over = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[LEASED_TAG]), state=FlowRunFilterState(type=FlowRunFilterStateType(any_=FINAL))
        ),
        limit=PAGE,
    )
    if not over:
        return []
    given = []
    for run in over:
        leases = [tag.removeprefix(LEASE_TAG_PREFIX) for tag in run.tags if tag.startswith(LEASE_TAG_PREFIX)]
        clusters = listed(
            next((tag.removeprefix(BACKEND_TAG) for tag in run.tags if tag.startswith(BACKEND_TAG)), None)
        )
        if clusters is None:  # cannot tell whether its cluster is gone: its slots stay held
            continue
        up = str(run.id) in clusters
        try:
            if up:
                for lease in leases:  # a spot notice's replacement holds a second one
                    client.renew_concurrency_lease(lease, OVER_BUT_BILLING_LEASE_S)
            else:
                for lease in leases:
                    client.release_concurrency_slots_with_lease(lease)
                client.update_flow_run(
                    run.id,
                    tags=sorted(
                        tag for tag in run.tags if not tag.startswith((LEASED_TAG, LEASE_TAG_PREFIX, TAKING_TAG_PREFIX))
                    ),
                )
                given.append(str(run.id))
                log.info(f"quota: gave back the slots of flow run {run.id} ({run.state_name}): its cluster is gone")
        except Exception as exc:  # its lease lapsed meanwhile, or the API blinked: the next pass tries again
            log.warning(f"quota: flow run {run.id}: {type(exc).__name__}: {str(exc)[:200]}")
    return given


def cluster_lister(backend: Callable[[str], Backend]) -> Callable[[str | None], set[str] | None]:
    """A backend's clusters by flow run id, listed once per recount; None for a backend that cannot be listed here
    (not set up, or its API down: its clusters may all be up, so no slot of its runs is given back)."""
    listed: dict[str | None, set[str] | None] = {}

    def clusters_of(name: str | None) -> set[str] | None:
        if name not in listed:
            try:
                listed[name] = {flow_run_id_of(status.name) for status in backend(name).status()} - {None}
            except Exception as exc:
                log.warning(
                    f"quota: cannot list the {name} clusters ({type(exc).__name__}: {exc}); the slots of "
                    "its runs stay held"
                )
                listed[name] = None
        return listed[name]

    return clusters_of


def get_backend_here(name: str) -> Backend:
    from gpuflow.cluster.backends import get_backend

    return get_backend(name)


def count_pool(client, limit, clusters: dict) -> Recount:
    """The pool's slots held by its live runs (read before and after Prefect's count: a run that takes slots in
    between is tagged from before it takes them) and by the runs whose cluster is listed in `clusters`."""
    pool = limit.name.removeprefix(LIMIT_PREFIX)
    before = live_runs(client, pool)
    counted = client.read_global_concurrency_limit_by_name(limit.name).active_slots
    runs = {run.id: run for run in [*before, *live_runs(client, pool)]}
    runs.update({run.id: run for run in clusters.get(pool, [])})
    slots = [slots_of(run) for run in runs.values()]
    if None in slots:
        return Recount(pool, limit.limit, counted, counted, note="a run of the pool holds an unknown number of slots")
    return Recount(pool, limit.limit, counted, sum(slots))


def live_runs(client, pool: str) -> list:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )

    return every_flow_run(
        client,
        flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(any_=[HELD_TAG_PREFIX + pool, TAKING_TAG_PREFIX + pool]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=FINAL)),
        ),
    )


def listed_clusters(listed: Callable[[str | None], set[str] | None], pools: set[str], client) -> dict | None:
    """pool → the runs that held it and whose cluster a backend lists; None when a backend its runs used cannot be
    listed (nothing can then be said gone)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

    run_ids = set()
    for name in BACKENDS:
        used = any(
            client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[HELD_TAG_PREFIX + pool, BACKEND_TAG + name])
                ),
                limit=1,
            )
            for pool in pools
        )
        if not used:
            continue
        if (found := listed(name)) is None:
            return None
        run_ids |= found
    clusters = {pool: [] for pool in pools}
    ids = sorted(run_ids)
    for start in range(0, len(ids), PAGE):
        for run in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids[start : start + PAGE])), limit=PAGE
        ):
            for pool in pools & {tag.removeprefix(HELD_TAG_PREFIX) for tag in run.tags}:
                clusters[pool].append(run)
    return clusters


def free(client, found: Recount, clusters: dict | None, not_now: str | None) -> None:
    """Gives back the pool's leak, unless its runs' clusters could not be listed or `not_now` says why not."""
    leaked = found.counted - found.held
    if leaked <= 0 or found.note:
        return
    if clusters is None or found.pool not in clusters:
        found.note, found.held = "leak unknown: cannot tell which clusters are gone", found.counted
    elif not_now:
        found.note = f"{leaked} held by no run, not freed ({not_now})"
    else:
        client.release_concurrency_slots(names=[LIMIT_PREFIX + found.pool], slots=leaked, occupancy_seconds=None)
        found.freed = leaked
        log.warning(
            f"quota {found.pool}: gave back {leaked} slot(s) Prefect counted as held and no run holds "
            f"(a lease the server forgot)"
        )


def turn(client) -> Turn:
    """The recounts' turn: entered as True when this recount has it, False when another has."""
    return Turn(client, LOCK, LOCK_S)


def slots_of(run) -> int | None:
    """What a run holds: its quota-slots: tag, or for a run from before the tag, its spec's need; None if neither."""
    for tag in run.tags:
        if tag.startswith(SLOTS_TAG_PREFIX) and tag.removeprefix(SLOTS_TAG_PREFIX).isdigit():
            return int(tag.removeprefix(SLOTS_TAG_PREFIX))
    try:
        from gpuflow.cluster.spec import parse_spec

        return need_of(parse_spec(run.parameters["spec"])).slots
    except Exception:  # a spec file, or a spec that no longer parses
        return None
