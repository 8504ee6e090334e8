"""The reaper: the reconciler's pass as a Prefect flow. It downs every gpuflow cluster whose flow run is over, dead,
missing or too old, closes the MLflow runs left RUNNING, marks dead flow runs Crashed, sends the end messages no one
sent and gives back the quota's slots no live run holds (flows/reconcile/invariants.py says each, as data).

    python -m gpuflow.flows.reaper                 # once, here; deployed every 10 min as flows/reaper.py:reap_clusters

The backstop for what no hook can cover (flow and runner both killed, a cancelled plain script, the Prefect server
down, a server restart that forgot the quota's leases). A serve that serves it asks for a pass when it starts.
"""

from __future__ import annotations

from dataclasses import asdict

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.cluster.run.mlflow_run import at_most_one_try
from gpuflow.flows.deployments import REAPER
from gpuflow.flows.deployments.known_servers import backends_in_use
from gpuflow.flows.reconcile.invariants import Pass, reconcile
from gpuflow.flows.reconcile.sources import available_backends, tracking_uris_or_local
from gpuflow.flows.run_logs import attach_gpuflow_loggers


@flow(name=REAPER, log_prints=True)
def reap_clusters(
    ttl_hours: float = 24.0,
    backends: list[str] | None = None,
    tracking_uris: list[str] | None = None,
    dry_run: bool = False,
) -> list[dict]:
    """One pass of the reconciler: downs orphaned gpuflow clusters (flow run final, dead, missing, or older than
    ttl_hours), closes their MLflow runs, marks dead flow runs Crashed, sends unsent end messages, frees the quota's
    leaked slots. tracking_uris: by default every server the deployments and recent runs use."""
    attach_gpuflow_loggers()  # gpuflow's own lines (each step's) in this run's logs
    uris = tracking_uris or tracking_uris_or_local()
    get_run_logger().info(f"reading the MLflow runs of {', '.join(uris)}")
    chosen = available_backends(backends or backends_in_use(["local", "skypilot"]))
    try:
        with at_most_one_try():  # a tracking server that is down waits for the next pass, not minutes of this one
            done = reconcile(Pass(chosen, uris, ttl_hours * 3600, dry_run))
    finally:
        for backend in chosen:  # e.g. the SkyPilot API server that listing the clusters started
            getattr(backend, "close", lambda: None)()
    create_markdown_artifact(report(done), key="reaper", description="clusters the reaper downed and why")
    return [asdict(verdict) for verdict in done.verdicts]


def report(done: Pass) -> str:
    """The pass as the Prefect UI shows it (the reaper run's artifact)."""
    lines = ["# Reaper", "", "| cluster | backend | flow run state | action | why |", "| --- | --- | --- | --- | --- |"]
    lines += [
        f"| `{v.cluster}` | {v.backend} | {v.flow_run_state or 'missing'} | "
        f"{'downed' if v.downed else v.action} | {v.reason} |"
        for v in done.verdicts
    ]
    if not done.verdicts:
        lines.append("| (no gpuflow clusters) | | | | |")
    lines += ["", f"MLflow runs closed: {len(done.closed)}", *[f"- `{run}`" for run in done.closed]]
    lines += ["", f"Flow runs marked Crashed: {len(done.crashed)}", *[f"- `{run}`" for run in done.crashed]]
    lines += ["", f"End messages: {len(done.said)}", *[f"- {line}" for line in done.said]]
    lines += ["", f"Quotas recounted: {len(done.recounted)}"]
    lines += [
        f"- `{found.pool}`: " + (f"gave back {found.freed} leaked slot(s)" if found.freed else found.note)
        for found in done.recounted
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    reap_clusters()
