"""How the reconciler reads and ends a run's records: the clusters judged by their flow run's state and the MLflow
lease (a flow run Prefect calls RUNNING is dead when its lease is stale, cluster/run/lease.py), the flow runs marked
Crashed, the MLflow runs left RUNNING closed. It never touches a cluster whose name is not gpuflow-<flow run id>,
and keeps a cluster whose run is alive until the TTL."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuflow.cluster.backends import CLUSTER_PREFIX, Backend, flow_run_id_of
from gpuflow.cluster.job.reports import fill_from_checkpoints
from gpuflow.cluster.protocol import (
    CLOSED_BY_TAG,
    FLOW_RUN_TAG,
    STOP_DETAIL_TAG,
    STOPPED_BY_TAG,
    trained_then_orphaned,
    true_status,
)
from gpuflow.cluster.run.mlflow_run import close_run
from gpuflow.flows.reconcile.lapsed import HeartbeatAt, heartbeat_reader, lease_lapsed

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600.0  # the reaper's: a cluster up longer is downed whatever its run says
DEAD = "dead (lease stale)"
ORPHANED = "dead (its process and its cluster's are gone)"  # the local backend knows the process that launched it

RUN_STATUS_FOR = {"COMPLETED": "FINISHED", "CANCELLED": "KILLED"}  # any other final state: FAILED
# A run its job closed as orphaned is read until its flow run is marked Crashed: a pass every 10 minutes does it within
# minutes, so one older than this is history, not read again (the pass costs the same with 50 old runs or 5,000).
ORPHANED_WITHIN_S = 7 * 24 * 3600


@dataclass
class Verdict:
    cluster: str
    backend: str
    flow_run_id: str | None
    flow_run_state: str | None  # None: no such flow run
    action: str  # "down" or "keep"
    reason: str
    downed: bool = False

    @property
    def run_is_dead(self) -> bool:
        """Its flow run is live in Prefect but its process is gone: the pass marks it Crashed."""
        return bool(self.flow_run_id) and (DEAD in self.reason or ORPHANED in self.reason)

    @property
    def why_dead(self) -> str:
        return "its lease is stale: its process is gone" if DEAD in self.reason else "its process and cluster are gone"


def flow_run_states(flow_run_ids: set[str]) -> dict[str, tuple[str, bool]]:
    """Flow run id → (state name, is final) from the Prefect API; a missing run is left out."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    states = {}
    with get_client(sync_client=True) as client:
        for flow_run_id in flow_run_ids:
            try:
                state = client.read_flow_run(UUID(flow_run_id)).state
            except ObjectNotFound:
                continue
            states[flow_run_id] = (state.type.value if state else "UNKNOWN", bool(state and state.is_final()))
    return states


@dataclass
class RunRecords:
    """How the reaper reads a flow run's records: its Prefect state (flow run id → (state name, is final); a
    missing run left out), and whether its MLflow lease is stale (None: no lease found)."""

    states_of: Callable[[set[str]], dict[str, tuple[str, bool]]] = flow_run_states
    lease_stale: Callable[[str], bool | None] = lambda flow_run_id: None


def judge(
    backends: list[Backend], records: RunRecords, ttl_seconds: float, now: float
) -> list[tuple[Backend, Verdict]]:
    """What to do with each of our clusters: down when its flow run is final, dead (its lease is stale), missing
    with no fresh lease (another Prefect server's live run has one), or it is older than the TTL."""
    return judge_found(listed(backends), records, ttl_seconds, now)


def listed(backends: list[Backend]) -> list[tuple[Backend, object]]:
    """Every cluster each backend lists, as (backend, its status)."""
    return [(backend, status) for backend in backends for status in statuses(backend)]


