"""A flow run read back as a user sees it: its Prefect logs and progress bars, its MLflow run."""

import asyncio


def flow_logs(flow_run_id) -> str:
    """Every log line of the flow run, as the Prefect UI shows them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # logs reach the API in batches

    async def read():
        lines, offset = [], 0
        async with get_client() as client:
            while True:
                page = await client.read_logs(
                    LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=offset
                )
                lines += [log.message for log in page]
                offset += len(page)
                if len(page) < 200:
                    return "\n".join(lines)

    return asyncio.run(read())


def task_runs(flow_run_id, name: str) -> list:
    """The flow run's task runs called `name` (provision, train, ...), in the order they ran."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        )


def progress_bars(flow_run_id) -> list[float]:
    """The values of the flow run's progress artifacts, as the Prefect UI shows them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        return [
            artifact.data
            for artifact in client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"])
                )
            )
        ]


def mlflow_runs_of(tracking_uri: str, flow_run_id, experiment: str | None = None):
    """(client, the MLflow runs of the flow run: a sweep's parent and trials too), found as gpuflow finds them
    (runs_of_flow_run: by the flow-run tag, in `experiment` or in every active experiment)."""
    from mlflow import MlflowClient

    from gpuflow.cluster.run.mlflow_run import runs_of_flow_run

    client = MlflowClient(tracking_uri)
    return client, runs_of_flow_run(client, str(flow_run_id), experiment)


def mlflow_run_of(tracking_uri: str, flow_run_id, experiment: str | None = None):
    """(client, the flow run's one MLflow run): a sweep's parent run, not its trials (they carry the same tag)."""
    client, runs = mlflow_runs_of(tracking_uri, flow_run_id, experiment)
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    assert len(parents) == 1, f"flow run {flow_run_id}: {len(parents)} MLflow runs (not one) in {tracking_uri}"
    return client, parents[0]
