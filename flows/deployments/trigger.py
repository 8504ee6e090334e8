"""`gpuflow run --deployment NAME`: a run of a served (or deployed) deployment, started from this terminal and
recorded as the caller's.

    gpuflow run --deployment run-experiment/run-experiment --set train.epochs=3

A self-hosted Prefect server has one shared credential, not users: it records no creator for a run started through
its API or UI. This tags the flow run with the caller's MLflow user (MLFLOW_TRACKING_USERNAME), and the flow copies
it onto its MLflow run (protocol.TRIGGERED_BY_TAG). The tag is what the caller declared, not what a server checked.
"""

from __future__ import annotations

import os

from gpuflow.cluster.protocol import TRIGGERED_BY_PREFECT_TAG_PREFIX
from gpuflow.flows.deployments.deploy import with_overrides


def trigger(name: str, overrides: list[str] = ()) -> str:
    """Creates a flow run of the deployment `flow/deployment` (the deployment's spec with `overrides`); its id."""
    from prefect.client.orchestration import get_client

    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(name)
        parameters = with_overrides(deployment.parameters, overrides) if overrides else None
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters=parameters, tags=[TRIGGERED_BY_PREFECT_TAG_PREFIX + user] if user else []
        )
    print(
        f"gpuflow: started {flow_run.name} ({flow_run.id}) of {name}"
        + (f", triggered by {user}" if user else "; MLFLOW_TRACKING_USERNAME unset: recorded as nobody's")
    )
    return str(flow_run.id)
