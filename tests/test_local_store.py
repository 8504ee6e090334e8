"""Runs started together on a fresh GPUFLOW_HOME share one local MLflow store: one of them makes it, none fails."""

import subprocess
import sys

from tests.support.repo import REPO

OPEN_AND_LOG = """
import sys
from mlflow import MlflowClient
from gpuflow.cluster.util.local_store import ready_local_store
uri = sys.argv[1]
ready_local_store(uri)
client = MlflowClient(uri)
experiment = client.get_experiment_by_name("together") or client.get_experiment(client.create_experiment("together"))
run = client.create_run(experiment.experiment_id)
client.log_metric(run.info.run_id, "one", 1.0)
"""


def test_runs_started_at_once_on_a_fresh_store_all_track(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    starts = [
        subprocess.Popen([sys.executable, "-c", OPEN_AND_LOG, uri], cwd=REPO, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [start.communicate(timeout=180)[1] for start in starts]
    assert [start.returncode for start in starts] == [0] * 4, "\n".join(error[-600:] for error in errors)
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("together").experiment_id])
    assert sorted(run.data.metrics["one"] for run in runs) == [1.0] * 4
