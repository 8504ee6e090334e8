"""The team stack: Prefect and MLflow servers on PostgreSQL, both behind authentication, runs end to end and under load.

    .venv/bin/python -m pytest --full tests/test_team_stack.py -s      # -s prints the load figures
"""

import base64
import contextlib
import os
import time
import urllib.error
import urllib.request

import psycopg2
import pytest
from mlflow import MlflowClient

from gpuflow.cluster.backends.local import LocalBackend
from tests.conftest import REPO, processes_of
from tests.infra.postgres import harness
from tests.servers import BIN, READY_TIMEOUT_S, base_env, started
from tests.team_stack import MLFLOW_ADMIN, TeamStack, team_stack, wait_until_final
from tests.tiers import require

pytestmark = pytest.mark.team

# In the suite the load test checks the stack, not its speed: one run more than `gpuflow serve --limit` lets through,
# so that one waits in the queue and takes the slot that frees. For the throughput figure (~20 minutes here):
# GPUFLOW_LOAD_LIMIT=3 GPUFLOW_LOAD_RUNS=20.
LOAD_LIMIT = int(os.environ.get("GPUFLOW_LOAD_LIMIT", "1"))
LOAD_RUNS = int(os.environ.get("GPUFLOW_LOAD_RUNS", str(LOAD_LIMIT + 1)))


@pytest.fixture(scope="module")
def stack():
    ok, why = harness.available()
    require(ok, f"PostgreSQL ({why})", "apt-get install postgresql, as root (tests/infra/postgres)")
    with team_stack() as running:
        yield running


def status_of(url: str, auth: str | None = None, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_requests_without_the_credentials_are_refused(stack):
    flows = f"{stack.api_url}/flows/filter"
    assert status_of(flows, data=b"{}") == 401
    assert status_of(flows, auth="admin:wrong", data=b"{}") == 401
    assert status_of(flows, auth=stack.prefect_auth, data=b"{}") == 200

    experiments = f"{stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert status_of(experiments) == 401
    assert status_of(experiments, auth=f"{MLFLOW_ADMIN}:wrong") == 401
    assert status_of(experiments, auth=f"{MLFLOW_ADMIN}:{stack.mlflow_password}") == 200


@contextlib.contextmanager
def serving(stack: TeamStack, home, limit: int):
    """`gpuflow serve --only run-experiment` as a worker of the team would run it: credentials in its environment,
    the MLflow ones passed on to the cluster as secrets."""
    home.mkdir(parents=True, exist_ok=True)
    from experiments.digits import write_parquet

    write_parquet(str(home / "data" / "train.parquet"), str(home / "data" / "validation.parquet"))  # once, not per run
    overrides = [f"tracking.uri={stack.mlflow_url}", f"workdir={REPO}", f"data.train={home}/data/train.parquet",
                 f"data.validation={home}/data/validation.parquet", "data.generate=null",
                 "secrets=[MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD]"]
    env = base_env(**stack.client_env(), GPUFLOW_HOME=str(home), PREFECT_RUNNER_POLL_FREQUENCY="1")
    command = [str(BIN / "gpuflow"), "serve", "--only", "run-experiment", "--limit", str(limit),
               *[f"--set={item}" for item in overrides]]
    try:
        with started(command, home / "serve.log", env) as process:
            deadline = time.monotonic() + READY_TIMEOUT_S
            with stack.prefect_client() as client:
                while not [d for d in client.read_deployments() if d.name == "run-experiment"]:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"gpuflow serve did not register:\n{(home / 'serve.log').read_text()[-3000:]}")
                    time.sleep(0.5)
            yield process
    finally:
        # Stopping the runner SIGKILLs flow runs still going (no `finally`): down what they left, as the reaper would.
        backend = LocalBackend(home / "clusters")
        for cluster in backend.status():
            backend.down(cluster.name)


