"""A flow run's Prefect tags (what it runs, where it is tracked, its quota's pool) and its page in the Prefect UI.

used by flows/experiment.py; a run from the UI or a schedule is tagged experiment:<name> and backend:<backend>
"""

from __future__ import annotations

from gpuflow.cluster.protocol import SOURCE_STAMP_PREFIX
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.flows.deployments.known_servers import tracking_tag
from gpuflow.flows.quota.pools import POOL_TAG_PREFIX, need_of

REUSED_TAG_PREFIX = "reused-run:"  # + the MLflow run id a run reused instead of training (cluster/rerun/reuse.py)


def run_tags(spec: ExperimentSpec) -> list[str]:
    """experiment:, backend:, tracking: (read by the reaper, so that it closes the runs of every server) and quota:
    (the GPU quota's queue)."""
    return [
        f"experiment:{spec.name}",
        f"backend:{spec.compute.backend}",
        tracking_tag(spec.tracking_uri),
        POOL_TAG_PREFIX + need_of(spec).pool,
    ]


def tag_flow_run(flow_run_id, existing_tags, spec: ExperimentSpec) -> list[str]:
    """Adds the run's experiment and backend to its Prefect tags (deployment tags are fixed before the form is read)."""
    from prefect.client.orchestration import get_client

    tags = sorted(set(existing_tags) | set(run_tags(spec)))
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run_id, tags=tags)
    return tags


def source_stamp_of(flow_run_id: str) -> str | None:
    """The source stamp (cluster/rerun/source.py) a flow run recorded as it opened its MLflow run; None when this
    Prefect API has no such flow run (another server's, or gone), or it recorded none (an older gpuflow's)."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(UUID(flow_run_id)).tags
    except (ObjectNotFound, ValueError):
        return None
    return next((tag.removeprefix(SOURCE_STAMP_PREFIX) for tag in tags if tag.startswith(SOURCE_STAMP_PREFIX)), None)


def flow_run_ui_url(flow_run_id) -> str | None:
    """The flow run's page in the Prefect UI (PREFECT_UI_URL).

    Not runtime.flow_run.ui_url: in Prefect 3.8.8 it gives Cloud's /flow-runs/flow-run/<id>, a 404 on a
    self-hosted server; url_for knows each UI's path.
    """
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id)


def prefect_link(flow_run_id, ui_url: str | None) -> str:
    """The flow run's page; a run on Prefect's temporary API has none, and its id says which run it was."""
    return ui_url or f"flow run {flow_run_id} (Prefect's temporary API: no UI)"
