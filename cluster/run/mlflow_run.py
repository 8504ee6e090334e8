"""Ending a flow's MLflow run with its outcome: from the flow, from the job on the cluster, or from the reaper."""

from __future__ import annotations

import time

from mlflow.entities import Metric

RETRY_DELAYS_S = (1, 2, 4, 8, 15)  # a tracking server restarting takes seconds: the run must still end


def close_run(client, run_id: str, status: str, metrics: dict[str, float] | None = None,
              tags: dict[str, str] | None = None, overwrite: bool = False) -> bool:
    """Logs the last metrics and tags and ends the run FINISHED, FAILED or KILLED.

    A run that already ended keeps its status unless `overwrite` (the job that stopped itself ended it first,
    with the reason only it knew). Its child runs still RUNNING (a sweep's trials) end with the same status.
    Returns False when the tracking server stayed unreachable."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            for key, value in (tags or {}).items():
                client.set_tag(run_id, key, value)
            if metrics:
                now = int(time.time() * 1000)
                client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                                 synchronous=True)
            close_children(client, run_id, status)
            if overwrite or client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status)
            return True
        except Exception:
            if delay is None:
                return False
            time.sleep(delay)
    return False


def close_children(client, run_id: str, status: str) -> list[str]:
    """Ends the run's child runs (tag mlflow.parentRunId) still RUNNING with `status`: whatever ends a sweep, a
    cancel, a limit, a crash, the reaper, ends its trials too."""
    experiment = client.get_run(run_id).info.experiment_id
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{run_id}' and "
                                                "attributes.status = 'RUNNING'", max_results=5000)
    for child in children:
        client.set_terminated(child.info.run_id, status)
    return [child.info.run_id for child in children]


def stop_of_closed_run(client, run_id: str) -> tuple[str, str] | None:
    """(stopped_by, detail) when the job on the cluster stopped the run itself and closed it; None otherwise
    (still RUNNING, or the tracking server unreachable)."""
    from gpuflow.cluster.protocol import STOP_DETAIL_TAG, STOPPED_BY_TAG

    try:
        run = client.get_run(run_id)
    except Exception:
        return None
    reason = run.data.tags.get(STOPPED_BY_TAG)
    if run.info.status == "RUNNING" or not reason:
        return None
    return reason, run.data.tags.get(STOP_DETAIL_TAG, f"stopped: {reason} (by the job on the cluster)")