# The load is on the stack (servers, serve, clusters, tracking), not on training: two tiny epochs of a loop that
# reads no data, each with a checkpoint, spare each run Ray Data's start-up (five actors, ~16 s of CPU here).
TINY_EPOCHS = {"loop": "tests.loops.plain:epochs_with_checkpoints", "epochs": 2, "params": {"offset": 0.0}}


def submit(stack: TeamStack, count: int, train: dict, **sections) -> list:
    """`count` runs of the run-experiment form, its train section changed as given (the form policy allows it)."""
    with stack.prefect_client() as client:
        deployment = client.read_deployment_by_name("run-experiment/run-experiment")
        spec = deployment.parameters["spec"]
        spec = {**spec, "train": {**spec["train"], **train}, "compute": {**spec["compute"], "workers_per_node": 1},
                **sections}
        spec["compute"].pop("num_workers", None)
        return [client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec}).id
                for _ in range(count)]


def mlflow_runs(stack: TeamStack, flow_run_ids) -> dict:
    client = MlflowClient(stack.mlflow_url)
    ids = {str(run_id) for run_id in flow_run_ids}
    experiments = [e.experiment_id for e in client.search_experiments()]
    return {run.data.tags["prefect.flow_run_id"]: run
            for run in client.search_runs(experiments, max_results=1000)
            if run.data.tags.get("prefect.flow_run_id") in ids}


@pytest.fixture
def mlflow_credentials(stack, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", stack.mlflow_password)


def test_an_authenticated_run_works_end_to_end_on_postgres(stack, mlflow_credentials, tmp_path):
    home = stack.home / "served-one"
    with serving(stack, home, limit=1):
        [flow_run_id] = submit(stack, 1, train={"epochs": 1})
        [flow_run] = wait_until_final(stack, [flow_run_id], log=home / "serve.log")
    assert flow_run.state.is_completed(), flow_run.state.message
    run = mlflow_runs(stack, [flow_run_id])[str(flow_run_id)]
    assert run.info.status == "FINISHED" and run.data.metrics["val_accuracy"] > 0.5

    # both servers keep it in PostgreSQL, not in a file of their own
    with psycopg2.connect(stack.postgres.url("mlflow")) as db, db.cursor() as cursor:
        cursor.execute("select status from runs where run_uuid = %s", (run.info.run_id,))
        assert cursor.fetchone() == ("FINISHED",)
    with psycopg2.connect(stack.postgres.url("prefect")) as db, db.cursor() as cursor:
        cursor.execute("select state_type from flow_run where id = %s", (str(flow_run_id),))
        assert cursor.fetchone() == ("COMPLETED",)
    assert processes_of(home) == [] and not any((home / "clusters").glob("*/*"))


@pytest.mark.load
@pytest.mark.timeout(4 * 3600)  # GPUFLOW_LOAD_RUNS=20 runs for a long while
def test_runs_submitted_at_once_all_complete(stack, mlflow_credentials):
    home = stack.home / "served-load"
    with serving(stack, home, limit=LOAD_LIMIT):
        started_at = time.monotonic()
        flow_run_ids = submit(stack, LOAD_RUNS, train=TINY_EPOCHS, data=None)
        flow_runs = wait_until_final(stack, flow_run_ids, timeout_s=3600, log=home / "serve.log")
        wall_s = time.monotonic() - started_at
    states = sorted(run.state_name for run in flow_runs)
    print(f"\n[load] {LOAD_RUNS} runs, limit {LOAD_LIMIT}: {wall_s:.0f} s wall, "
          f"{LOAD_RUNS / wall_s * 60:.2f} runs/minute; states {set(states)}")
    assert states == ["Completed"] * LOAD_RUNS, [run.state.message for run in flow_runs if not run.state.is_completed()]
    runs = mlflow_runs(stack, flow_run_ids)
    assert sorted(run.info.status for run in runs.values()) == ["FINISHED"] * LOAD_RUNS
    assert processes_of(home) == [] and not any((home / "clusters").glob("*/*"))
