"""A failing loop end to end under a real Prefect API, and the helpers that read a run back (Prefect logs, the MLflow
run, the progress bar); the quickstart's own run is in tests/test_digits_run.py."""

import pytest
import asyncio
from pathlib import Path

import torch
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

from gpuflow.flows.experiment import run_experiment
from tests.conftest import processes_of


def flow_logs(flow_run_id) -> str:
    """Every log line of the flow run, as the Prefect UI shows them."""
    APILogWorker.drain_all(timeout=10)  # logs reach the API in batches

    async def read():
        lines, offset = [], 0
        async with get_client() as client:
            while True:
                page = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                              limit=200, offset=offset)
                lines += [log.message for log in page]
                offset += len(page)
                if len(page) < 200:
                    return "\n".join(lines)
    return asyncio.run(read())


def mlflow_run_of(spec, flow_run_id):
    client = MlflowClient(spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    [run] = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    return client, run


def progress_bars(flow_run_id) -> list[float]:
    """The values of the flow run's progress artifacts, as the Prefect UI shows them."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        return [artifact.data for artifact in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"])))]


@pytest.mark.full
def test_a_failing_loop_fails_everything_and_keeps_checkpoints(prefect_server, digits_spec, gpuflow_home):
    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.notify import add_webhook
    from tests.servers import the_one_message, webhook_receiver

    spec = digits_spec.model_copy(update={"train": digits_spec.train.model_copy(update={
        "epochs": 4, "params": {**digits_spec.train.params, "fail_at_epoch": 2}})})
    with webhook_receiver() as (url, messages):
        add_webhook("failures", url)
        state = run_experiment(spec.model_copy(update={"notify": NotifySpec(block="failures")}), return_state=True)
        flow_run_id = state.state_details.flow_run_id
        assert state.is_failed()

        _, run = mlflow_run_of(spec, flow_run_id)
        message = the_one_message(messages, "failed", run.info.run_id, str(flow_run_id))
    assert "fail_at_epoch=2: failing on purpose" in message["reason"], message
    assert run.info.status == "FAILED"
    logs = flow_logs(flow_run_id)
    assert "Traceback" in logs and "fail_at_epoch=2: failing on purpose" in logs

    storage = Path(run.data.tags["gpuflow.checkpoints"])
    assert storage.parent == Path(spec.checkpoint_uri)
    saved = sorted(storage.glob("checkpoint_*/checkpoint.pt"))
    assert [torch.load(path, weights_only=False)["epoch"] for path in saved] == [0, 1]
    assert processes_of(gpuflow_home) == []
