"""Whether a run's MLflow lease says its flow died: the lease lapsed (no renewal for its grace period) and, where
Prefect keeps the flow run's heartbeats, they stopped too. A tracking server that was down stops the flow's renewals
but not its heartbeats: on the lease alone, a pass during (or just after) an outage would take every live run for
dead and down its cluster."""

from __future__ import annotations

import time
from collections.abc import Callable

from gpuflow.cluster.protocol import STOPPED_BY_TAG
from gpuflow.cluster.run.lease import stale
from gpuflow.cluster.run.liveness import beating
from gpuflow.cluster.run.mlflow_run import runs_of_flow_run

DEFAULT_GRACE_S = 120.0  # for a lease written without its grace period

HeartbeatAt = Callable[[str], float | None]  # flow run id → its last Prefect heartbeat (None: none kept or readable)


def lease_lapsed(tags: dict[str, str], flow_run_id: str, now: float, heartbeat_at: HeartbeatAt) -> bool | None:
    """None where the run has no lease; True once it lapsed and the flow run's heartbeats, where kept, are late."""
    lapsed = stale(tags, now, DEFAULT_GRACE_S)
    if not lapsed:
        return lapsed
    beat = heartbeat_at(flow_run_id)
    return beat is None or not beating(now - beat)


def heartbeat_reader() -> HeartbeatAt:
    """Reads a flow run's last heartbeat from the Prefect API this process uses; None when it cannot say."""

    def heartbeat_at(flow_run_id: str) -> float | None:
        from prefect.client.orchestration import get_client

        from gpuflow.flows.heartbeats import last_heartbeat

        try:
            with get_client(sync_client=True) as client:
                return last_heartbeat(client, flow_run_id)
        except Exception:  # the API down: the lease alone judges, as it did before heartbeats
            return None

    return heartbeat_at


def lease_reader(tracking_uris: list[str], heartbeat_at: HeartbeatAt | None = None) -> Callable[[str], bool | None]:
    """flow run id → is it dead: its lease lapsed (lapsed.py), or its job closed its run as orphaned (None: no lease
    found)."""
    from mlflow import MlflowClient

    heartbeat_at = heartbeat_at or heartbeat_reader()

    def lease_stale(flow_run_id: str) -> bool | None:
        for uri in tracking_uris:
            for run in runs_of_flow_run(MlflowClient(tracking_uri=uri), flow_run_id):
                if run.data.tags.get(STOPPED_BY_TAG) == "orphaned":
                    return True  # the job on the cluster found its flow gone and said so
                verdict = lease_lapsed(run.data.tags, flow_run_id, time.time(), heartbeat_at)
                if verdict is not None:
                    return verdict
        return None

    return lease_stale
