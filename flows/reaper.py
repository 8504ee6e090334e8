"""The reaper: downs every gpuflow cluster whose flow run is over, missing or too old, and closes its stale MLflow runs.

    python -m flows.reaper                 # once, here; deployed every 10 min as flows/reaper.py:reap_clusters

The backstop for what no hook can cover (flow and runner both killed, a cancelled plain script, the Prefect
server down): see shared/notes/prefect-lifecycle.md. It never touches a cluster whose name is not
gpuflow-<flow run id>, and keeps a cluster whose run is still going until the TTL.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from cluster.backends import Backend, flow_run_id_of
from cluster.spec import default_tracking_uri
from tasks.tracking import FLOW_RUN_TAG

RUN_STATUS_FOR = {"COMPLETED": "FINISHED", "CANCELLED": "KILLED"}  # any other final state: FAILED


@dataclass
class Verdict:
    cluster: str
    backend: str
    flow_run_id: str | None
    flow_run_state: str | None  # None: no such flow run
    action: str  # "down" or "keep"
    reason: str
    downed: bool = False


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


def judge(backends: list[Backend], states_of: Callable[[set[str]], dict[str, tuple[str, bool]]],
          ttl_seconds: float, now: float) -> list[tuple[Backend, Verdict]]:
    """What to do with each of our clusters: down when its flow run is final, missing, or it is older than the TTL."""
    found = [(backend, status) for backend in backends for status in statuses(backend)]
    ours = [(backend, status, flow_run_id_of(status.name)) for backend, status in found]
    ours = [(backend, status, run_id) for backend, status, run_id in ours if run_id]  # never touch others' clusters
    states = states_of({run_id for _, _, run_id in ours}) if ours else {}
    verdicts = []
    for backend, status, run_id in ours:
        state = states.get(run_id)
        age_s = now - status.launched_at if status.launched_at else None
        if state is None:
            action, reason = "down", f"flow run {run_id} does not exist"
        elif state[1]:
            action, reason = "down", f"flow run is over ({state[0]})"
        elif age_s is not None and age_s > ttl_seconds:
            action, reason = "down", f"up {age_s / 3600:.1f} h, over the TTL of {ttl_seconds / 3600:g} h ({state[0]})"
        else:
            action, reason = "keep", f"flow run is {state[0]}"
        verdicts.append((backend, Verdict(status.name, backend.name, run_id, state[0] if state else None, action, reason)))
    return verdicts


def statuses(backend: Backend) -> list:
    try:
        return backend.status()
    except Exception as exc:  # e.g. SkyPilot's API server unreachable: the other backends still get reaped
        print(f"reaper: cannot list {backend.name} clusters, skipped: {type(exc).__name__}: {exc}")
        return []


def reap(backends: list[Backend], ttl_seconds: float, dry_run: bool = False,
         states_of: Callable[[set[str]], dict[str, tuple[str, bool]]] = flow_run_states) -> list[Verdict]:
    """Judges every cluster of the backends and downs the condemned ones (any object with status() and down())."""
    judged = judge(backends, states_of, ttl_seconds, time.time())
    for backend, verdict in judged:
        if verdict.action == "down" and not dry_run:
            backend.down(verdict.cluster)
            verdict.downed = True
    return [verdict for _, verdict in judged]


def close_stale_mlflow_runs(tracking_uri: str,
                            states_of: Callable[[set[str]], dict[str, tuple[str, bool]]] = flow_run_states) -> list[str]:
    """Ends MLflow runs left RUNNING whose flow run is final or missing, in every experiment of the store."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    if not experiment_ids:
        return []
    running = [run for run in client.search_runs(experiment_ids, filter_string="attributes.status = 'RUNNING'",
                                                 max_results=5000)
               if run.data.tags.get(FLOW_RUN_TAG)]
    states = states_of({run.data.tags[FLOW_RUN_TAG] for run in running}) if running else {}
    closed = []
    for run in running:
        state = states.get(run.data.tags[FLOW_RUN_TAG])
        if state is not None and not state[1]:
            continue  # its flow is still going
        client.set_tag(run.info.run_id, "gpuflow.closed_by", "reaper")
        client.set_terminated(run.info.run_id, RUN_STATUS_FOR.get(state[0], "FAILED") if state else "KILLED")
        closed.append(run.info.run_id)
    return closed


def available_backends(names: list[str]) -> list[Backend]:
    """The backends that can be used here; one that cannot (SkyPilot not set up) is skipped with a log line."""
    from cluster.backends import get_backend

    backends = []
    for name in names:
        try:
            backends.append(get_backend(name))
        except Exception as exc:  # an import error, missing credentials: skip, never stop the whole reaper
            get_run_logger().warning(f"reaper: skipping the {name} backend: {type(exc).__name__}: {exc}")
    return backends


@flow(name="reap-clusters", log_prints=True)
def reap_clusters(ttl_hours: float = 24.0, backends: list[str] | None = None,
                  tracking_uris: list[str] | None = None, dry_run: bool = False) -> list[dict]:
    """Downs orphaned gpuflow clusters (flow run final, missing, or older than ttl_hours) and closes stale MLflow runs."""
    logger = get_run_logger()
    verdicts = reap(available_backends(backends or ["local", "skypilot"]), ttl_hours * 3600, dry_run=dry_run)
    for verdict in verdicts:
        logger.info(f"{verdict.action} {verdict.backend} cluster {verdict.cluster}: {verdict.reason}"
                    + (" (dry run)" if dry_run and verdict.action == "down" else ""))
    closed = []
    for uri in tracking_uris or [default_tracking_uri()]:
        try:
            closed += [f"{uri} {run_id}" for run_id in close_stale_mlflow_runs(uri)]
        except Exception as exc:  # one unreachable store must not stop the cluster work above from being reported
            logger.warning(f"reaper: cannot read MLflow at {uri}: {exc}")
    for run in closed:
        logger.info(f"closed MLflow run left RUNNING: {run}")
    create_markdown_artifact(report(verdicts, closed), key="reaper", description="clusters the reaper downed and why")
    return [asdict(verdict) for verdict in verdicts]


def report(verdicts: list[Verdict], closed: list[str]) -> str:
    lines = ["# Reaper", "", "| cluster | backend | flow run state | action | why |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{v.cluster}` | {v.backend} | {v.flow_run_state or 'missing'} | "
              f"{'downed' if v.downed else v.action} | {v.reason} |" for v in verdicts]
    if not verdicts:
        lines.append("| (no gpuflow clusters) | | | | |")
    lines += ["", f"MLflow runs closed: {len(closed)}", *[f"- `{run}`" for run in closed]]
    return "\n".join(lines)


if __name__ == "__main__":
    reap_clusters()
