"""The team's GPU quota pools: runs wait their turn for the GPUs their clusters will hold, on Prefect's global
concurrency limits, so every process that talks to the same Prefect server shares one queue.

    gpuflow quota set aws-h100 8          # at most 8 GPUs held at once by the team's runs in pool aws-h100
    compute.quota: aws-h100               # the pool a spec's runs count against (default: pool_of below)

A run holds its cluster's GPUs (nodes × GPUs per node; on the local backend, its workers) from before it provisions
until its cluster is down, first submitted first served. Its flow run's tags say where it is: `quota:<pool>` from its
start, `quota-wait:` while it waits (its state stamped "Waiting for GPUs" with its place; a stale stamp is passed
over), `quota-taking:` while it asks, `quota-held:` and `quota-slots:<n>` from when it holds on (kept after: a dead
run's cluster still up is counted by them), `quota-lease:<id>` while it holds. A spot
notice's replacement cluster, billing beside the first, holds a second share on a lease of its own (two lease tags,
the slots tag doubled) until the first is down. The lease, renewed while the run's process lives, lasts as long as
its cluster may outlive it; the reaper's recount (flows/reconcile/quota_recount.py) gives a dead run's slots back once
its cluster is gone, a leaked one at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime, timezone

from gpuflow.cluster.protocol import triggered_by
from gpuflow.cluster.run.liveness import age_s, waiter_is_dead
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.options import compute_options

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
# The lease of a run that is over while its cluster may still bill (its teardown failed, or it died): renewed by the
# run's last act and by each reaper pass while a backend lists the cluster, until the next pass at least.
OVER_BUT_BILLING_LEASE_S = 3600.0


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
        runs = every_flow_run(
            client, flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[WAIT_TAG_PREFIX + pool]))
        )
    now = datetime.now(timezone.utc)
    return sorted(
        (run for run in runs if waiting_alive(run, now)),
        key=submitted,
    )


def waiting_alive(run, now: datetime) -> bool:
    """In the queue, its state freshly stamped (one killed while it waited is not: the reaper's rule, the same)."""
    if not (run.state and run.state.name == WAITING):
        return False
    return not waiter_is_dead(age_s(now.timestamp(), run.state.timestamp.timestamp()), STALE_S)


def submitted(run) -> tuple:
    """Submission order: a scheduled run counts from its scheduled time, any other from its creation."""
    return (run.expected_start_time or run.created, run.created, str(run.id))


def waiting_state(message: str):
    """A run's state while it waits its turn: Running, named WAITING (a cancel still reaches it)."""
    from prefect.states import Running

    return Running(name=WAITING, message=message)


def accepted(result) -> bool:
    """Prefect took the state a run proposed."""
    return result.status.value == "ACCEPT"


def queue_of(client, pool: str, flow_run_id: str) -> tuple:
    """The run, and the runs of the pool submitted before it that wait, or are on their way to the queue."""
    from prefect.client.schemas import filters as f

    mine = client.read_flow_run(flow_run_id)
    runs = every_flow_run(
        client,
        flow_run_filter=f.FlowRunFilter(
            tags=f.FlowRunFilterTags(all_=[POOL_TAG_PREFIX + pool]),
            state=f.FlowRunFilterState(type=f.FlowRunFilterStateType(any_=["RUNNING"])),
        ),
    )
    now = datetime.now(timezone.utc)

    def ahead(run) -> bool:
        if str(run.id) == flow_run_id or submitted(run) >= submitted(mine) or HELD_TAG_PREFIX + pool in run.tags:
            return False
        if run.state.name == WAITING:
            return waiting_alive(run, now)  # else killed while it waited
        return run.start_time is not None and (now - run.start_time).total_seconds() < JOIN_S

    return mine, [run for run in runs if ahead(run)]


def lease_slots(client, need: Need, flow_run_id: str, lease_s: float) -> str | None:
    """A lease on the run's share of the pool, or None while the pool has no room for it."""
    import httpx
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder

    try:
        response = client.increment_concurrency_slots_with_lease(
            names=[need.limit_name],
            slots=need.slots,
            mode="concurrency",
            lease_duration=lease_s,
            holder=ConcurrencyLeaseHolder(type="flow_run", id=flow_run_id),
        )
    except httpx.HTTPStatusError as exc:
        if exc.response.status_code == 423:  # not enough free slots yet
            return None
        raise
    return response.json()["lease_id"]


def every_flow_run(client, **filters) -> list:
    """Every flow run `filters` (read_flow_runs' own) select, page by page in a stable order: a Prefect server answers
    a read with at most its default limit (PREFECT_SERVER_API_DEFAULT_LIMIT, 200 unless its admin changed it) and
    refuses one that asks for more, so each page is the server's own size; the last read is the empty page."""
    from prefect.client.schemas.sorting import FlowRunSort

    runs = []
    while page := client.read_flow_runs(**filters, sort=FlowRunSort.ID_DESC, offset=len(runs)):
        runs += page
    return runs
