"""Live flow runs that died where no lease of ours covers them (killed while waiting for the quota, or before their
MLflow run opened): the facts read from Prefect and MLflow, judged by cluster/run/liveness.py.

    used by the reconciler's pass (invariants.py) and `gpuflow status` (found_dead: what the next pass will crash)
"""

from __future__ import annotations


def dead_without_lease(cluster_run_ids: set[str], tracking_uris: list[str], now: float) -> dict[str, str]:
    """Live run-experiment flow runs that died where no lease of ours covers them (cluster/run/liveness.py):
    flow run id → why. cluster_run_ids: the flow runs a backend lists a cluster of."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    from gpuflow.cluster.run.liveness import LiveRun, age_s, mlflow_run_exists, silent_death
    from gpuflow.cluster.util.local_store import store_exists
    from gpuflow.flows.deployments.known_servers import TRACKING_TAG_PREFIX
    from gpuflow.flows.heartbeats import last_heartbeat
    from gpuflow.flows.quota import pools
    from gpuflow.flows.quota.pools import every_flow_run

    with get_client(sync_client=True) as client:
        runs = every_flow_run(
            client,
            flow_filter=FlowFilter(name=FlowFilterName(any_=["run-experiment"])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["RUNNING", "PENDING", "CANCELLING"]))
            ),
        )
        dead, kept = {}, None
        for run in runs:
            run_id, waiting = str(run.id), run.state.name == pools.WAITING
            if run.state.type.value == "PENDING":  # a served run's worker begins it; else only its own process would
                if run.deployment_id is None:
                    never_begun = LiveRun(
                        run_id,
                        waiting=False,
                        state_age_s=age_s(now, run.state.timestamp.timestamp()),
                        heartbeat_age_s=None,
                        heartbeats_kept=False,
                        has_cluster=False,
                        has_mlflow_run=None,
                        pending_without_deployment=True,
                    )
                    if why := silent_death(never_begun, pools.STALE_S):
                        dead[run_id] = why
                continue
            has_cluster = run_id.replace("-", "") in {found.replace("-", "") for found in cluster_run_ids}
            own = [tag.removeprefix(TRACKING_TAG_PREFIX) for tag in run.tags if tag.startswith(TRACKING_TAG_PREFIX)]
            mlflow = (
                None
                if waiting or has_cluster
                else mlflow_run_exists(
                    [MlflowClient(uri) for uri in dict.fromkeys([*own, *tracking_uris]) if store_exists(uri)], run_id
                )  # a store that is not there holds no run; opening it would create it
            )
            beat = None if waiting or has_cluster or mlflow is not False else last_heartbeat(client, run_id)
            if beat is None and mlflow is False and kept is None:
                kept = last_heartbeat(client, None) is not None
            live = LiveRun(
                run_id,
                waiting,
                age_s(now, run.state.timestamp.timestamp()),
                None if beat is None else age_s(now, beat),
                bool(kept),
                has_cluster,
                mlflow,
            )
            if why := silent_death(live, pools.STALE_S):
                dead[run_id] = why
    return dead


def found_dead(found, tracking_uris: list[str], now: float) -> dict[str, str]:
    """The live runs the reconciler's next pass marks Crashed, flow run id → why, by its own verdicts: their
    cluster's (lease stale, or their process and local cluster gone), else their silence. found: the clusters the
    backends list, as (backend, status)."""
    from gpuflow.flows.reconcile.lapsed import lease_reader
    from gpuflow.flows.reconcile.records import DEFAULT_TTL_S, RunRecords, judge_found

    judged = judge_found(found, RunRecords(lease_stale=lease_reader(tracking_uris)), DEFAULT_TTL_S, now)
    verdicts = [verdict for _, verdict in judged]
    dead = {verdict.flow_run_id: verdict.why_dead for verdict in verdicts if verdict.run_is_dead}
    kept = {verdict.flow_run_id for verdict in verdicts if verdict.action == "keep"}
    silent = dead_without_lease(kept, tracking_uris, now)
    return {**{run_id: why.split(":")[0] for run_id, why in silent.items()}, **dead}
