"""gpuflow against a real `mlflow server` with proxied artifacts: the scheduled run's MLflow side, linked both ways.

.venv/bin/python -m pytest --full tests/test_tracking_server.py
"""

import urllib.request

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

pytestmark = pytest.mark.full


def the_mlflow_run(served, flow_run):
    client = MlflowClient(served.mlflow_url)
    experiment = client.get_experiment_by_name("digits-mlp")
    runs = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
    assert len(runs) == 1, runs
    return client, experiment, runs[0]


def test_the_run_is_tracked_on_the_server_with_proxied_artifacts(served, scheduled_run):
    client, experiment, run = the_mlflow_run(served, scheduled_run)
    assert run.info.status == "FINISHED"
    # a server's own artifact store, not a file path of the flow's machine
    assert experiment.artifact_location.startswith("mlflow-artifacts:")
    spec_yaml = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="spec.yaml", tracking_uri=served.mlflow_url
    )
    assert yaml.safe_load(open(spec_yaml))["train"]["epochs"] == 2
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert [m.step for m in history] == [0, 1] and history[-1].value > 0.5


def test_system_metrics_come_from_the_job(served, scheduled_run):
    _, _, run = the_mlflow_run(served, scheduled_run)
    system = {key for key in run.data.metrics if key.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system, system


def test_the_model_is_registered_as_a_version_of_the_spec_name(served, scheduled_run):
    client, _, run = the_mlflow_run(served, scheduled_run)
    versions = client.search_model_versions(f"run_id = '{run.info.run_id}'")
    assert [v.name for v in versions] == ["digits-mlp"]
    assert run.data.tags["gpuflow.registered_model"] == f"digits-mlp/{versions[0].version}"


def test_the_mlflow_run_links_to_the_prefect_run(served, scheduled_run):
    _, _, run = the_mlflow_run(served, scheduled_run)
    tags = run.data.tags
    assert tags["prefect.flow_run_name"] == scheduled_run.name == run.info.run_name
    assert tags["prefect.deployment"] == "nightly-digits"
    url = tags["prefect.flow_run_url"]
    assert url == f"{served.ui_url}/runs/flow-run/{scheduled_run.id}"
    page = urllib.request.Request(url, headers={"Accept": "text/html"})  # as a browser asks for it
    with urllib.request.urlopen(page, timeout=30) as response:  # a wrong path is a 404 from Prefect's server
        assert response.status == 200
