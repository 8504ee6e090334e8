"""Ending a flow's MLflow run with its outcome: from the flow, from the job on the cluster, or from the reaper;
finding the runs a flow run made; reading many tracking servers without waiting on the ones that are down."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

from mlflow.entities import Metric, RunTag, ViewType

from gpuflow.cluster.protocol import FLOW_RUN_TAG

RETRY_DELAYS_S = (1, 2, 4, 8, 15)  # a tracking server restarting takes seconds: the run must still end


def close_run(
    client,
    run_id: str,
    status: str,
    metrics: dict[str, float] | None = None,
    tags: dict[str, str] | None = None,
    overwrite: bool = False,
    children: bool = True,
) -> bool:
    """Logs the last metrics and tags and ends the run FINISHED, FAILED or KILLED.

    A run that already ended keeps its status unless `overwrite` (the job that stopped itself ended it first,
    with the reason only it knew). Its child runs still RUNNING (a sweep's trials) end with the same status;
    `children=False` where the run can have none (no sweep): then no search for them.
    Returns False when the tracking server stayed unreachable.

    At most four calls: the run read once (its status, its experiment), metrics and tags in one batch, the
    children's search, the status."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            run = client.get_run(run_id).info
            if metrics or tags:
                now = int(time.time() * 1000)
                client.log_batch(
                    run_id,
                    metrics=[Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()],
                    tags=[RunTag(k, v) for k, v in (tags or {}).items()],
                    synchronous=True,
                )
            if children:
                close_children(client, run_id, status, run.experiment_id)
            if overwrite or run.status == "RUNNING":
                client.set_terminated(run_id, status)
            return True
        except Exception:
            if delay is None:
                return False
            time.sleep(delay)
    return False


def close_children(client, run_id: str, status: str, experiment: str | None = None) -> list[str]:
    """Ends the run's child runs (tag mlflow.parentRunId) still RUNNING with `status`: whatever ends a sweep, a
    cancel, a limit, a crash, the reaper, ends its trials too."""
    experiment = experiment or client.get_run(run_id).info.experiment_id
    children = client.search_runs(
        [experiment], f"tags.`mlflow.parentRunId` = '{run_id}' and attributes.status = 'RUNNING'", max_results=5000
    )
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


def artifact_repo(artifact_uri: str, tracking_uri: str | None = None):
    """The artifact store of a run whose artifact URI is known (from creating or reading it): MlflowClient's own
    log_text / log_artifacts would ask the server for the run first, to learn it."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    return get_artifact_repository(artifact_uri, tracking_uri=tracking_uri)


def log_text_to(repo, text: str, artifact_file: str) -> None:
    """MlflowClient.log_text into `repo` (artifact_repo)."""
    where = Path(artifact_file)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, where.name)
        path.write_text(text, encoding="utf-8")
        repo.log_artifact(str(path), str(where.parent) if str(where.parent) != "." else None)


def log_bytes_to(repo, data: bytes, artifact_file: str) -> None:
    """log_text_to, for bytes (a binary diff is no text)."""
    where = Path(artifact_file)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, where.name)
        path.write_bytes(data)
        repo.log_artifact(str(path), str(where.parent) if str(where.parent) != "." else None)


def runs_of_flow_run(client, flow_run_id: str, experiment: str | None = None, running: bool = False) -> list:
    """The MLflow runs a flow run made (a sweep's parent and its trials too), found by their flow-run tag: in the
    named experiment, or in every active one; with `running`, only those still RUNNING."""
    if experiment is None:
        ids = [found.experiment_id for found in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
    else:
        ids = [found.experiment_id] if (found := client.get_experiment_by_name(experiment)) else []
    query = f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}'" + (" and attributes.status = 'RUNNING'" if running else "")
    return client.search_runs(ids, filter_string=query) if ids else []


ONE_TRY = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


@contextlib.contextmanager
def at_most_one_try():
    """MLflow's client without its retries (minutes, by default) inside the block: for readers that go over every
    tracking server a team ever used (`gpuflow status`, the reconciler's pass), one that is down is skipped at once."""
    saved = {name: os.environ.get(name) for name in ONE_TRY}
    os.environ.update(ONE_TRY)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
