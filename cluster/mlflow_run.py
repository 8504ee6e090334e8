"""Ending a flow's MLflow run with its outcome: from the flow, from the job on the cluster, or from the reaper."""

from __future__ import annotations

import time

from mlflow.entities import Metric

RETRY_DELAYS_S = (1, 2, 4, 8, 15)  # a tracking server restarting takes seconds: the run must still end


def close_run(client, run_id: str, status: str, metrics: dict[str, float] | None = None,
              tags: dict[str, str] | None = None, overwrite: bool = False) -> bool:
    """Logs the last metrics and tags and ends the run FINISHED, FAILED or KILLED.

    A run that already ended keeps its status unless `overwrite` (the job that stopped itself ended it first,
    with the reason only it knew). Returns False when the tracking server stayed unreachable."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            for key, value in (tags or {}).items():
                client.set_tag(run_id, key, value)
            if metrics:
                now = int(time.time() * 1000)
                client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                                 synchronous=True)
            if overwrite or client.get_run(run_id).info.status == "RUNNING":
                client.set_terminated(run_id, status)
            return True
        except Exception:
            if delay is None:
                return False
            time.sleep(delay)
    return False
