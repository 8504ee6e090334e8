"""What a run's records must say once it is over, as data: for each record, when it is dead and what its true end
is, and the step of the reconciler's pass that brings it there. The pass (`reconcile`) takes the steps in this
order, each from the records alone and idempotent, so that passes may run from several places at once: clusters
first (the others' ends wait on them), the quota's slots last (freed only once their cluster is gone)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuflow.cluster.backends import Backend
from gpuflow.flows.reconcile.dead_runs import dead_without_lease
from gpuflow.flows.reconcile.lapsed import lease_reader
from gpuflow.flows.reconcile.records import (
    DEFAULT_TTL_S,
    ORPHANED,
    RunRecords,
    Verdict,
    close_stale_mlflow_runs,
    mark_crashed,
    reap,
)

log = logging.getLogger(__name__)


@dataclass
class Pass:
    """One pass of the reconciler: what it reads from (backends, tracking servers) and what it did, step by step."""

    backends: list[Backend]
    tracking_uris: list[str]
    ttl_seconds: float = DEFAULT_TTL_S
    dry_run: bool = False
    verdicts: list[Verdict] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)  # flow runs found dead: their lease is stale, or they are orphaned
    orphaned: set[str] = field(default_factory=set)  # their process is gone, and their cluster with it
    closed: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    recounted: list = field(default_factory=list)


def down_clusters(run: Pass) -> list[str]:
    run.verdicts = reap(
        run.backends,
        run.ttl_seconds,
        dry_run=run.dry_run,
        records=RunRecords(lease_stale=lease_reader(run.tracking_uris)),
    )
    run.dead |= {verdict.flow_run_id for verdict in run.verdicts if verdict.run_is_dead}
    run.orphaned = {
        verdict.flow_run_id for verdict in run.verdicts if verdict.run_is_dead and ORPHANED in verdict.reason
    }
    return [
        f"{v.action} {v.backend} cluster {v.cluster}: {v.reason}"
        + (" (dry run)" * (run.dry_run and v.action == "down"))
        for v in run.verdicts
    ]


def close_mlflow_runs(run: Pass) -> list[str]:
    for uri in [] if run.dry_run else run.tracking_uris:
        try:
            run.closed += [f"{uri} {run_id}" for run_id in close_stale_mlflow_runs(uri, dead=run.dead)]
        except Exception as exc:  # one unreachable store must not stop the other steps
            log.warning(f"reaper: cannot read MLflow at {uri}: {type(exc).__name__}: {str(exc)[:300]}")
    return [f"closed MLflow run left RUNNING: {closed}" for closed in run.closed]


def crash_flow_runs(run: Pass) -> list[str]:
    if run.dry_run:
        return []
    run.crashed = mark_crashed(
        run.dead - run.orphaned,
        "its process died: found by the reaper (lease stale); cluster downed, MLflow run closed (stopped_by=orphaned)",
    )
    said = [f"marked flow run {flow_run_id} Crashed: its lease is stale" for flow_run_id in run.crashed]
    orphaned = mark_crashed(run.orphaned, "its process died: found by the reaper (its local cluster stopped with it)")
    run.crashed += orphaned
    said += [f"marked flow run {flow_run_id} Crashed: its process and its cluster are gone" for flow_run_id in orphaned]
    kept = {verdict.flow_run_id for verdict in run.verdicts if verdict.action == "keep"}
    for flow_run_id, why in dead_without_lease(kept, run.tracking_uris, time.time()).items():
        run.crashed += mark_crashed({flow_run_id}, why)
        said.append(f"marked flow run {flow_run_id} Crashed: {why}")
    return said


MESSAGES_TURN = "gpuflow-messages"
MESSAGES_TURN_S = 300.0  # a pass tries each message once; a webhook that hangs takes its timeout per message


def send_unsaid(run: Pass) -> list[str]:
    """In its turn only: two passes at once would both find an end unsaid, and both say it."""
    from prefect.client.orchestration import get_client

    from gpuflow.flows.reconcile.turns import Turn
    from gpuflow.flows.run_messages import notify_owed, notify_undelivered

    if run.dry_run:
        return []
    with get_client(sync_client=True) as client, Turn(client, MESSAGES_TURN, MESSAGES_TURN_S) as ours:
        if not ours:
            return ["messages: another pass is saying them"]
        run.said = notify_undelivered(run.tracking_uris) + notify_owed()
    return [f"message: {line}" for line in run.said]


def free_slots(run: Pass) -> list[str]:
    from gpuflow.flows.reconcile.quota_recount import recount

    by_name = {backend.name: backend for backend in run.backends}

    def backend_for(name: str) -> Backend:
        if name not in by_name:
            raise LookupError(f"this pass does not use the {name} backend")
        return by_name[name]

    try:
        run.recounted = [found for found in recount(backend_for, run.dry_run) if found.freed or found.note]
    except Exception as exc:  # the other records are brought to agreement and reported either way
        log.warning(f"reaper: cannot recount the quotas: {type(exc).__name__}: {str(exc)[:300]}")
    return [
        f"quota {found.pool}: gave back {found.freed} leaked slot(s) (Prefect counted {found.counted}, the runs "
        f"hold {found.held})"
        if found.freed
        else f"quota {found.pool}: {found.note}"
        for found in run.recounted
    ]


@dataclass(frozen=True)
class Invariant:
    record: str
    dead_when: str
    true_end: str
    step: Callable[[Pass], list[str]]  # brings the record to its true end; says what it did


INVARIANTS = (
    Invariant(
        "cluster",
        "its flow run is final, missing or dead (its MLflow lease is stale), or it is older than the TTL",
        "down, confirmed by its backend",
        down_clusters,
    ),
    Invariant(
        "MLflow run",
        "it is RUNNING and its lease is stale, or its flow run is over or missing",
        "FAILED (stopped_by=orphaned) or the flow run's end, closed_by=reaper; FINISHED where its job trained to the "
        "end (gpuflow.trained), though its flow died after",
        close_mlflow_runs,
    ),
    Invariant(
        "flow run",
        "its lease is stale; with no lease, its quota stamp or Prefect's heartbeats stopped",
        "Crashed, naming why",
        crash_flow_runs,
    ),
    Invariant(
        "message",
        "its run ended badly and no message was delivered",
        "delivered once, recorded on the MLflow run",
        send_unsaid,
    ),
    Invariant(
        "quota slot",
        "its run is over and its cluster is confirmed gone, or no run holds it (a lease the server forgot)",
        "free",
        free_slots,
    ),
)


def reconcile(run: Pass) -> Pass:
    """Takes every step of INVARIANTS in order; returns the pass, what it did recorded on it."""
    for invariant in INVARIANTS:
        for line in invariant.step(run):
            log.info(line)
    return run
