"""The MLflow tracking servers the runs use, as the Prefect server knows them: no parameter to keep in step.

    used by the reaper, which must close the runs of every server, not only this machine's store

Two sources: each deployment's spec (with `gpuflow serve --set` / `gpuflow deploy` overrides, as registered) and
the `tracking:<uri>` tag every experiment run puts on its flow run once its spec is read (a form run, a spec_file,
`gpuflow run --set tracking.uri=...`). Only servers are taken from them: a local store named by another machine's
run is that machine's, and opening its path here would create an empty one.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

log = logging.getLogger(__name__)

TRACKING_TAG_PREFIX = "tracking:"
SERVER_SCHEMES = ("http://", "https://", "databricks")
RECENT_RUNS = 200  # flow runs read for their tag, the newest first (the API gives at most 200)


def tracking_tag(uri: str) -> str:
    return TRACKING_TAG_PREFIX + uri


def known_tracking_uris(local_uri: str, within_hours: float = 48.0) -> list[str]:
    """`local_uri` first, then every tracking server of a deployment or of a flow run started within the hours."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    since = datetime.now(timezone.utc) - timedelta(hours=within_hours)
    with get_client(sync_client=True) as client:
        found = [deployment_uri(deployment.parameters) for deployment in client.read_deployments()]
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)),
            sort=FlowRunSort.START_TIME_DESC,
            limit=RECENT_RUNS,
        )
        found += [
            tag.removeprefix(TRACKING_TAG_PREFIX)
            for run in runs
            for tag in run.tags
            if tag.startswith(TRACKING_TAG_PREFIX)
        ]
    servers = [uri.rstrip("/") for uri in found if uri and uri.startswith(SERVER_SCHEMES)]
    return list(dict.fromkeys([local_uri, *servers]))


def backends_in_use(candidates: list[str]) -> list[str]:
    """The candidates that a flow run on the Prefect server ever used (its `backend:<name>` tag), and "local"
    always (listing it costs nothing). A backend no run used has no cluster of ours: listing SkyPilot's would
    start its API server, seconds of every reaper pass, for nothing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    try:
        with get_client(sync_client=True) as client:
            return [
                name
                for name in candidates
                if name == "local"
                or client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"backend:{name}"])), limit=1
                )
            ]
    except Exception as exc:  # the Prefect API down: list them all, as before
        log.warning(f"cannot ask Prefect which backends runs used, listing all: {type(exc).__name__}: {exc}")
        return list(candidates)


def deployment_uri(parameters: dict) -> str | None:
    spec = parameters.get("spec") if isinstance(parameters, dict) else None
    tracking = spec.get("tracking") if isinstance(spec, dict) else None
    return tracking.get("uri") if isinstance(tracking, dict) else None


def forgetful_server(client) -> str | None:
    """What to tell the admin when the Prefect server keeps the quota's leases in memory (Prefect's default): a
    restart forgets them and the slots stay taken until a recount. None when it keeps them on disk or in Redis, or
    will not say."""
    from gpuflow.cluster.util.lease_storage import leases_kept_in_memory

    if not leases_kept_in_memory(client):
        return None
    return (
        "the Prefect server keeps concurrency leases in memory: a restart forgets the GPU quota's, and their slots "
        "stay taken until the reaper's next pass gives them back. Start it with "
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem (one server; "
        "several replicas: prefect-redis, docs/team.md)"
    )
