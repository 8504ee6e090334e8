"""A secret reaches the training loop and nothing else: not MLflow, not Prefect, not a log file."""

import asyncio
import hashlib
import json
import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from gpuflow.cluster.cost.budget import active_reservations
from gpuflow.flows.experiment import run_experiment
from tests.support.processes import processes_of
from tests.support.repo import A_LOOP
from tests.support.runs import flow_logs, mlflow_run_of


def prefect_artifacts(flow_run_id) -> str:
    async def read():
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
            return [artifact.model_dump_json() for artifact in found]

    return "\n".join(asyncio.run(read()))


def prefect_flow_run(flow_run_id) -> str:
    async def read():
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).model_dump_json()

    return asyncio.run(read())


def files_holding(folder, needle: bytes) -> list[str]:
    return [str(path) for path in folder.rglob("*") if path.is_file() and needle in path.read_bytes()]


@pytest.mark.full
def test_canary_secret_appears_nowhere(prefect_server, digits_spec, gpuflow_home, monkeypatch, tmp_path, capfd, caplog):
    caplog.set_level("INFO")
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("CANARY_API_TOKEN", canary)
    monkeypatch.setenv("GPUFLOW_DAILY_BUDGET_USD", "100")  # the run reserves, then settles, its budget too
    spec = digits_spec.model_copy(
        update={
            "train": digits_spec.train.model_copy(update={"loop": "tests.loops.canary:train_loop", "epochs": 1}),
            "compute": digits_spec.compute.model_copy(update={"workers_per_node": 1, "num_workers": 1}),
            "limits": digits_spec.limits.model_copy(update={"hourly_rate_usd": 1.0}),
            "envs": {"CANARY_SHA256": hashlib.sha256(canary.encode()).hexdigest()},
            "secrets": ["CANARY_API_TOKEN"],
        }
    )
    state = run_experiment(spec, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    assert state.is_completed(), state.message  # so the loop saw the secret (it fails otherwise)

    # MLflow: params, tags, metrics and every artifact of the run
    client, run = mlflow_run_of(spec.tracking_uri, flow_run_id, spec.experiment_name)
    assert canary not in json.dumps({**run.data.params, **run.data.tags, **run.data.metrics})
    artifacts = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    assert (tmp_path / "artifacts" / "spec.yaml").is_file()
    assert files_holding(tmp_path / "artifacts", canary.encode()) == []
    assert artifacts

    # Prefect: the flow run (parameters, state), its logs and its artifacts, through the API
    assert "CANARY_API_TOKEN" in prefect_flow_run(flow_run_id)  # the name is there: the search reads real data
    assert canary not in prefect_flow_run(flow_run_id)
    assert "val_accuracy" in flow_logs(flow_run_id) and canary not in flow_logs(flow_run_id)
    assert "MLflow run" in prefect_artifacts(flow_run_id) and canary not in prefect_artifacts(flow_run_id)

    # the run's log output (the job's lines, relayed while it ran: its log file goes with the cluster) and
    # every file the run left: the MLflow store, checkpoints, data
    printed = caplog.text + "".join(capfd.readouterr())
    assert "[gpuflow] epoch 0" in printed and canary not in printed
    assert (gpuflow_home / "mlflow.db").is_file() and any((gpuflow_home / "checkpoints").rglob("*"))
    assert files_holding(gpuflow_home, canary.encode()) == []

    # the daily-budget reservation gave way to the real cost; nothing is left running
    assert active_reservations(spec.tracking_uri, since=0) == []
    assert run.data.metrics["cost_usd"] > 0
    assert processes_of(gpuflow_home) == []


def test_mlflow_credentials_travel_to_the_cluster_as_secrets(monkeypatch):
    """A team's MLflow server wants credentials on the cluster too: they go as SkyPilot secrets, redacted in plans."""
    from gpuflow.cluster.backends.skypilot import build_task, task_yaml
    from gpuflow.cluster.spec import parse_spec
    from tests.test_skypilot import gpu_spec

    monkeypatch.setenv("HF_TOKEN", "hf_value")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "canary-mlflow-password")
    task = build_task(gpu_spec(), run_name="digits-gpu-2026")
    secrets = {
        name: getattr(value, "get_secret_value", lambda value=value: value)() for name, value in task.secrets.items()
    }
    assert secrets == {
        "HF_TOKEN": "hf_value",
        "MLFLOW_TRACKING_USERNAME": "alice",
        "MLFLOW_TRACKING_PASSWORD": "canary-mlflow-password",
    }
    assert not any("MLFLOW_TRACKING_PASSWORD" in key for key in task.envs)
    assert "canary-mlflow-password" not in task_yaml(gpu_spec())
    local = parse_spec(A_LOOP)  # a local store needs no credentials: none are passed
    assert "MLFLOW_TRACKING_PASSWORD" not in (
        build_task(
            local.model_copy(update={"compute": local.compute.model_copy(update={"backend": "skypilot"})})
        ).secrets
        or {}
    )