def judge_found(
    found: list[tuple[Backend, object]], records: RunRecords, ttl_seconds: float, now: float
) -> list[tuple[Backend, Verdict]]:
    """judge() of clusters already listed (`gpuflow status` shows them too)."""
    states_of, lease_stale = records.states_of, records.lease_stale
    # what is left of a cluster of ours whose launcher died (the local backend's spare or early cluster): gone anyway
    verdicts = [
        (backend, Verdict(status.name, backend.name, None, None, "down", ORPHANED))
        for backend, status in found
        if status.status == "ORPHANED" and not flow_run_id_of(status.name) and status.name.startswith(CLUSTER_PREFIX)
    ]
    ours = [(backend, status, flow_run_id_of(status.name)) for backend, status in found]
    ours = [(backend, status, run_id) for backend, status, run_id in ours if run_id]  # never touch others' clusters
    states = states_of({run_id for _, _, run_id in ours}) if ours else {}
    for backend, status, run_id in ours:
        state = states.get(run_id)
        age_s = now - status.launched_at if status.launched_at else None
        if state is not None and not state[1] and status.status == "ORPHANED":
            action, reason = "down", f"flow run is {state[0]} but {ORPHANED}"
        elif state is None and lease_stale(run_id) is False:  # a live run of another Prefect server
            action, reason = "keep", f"flow run {run_id} is not on this Prefect API, but its MLflow lease is fresh"
        elif state is None:
            action, reason = "down", f"flow run {run_id} does not exist"
        elif state[1]:
            action, reason = "down", f"flow run is over ({state[0]})"
        elif lease_stale(run_id):
            action, reason = "down", f"flow run is {state[0]} but {DEAD}: its process is gone"
        elif age_s is not None and age_s > ttl_seconds:
            action, reason = "down", f"up {age_s / 3600:.1f} h, over the TTL of {ttl_seconds / 3600:g} h ({state[0]})"
        else:
            action, reason = "keep", f"flow run is {state[0]}"
        verdicts.append(
            (backend, Verdict(status.name, backend.name, run_id, state[0] if state else None, action, reason))
        )
    return verdicts


def statuses(backend: Backend) -> list:
    try:
        return backend.status()
    except Exception as exc:  # e.g. SkyPilot's API server unreachable: the other backends still get reaped
        log.warning(f"reaper: cannot list {backend.name} clusters, skipped: {type(exc).__name__}: {exc}")
        return []


def reap(
    backends: list[Backend], ttl_seconds: float, dry_run: bool = False, records: RunRecords | None = None
) -> list[Verdict]:
    """Judges every cluster of the backends and downs the condemned ones (any object with status() and down())."""
    judged = judge(backends, records or RunRecords(), ttl_seconds, time.time())
    for backend, verdict in judged:
        if verdict.action == "down" and not dry_run:
            try:
                backend.down(verdict.cluster)
                verdict.downed = True
            except Exception as exc:  # one cluster that will not go must not keep the others up: next pass retries
                verdict.reason += f"; down failed: {type(exc).__name__}: {exc}"
    return [verdict for _, verdict in judged]


CANCELLED_BY_REAPER = "cancelled; its process ended before it said so: found by the reaper (stopped_by=cancelled)"


