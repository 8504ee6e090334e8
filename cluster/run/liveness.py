"""Whether a flow run that Prefect still calls live has died, when no lease of ours can say (cluster/run/lease.py).

A run killed while it waits for the quota, or before its MLflow run opens, has no MLflow lease and no cluster: the
reaper judges it by what Prefect keeps. A waiter re-stamps its state every few seconds (flows/quota/); any other
run is judged by Prefect's flow-run heartbeats when it sends them (PREFECT_FLOWS_HEARTBEAT_FREQUENCY), else by how
long it has gone without a cluster or an MLflow run. A run killed in its first seconds may never have sent one: where
the server keeps other runs' heartbeats, its silence since it started counts as heartbeats missed. A run that
`gpuflow run` created but never began (its process died, or Prefect's API did as the run was created, and the
client's retry made another) stays Pending: no deployment's worker will start it. Prefect-free: the facts are read in
flows/reconcile/dead_runs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

PROVISION_GRACE_S = 600.0  # with no heartbeats: validate and stage may be slow before the MLflow run opens
HEARTBEAT_LATE_S = 180.0  # Prefect's heartbeats come every 30 s or more often: six missed
# `gpuflow run` begins its flow run in the second it creates it; Prefect's client gives up retrying within ~75 s
NEVER_BEGUN_S = 120.0


@dataclass(frozen=True)
class LiveRun:
    """What is known of a live flow run; ages in seconds, never negative (another machine's clock may be ahead)."""

    flow_run_id: str
    waiting: bool  # in the quota's queue, stamping its state
    state_age_s: float  # since its state was last set or stamped
    heartbeat_age_s: float | None  # since its last Prefect heartbeat; None: none of it was kept
    heartbeats_kept: bool  # the server keeps flow runs' heartbeats (it holds some): a run without any sent none
    has_cluster: bool  # a backend lists a cluster of it
    has_mlflow_run: bool | None  # None: a tracking server could not be read
    pending_without_deployment: bool = False  # created by its own process (gpuflow run), never begun


def silent_death(run: LiveRun, stale_s: float) -> str | None:
    """Why the run is dead (for its Crashed message), or None when it may live or a lease or cluster judges it."""
    if run.pending_without_deployment:
        if run.state_age_s > NEVER_BEGUN_S:
            return (
                f"its process never began it (Pending for {run.state_age_s:.0f} s, and no deployment's worker "
                "starts a run of `gpuflow run`): found by the reaper"
            )
        return None
    if run.waiting:
        if waiter_is_dead(run.state_age_s, stale_s):
            return (
                f"its process died while waiting for GPUs (state unstamped for {run.state_age_s:.0f} s): "
                "found by the reaper"
            )
        return None
    if run.has_cluster or run.has_mlflow_run is not False:
        return None  # the reaper's cluster and lease checks judge it, or it cannot be told now
    if run.heartbeat_age_s is not None or run.heartbeats_kept:
        silent_s = silent_for(run.state_age_s, run.heartbeat_age_s)
        if not beating(silent_s):
            return (
                f"its process died before its MLflow run opened (no Prefect heartbeat for "
                f"{silent_s:.0f} s, no cluster): found by the reaper"
            )
        return None
    if run.state_age_s > PROVISION_GRACE_S:
        return (
            f"its process died before its MLflow run opened (no cluster nor MLflow run "
            f"{run.state_age_s / 60:.0f} min after it started): found by the reaper"
        )
    return None


def silent_for(state_age_s: float, heartbeat_age_s: float | None) -> float:
    """How long a run that sends heartbeats has said nothing: since its last one, or since its state was set when it
    has sent none yet (a run killed in its first seconds may never send one)."""
    return state_age_s if heartbeat_age_s is None else heartbeat_age_s


def beating(heartbeat_age_s: float) -> bool:
    """Whether a run whose last Prefect heartbeat is this old may still live (its process sends one every 30 s)."""
    return heartbeat_age_s <= HEARTBEAT_LATE_S


def waiter_is_dead(state_age_s: float, stale_s: float) -> bool:
    """A run in the quota's queue re-stamps its state every few seconds: one not stamped for stale_s was killed."""
    return state_age_s > stale_s


def age_s(now: float, then: float) -> float:
    """now - then, never negative: `then` may come from a machine whose clock is ahead of this one."""
    return max(0.0, now - then)


def mlflow_run_exists(clients, flow_run_id: str) -> bool | None:
    """Whether any of the MLflow clients holds a run of the flow run; None when one could not be read and none
    had it."""
    from gpuflow.cluster.run.mlflow_run import runs_of_flow_run

    unread = False
    for client in clients:
        try:
            if runs_of_flow_run(client, flow_run_id):
                return True
        except Exception:  # a tracking server down: not a proof the run is gone
            unread = True
    return None if unread else False