def mark_crashed(flow_run_ids: set[str], message: str) -> list[str]:
    """Sets dead flow runs Crashed through Prefect's API (nothing else ever would: their process is gone), each
    owed the message of its end (no hook of theirs will say it: flows/run_messages.py notify_owed). A run whose
    cancel was asked for (Cancelling) ends Cancelled instead, as its cancel would have ended it (CANCELLED_BY_REAPER,
    not the crash's message): what its user asked for, no bad end to be told of. Returns those marked Crashed."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelled, Crashed

    from gpuflow.flows.run_messages import OWED_TAG

    marked = []
    with get_client(sync_client=True) as client:
        for flow_run_id in flow_run_ids:
            # read again right before: a run that ended since the verdict (its process was alive after all) keeps its
            # true end. And the server decides last: Crashed is proposed, not forced, and Prefect refuses it to a run
            # that reached a final state between that read and this write. A Cancelling run's Cancelled is forced
            # (Prefect's runner sends it once it has stopped the process; here the process stopped without it).
            run = client.read_flow_run(UUID(flow_run_id))
            if run.state is not None and run.state.is_final():
                continue
            if run.state is not None and run.state.type == StateType.CANCELLING:
                client.set_flow_run_state(UUID(flow_run_id), Cancelled(message=CANCELLED_BY_REAPER), force=True)
                continue
            result = client.set_flow_run_state(UUID(flow_run_id), Crashed(message=message))
            if result.status != SetStateStatus.ACCEPT:
                continue
            client.update_flow_run(UUID(flow_run_id), tags=sorted({*run.tags, OWED_TAG}))
            marked.append(flow_run_id)
    return sorted(marked)


def close_stale_mlflow_runs(
    tracking_uri: str,
    states_of: Callable[[set[str]], dict[str, tuple[str, bool]]] = flow_run_states,
    dead: set[str] | None = None,
    heartbeat_at: HeartbeatAt | None = None,
) -> list[str]:
    """Ends MLflow runs left RUNNING whose flow run is final, dead (lease lapsed), or missing with no lease to show it
    alive (a run of another Prefect server sharing the tracking server renews its lease), in every experiment.

    Flow runs found dead are added to `dead` (to be marked Crashed), also those whose job already closed its
    run as orphaned."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    if not experiment_ids:
        return []
    # MLflow's filter has no `or`: the runs left RUNNING, and those the job closed as orphaned lately
    since_ms = int((time.time() - ORPHANED_WITHIN_S) * 1000)
    found = {
        run.info.run_id: run
        for where in (
            "attributes.status = 'RUNNING'",
            f"tags.`{STOPPED_BY_TAG}` = 'orphaned' and attributes.end_time > {since_ms}",
        )
        for run in client.search_runs(experiment_ids, filter_string=where, max_results=5000)
    }
    candidates = [run for run in found.values() if run.data.tags.get(FLOW_RUN_TAG)]
    states = states_of({run.data.tags[FLOW_RUN_TAG] for run in candidates}) if candidates else {}
    heartbeat_at = heartbeat_at or heartbeat_reader()
    closed = []
    for run in candidates:
        flow_run_id = run.data.tags[FLOW_RUN_TAG]
        state = states.get(flow_run_id)
        if state is None and lease_lapsed(run.data.tags, flow_run_id, time.time(), heartbeat_at) is False:
            continue  # not on this Prefect API, but its flow renews its lease: another server's live run
        live = state is not None and not state[1]  # the lease judges only a flow run Prefect calls live
        lease_dead = live and (
            flow_run_id in (dead or ()) or bool(lease_lapsed(run.data.tags, flow_run_id, time.time(), heartbeat_at))
        )
        if live and (lease_dead or run.data.tags.get(STOPPED_BY_TAG) == "orphaned"):
            if dead is not None:
                dead.add(flow_run_id)
        if run.info.status != "RUNNING":
            if run.data.tags.get(STOPPED_BY_TAG) == "orphaned":  # closed by its job, maybe without its last reports
                fill_quietly(client, run)
            continue
        if live and not lease_dead:
            continue  # its flow is still going
        fill_quietly(client, run)
        if live or (state is not None and state[0] == "CRASHED"):  # its flow died (this pass sees it, or one saw)
            status, tags = end_of_orphan(run, cancelled=state is not None and state[0] == "CANCELLING")
            close_run(client, run.info.run_id, status, tags=tags)
        else:
            status = true_status(RUN_STATUS_FOR.get(state[0], "FAILED") if state else "KILLED", run.data.tags)
            close_run(client, run.info.run_id, status, tags={CLOSED_BY_TAG: "reaper"})
        closed.append(run.info.run_id)
    return closed


def end_of_orphan(run, cancelled: bool = False) -> tuple[str, dict[str, str]]:
    """A run whose flow died before closing it: FINISHED where its job trained to the end, else FAILED; orphaned.
    One whose cancel was asked for before: KILLED, cancelled, as its flow would have closed it."""
    if cancelled:
        detail = "cancelled; its flow run's process ended before it closed the run: found by the reaper"
        return "KILLED", {STOPPED_BY_TAG: "cancelled", CLOSED_BY_TAG: "reaper", STOP_DETAIL_TAG: detail}
    status = true_status("FAILED", run.data.tags)
    tags = {STOPPED_BY_TAG: "orphaned", CLOSED_BY_TAG: "reaper"}
    if status == "FINISHED":
        tags[STOP_DETAIL_TAG] = trained_then_orphaned(run.data.tags)
    return status, tags


def fill_quietly(client, run) -> None:
    """The run's persisted reports into MLflow before it is left closed (cluster/job/reports.py)."""
    try:
        if filled := fill_from_checkpoints(client, run):
            log.info(f"reaper: MLflow run {run.info.run_id}: {filled} metric(s) from its persisted checkpoints")
    except Exception as exc:  # the tracking server blinked: the next pass tries again
        log.warning(f"reaper: MLflow run {run.info.run_id}: {type(exc).__name__}: {str(exc)[:200]}")
