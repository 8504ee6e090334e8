"""The team stack: Prefect and MLflow servers on PostgreSQL, both behind authentication, runs end to end and under load.

.venv/bin/python -m pytest --full tests/test_team_stack.py -s      # -s prints the load figures
"""

import base64
import contextlib
import os
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg2
import pytest
from mlflow import MlflowClient

from gpuflow.cluster.backends.local import LocalBackend
from tests.infra.postgres import harness
from tests.loops import PLAIN_LOOP
from tests.support.processes import processes_of, wait_until
from tests.support.repo import REPO
from tests.support.servers import BIN, READY_TIMEOUT_S, base_env, started
from tests.support.team_stack import MLFLOW_ADMIN, TeamStack, team_stack, wait_until_final
from tests.support.tiers import require
from tests.test_faults import checkpoints_under

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

    # a gpuflow command with a wrong credential says which, in a line, not in a traceback
    env = base_env(**{**stack.client_env(), "PREFECT_API_AUTH_STRING": "admin:wrong"}, GPUFLOW_HOME=str(stack.home))
    status = subprocess.run([str(BIN / "gpuflow"), "status"], capture_output=True, text=True, env=env, timeout=120)
    assert status.returncode == 2 and "Traceback" not in status.stderr, status.stderr
    assert "refused this machine's credential (401): set PREFECT_API_AUTH_STRING" in status.stderr, status.stderr

    experiments = f"{stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert status_of(experiments) == 401
    assert status_of(experiments, auth=f"{MLFLOW_ADMIN}:wrong") == 401
    assert status_of(experiments, auth=f"{MLFLOW_ADMIN}:{stack.mlflow_password}") == 200


@contextlib.contextmanager
def serving(
    stack: TeamStack,
    home,
    limit: int,
    user: tuple[str, str] | None = None,
    only: tuple[str, ...] = ("run-experiment",),
    down_what_is_left: bool = True,
):
    """`gpuflow serve --only run-experiment` as a worker of the team would run it: credentials in its environment
    (the admin's, or `user`'s), the MLflow ones passed on to the cluster as secrets."""
    home.mkdir(parents=True, exist_ok=True)
    from experiments.digits import write_parquet

    write_parquet(str(home / "data" / "train.parquet"), str(home / "data" / "validation.parquet"))  # once, not per run
    overrides = [
        f"tracking.uri={stack.mlflow_url}",
        f"workdir={REPO}",
        f"data.train={home}/data/train.parquet",
        f"data.validation={home}/data/validation.parquet",
        "data.generate=null",
        "secrets=[MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD]",
    ]
    credentials = {"MLFLOW_TRACKING_USERNAME": user[0], "MLFLOW_TRACKING_PASSWORD": user[1]} if user else {}
    env = base_env(**{**stack.client_env(), **credentials}, GPUFLOW_HOME=str(home), PREFECT_RUNNER_POLL_FREQUENCY="1")
    command = [
        str(BIN / "gpuflow"),
        "serve",
        *[f"--only={name}" for name in only],
        "--limit",
        str(limit),
        *[f"--set={item}" for item in overrides],
    ]
    try:
        with started(command, home / "serve.log", env) as process:
            deadline = time.monotonic() + READY_TIMEOUT_S
            with stack.prefect_client() as client:
                while not set(only) <= {d.name for d in client.read_deployments()}:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"gpuflow serve did not register:\n{(home / 'serve.log').read_text()[-3000:]}"
                        )
                    time.sleep(0.5)
            yield process
    finally:
        # Stopping the runner SIGKILLs flow runs still going (no `finally`): down what they left, as the reaper would.
        backend = LocalBackend(home / "clusters")
        for cluster in backend.status() if down_what_is_left else ():
            backend.down(cluster.name)


@contextlib.contextmanager
def as_user(name: str, password: str):
    """MLflow's client (and gpuflow's checks) send these credentials inside the block."""
    previous = {key: os.environ.get(key) for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(MLFLOW_TRACKING_USERNAME=name, MLFLOW_TRACKING_PASSWORD=password)
    try:
        yield
    finally:
        for key, value in previous.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


@pytest.fixture(scope="module")
def users(stack) -> dict[str, str]:
    """Three members of the team, none an admin, created by the admin: name → password."""
    from mlflow.server.auth.client import AuthServiceClient

    made = {name: secrets.token_hex(8) for name in ("alice", "bob", "carol")}
    with as_user(MLFLOW_ADMIN, stack.mlflow_password):
        for name, password in made.items():
            AuthServiceClient(stack.mlflow_url).create_user(name, password)
    return made


def gpuflow_command(stack: TeamStack, *args: str, user: tuple[str, str]) -> subprocess.CompletedProcess:
    """A gpuflow command on the digits spec as a team member runs it, tracking to the team's server."""
    env = base_env(
        **{**stack.client_env(), "MLFLOW_TRACKING_USERNAME": user[0], "MLFLOW_TRACKING_PASSWORD": user[1]},
        GPUFLOW_HOME=str(stack.home / f"cli-{user[0]}"),
    )
    return subprocess.run(
        [str(BIN / "gpuflow"), *args, "experiments/digits.yaml", f"--set=tracking.uri={stack.mlflow_url}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


# The load is on the stack (servers, serve, clusters, tracking), not on training: two tiny epochs of a loop that
# reads no data, each with a checkpoint, spare each run Ray Data's start-up (five actors, ~16 s of CPU here).
TINY_EPOCHS = {"loop": PLAIN_LOOP, "epochs": 2, "params": {"offset": 0.0}}


def submit(stack: TeamStack, count: int, train: dict, **sections) -> list:
    """`count` runs of the run-experiment form, its train section changed as given (the form policy allows it)."""
    with stack.prefect_client() as client:
        deployment = client.read_deployment_by_name("run-experiment/run-experiment")
        spec = deployment.parameters["spec"]
        spec = {
            **spec,
            "train": {**spec["train"], **train},
            "compute": {**spec["compute"], "workers_per_node": 1},
            **sections,
        }
        spec["compute"].pop("num_workers", None)
        return [
            client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec}).id for _ in range(count)
        ]


def mlflow_runs(stack: TeamStack, flow_run_ids) -> dict:
    """flow run id → its MLflow run, read as the admin."""
    ids = {str(run_id) for run_id in flow_run_ids}
    with as_user(MLFLOW_ADMIN, stack.mlflow_password):
        client = MlflowClient(stack.mlflow_url)
        experiments = [e.experiment_id for e in client.search_experiments()]
        return {
            run.data.tags["prefect.flow_run_id"]: run
            for run in client.search_runs(experiments, max_results=1000)
            if run.data.tags.get("prefect.flow_run_id") in ids
        }


@pytest.fixture
def mlflow_credentials(stack, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", stack.mlflow_password)


@pytest.fixture(scope="module")
def first_run(stack, users):
    """Alice, the first of the team to run: through the served deployment, as herself. It creates the experiment and
    the registered model, which she then manages."""
    home = stack.home / "served-alice"
    with serving(stack, home, limit=1, user=("alice", users["alice"])):
        [flow_run_id] = submit(stack, 1, train={"epochs": 1})
        [flow_run] = wait_until_final(stack, [flow_run_id], log=home / "serve.log")
    assert processes_of(home) == [] and not any((home / "clusters").glob("*/*"))
    return flow_run, mlflow_runs(stack, [flow_run_id]).get(str(flow_run_id))


def test_an_authenticated_run_works_end_to_end_on_postgres(stack, first_run):
    flow_run, run = first_run
    assert flow_run.state.is_completed(), flow_run.state.message
    assert run.info.status == "FINISHED" and run.data.metrics["val_accuracy"] > 0.5
    assert run.data.tags["mlflow.user"] == "alice"  # who ran it, not `unknown`

    # both servers keep it in PostgreSQL, not in a file of their own
    with psycopg2.connect(stack.postgres.url("mlflow")) as db, db.cursor() as cursor:
        cursor.execute("select status from runs where run_uuid = %s", (run.info.run_id,))
        assert cursor.fetchone() == ("FINISHED",)
    with psycopg2.connect(stack.postgres.url("prefect")) as db, db.cursor() as cursor:
        cursor.execute("select state_type from flow_run where id = %s", (str(flow_run.id),))
        assert cursor.fetchone() == ("COMPLETED",)


def test_an_unknown_user_is_refused_before_anything_starts(stack):
    result = gpuflow_command(stack, "validate", user=("mallory", "anything"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refused user 'mallory' (401)" in result.stderr and "MLFLOW_TRACKING_USERNAME" in result.stderr
    assert "credentials refused (the spec is fine)" in result.stderr and "invalid experiment spec" not in result.stderr


def test_a_wrong_password_is_refused_before_anything_starts(stack, users):
    result = gpuflow_command(stack, "validate", user=("alice", "not-her-password"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refused user 'alice' (401)" in result.stderr and "MLFLOW_TRACKING_PASSWORD" in result.stderr
    assert gpuflow_command(stack, "validate", user=("alice", users["alice"])).returncode == 0


def test_a_user_without_edit_on_the_experiment_is_refused_naming_the_fix(stack, users, first_run):
    result = gpuflow_command(stack, "validate", user=("carol", users["carol"]))
    assert result.returncode == 2, result.stdout + result.stderr
    for wanted in (
        "permission refused (the spec is fine)",
        "tracking.experiment: MLflow user 'carol' has READ on experiment 'digits-mlp'",
        "name: MLflow user 'carol' has READ on registered model 'digits-mlp'",
        "gpuflow share SPEC --user carol",
    ):
        assert wanted in result.stderr, result.stderr


def test_a_teammate_runs_and_registers_a_version_once_shared(stack, users, first_run):
    """`gpuflow share` grants all or nothing (an unknown user among them: nothing, naming them), and again is fine."""
    alice = ("alice", users["alice"])
    refused = gpuflow_command(stack, "share", "--user", "bob", "--user", "nobody-here", user=alice)
    assert refused.returncode == 1 and "nobody-here" in refused.stderr, (refused.stdout, refused.stderr)
    for _ in range(2):
        shared = gpuflow_command(stack, "share", "--user", "bob", user=alice)
        assert shared.returncode == 0 and "bob: EDIT on experiment 'digits-mlp'" in shared.stdout, shared.stderr
    home = stack.home / "served-bob"
    with serving(stack, home, limit=1, user=("bob", users["bob"])):
        [flow_run_id] = submit(stack, 1, train={"epochs": 1})
        [flow_run] = wait_until_final(stack, [flow_run_id], log=home / "serve.log")
    assert flow_run.state.is_completed(), flow_run.state.message
    run = mlflow_runs(stack, [flow_run_id])[str(flow_run_id)]
    assert run.data.tags["mlflow.user"] == "bob" and first_run[1].data.tags["mlflow.user"] == "alice"
    with as_user(MLFLOW_ADMIN, stack.mlflow_password):
        versions = MlflowClient(stack.mlflow_url).search_model_versions("name = 'digits-mlp'")
    assert {v.run_id for v in versions} >= {first_run[1].info.run_id, run.info.run_id}
    assert processes_of(home) == []


def test_a_deployment_run_starts_only_for_verified_credentials_and_records_that_user(stack, users, first_run):
    """`gpuflow run --deployment`: the team's MLflow server checks who the caller is and that they may write the
    run's experiment before anything is triggered; the run is recorded as the user the server verified."""
    from gpuflow.cluster.protocol import triggered_by

    def trigger_as(name: str, password: str) -> subprocess.CompletedProcess:
        env = base_env(
            **{**stack.client_env(), "MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": password},
            GPUFLOW_HOME=str(stack.home / f"cli-{name}"),
        )
        command = [str(BIN / "gpuflow"), "run", "--deployment", "run-experiment/run-experiment"]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)

    with stack.prefect_client() as client:
        before = {run.id for run in client.read_flow_runs()}
    for (name, password), refusal in (
        (("alice", "not-her-password"), "refused user 'alice' (401)"),
        (("mallory", "anything"), "refused user 'mallory' (401)"),
        (("carol", users["carol"]), "MLflow user 'carol' has READ on experiment 'digits-mlp'"),
    ):
        refused = trigger_as(name, password)
        assert refused.returncode == 2 and refusal in refused.stderr, refused.stdout + refused.stderr
    with stack.prefect_client() as client:
        assert {run.id for run in client.read_flow_runs()} == before, "a refused caller triggered a run"
    started = trigger_as("alice", users["alice"])
    assert started.returncode == 0 and "triggered by alice" in started.stdout, started.stdout + started.stderr
    with stack.prefect_client() as client:
        [run] = [run for run in client.read_flow_runs() if run.id not in before]
        client.delete_flow_run(run.id)  # nothing serves it here: no run left scheduled
    assert triggered_by(run.tags) == "alice"


def test_a_serve_stopped_mid_run_is_crashed_by_the_next_reaper_pass(stack, mlflow_credentials):
    """The runner's machine goes (SIGTERM): the runner exits without cancelling its runs (Prefect 3.8: its SIGTERM
    handler never awaits `astop`) and its flow's process dies with it, no finally, no hook. The cluster goes with
    its owner, the job ends its own run as orphaned, and the reaper another machine serves, run as its schedule runs
    it (default parameters), finds the team's server and marks the flow run Crashed."""
    home = stack.home / "served-stopped"
    # a paced loop of Ray Train alone, no data: the runner's end is the point, not what trains
    paced = {"loop": PLAIN_LOOP, "epochs": 400, "params": {"offset": 0.0, "pace_s": 1.0}}
    with serving(stack, home, limit=1, down_what_is_left=False) as runner:
        [flow_run_id] = submit(
            stack, 1, train=paced, data=None, limits={"max_runtime_minutes": 15, "orphan_grace_minutes": 0.2}
        )
        wait_until(
            lambda: [r for r in mlflow_runs(stack, [flow_run_id]).values() if "loss" in r.data.metrics],
            300,
            "training",
            interval_s=1,
        )
        runner.send_signal(signal.SIGTERM)
        runner.wait(90)
        try:
            wait_until(
                lambda: mlflow_runs(stack, [flow_run_id])[str(flow_run_id)].info.status != "RUNNING",
                180,
                "the job ending its run",
                interval_s=1,
            )
        except AssertionError as error:  # what the job and its cluster said last
            raise AssertionError(f"{error}\n{cluster_logs(home / 'clusters')}") from None
        # the reaper another machine serves, up once the runner went (the runner's group is stopped at the end)
        with serving(stack, stack.home / "served-reaper", limit=1, only=("reap-clusters",)):
            with stack.prefect_client() as client:
                assert client.read_flow_run(flow_run_id).state.is_running()  # nothing else updates a dead runner's run
                reaper = client.read_deployment_by_name("reap-clusters/reap-clusters")
                reaper_run = client.create_flow_run_from_deployment(reaper.id).id  # its parameters as the schedule's
            [reaped] = wait_until_final(stack, [reaper_run], log=stack.home / "served-reaper" / "serve.log")
    assert reaped.state.is_completed(), reaped.state.message
    with stack.prefect_client() as client:
        assert client.read_flow_run(flow_run_id).state.is_crashed()
    run = mlflow_runs(stack, [flow_run_id])[str(flow_run_id)]
    assert (run.info.status, run.data.tags["stopped_by"]) == ("FAILED", "orphaned")
    wait_until(lambda: processes_of(home) == [], 120, "the stopped serve's cluster gone", interval_s=1)
    assert checkpoints_under(home, "state.json"), "the checkpoints made before the runner went are kept"


def cluster_logs(clusters: Path, tail: int = 3000) -> str:
    return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-tail:]}" for log in sorted(clusters.rglob("*.log")))


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
    print(
        f"\n[load] {LOAD_RUNS} runs, limit {LOAD_LIMIT}: {wall_s:.0f} s wall, "
        f"{LOAD_RUNS / wall_s * 60:.2f} runs/minute; states {set(states)}"
    )
    assert states == ["Completed"] * LOAD_RUNS, [run.state.message for run in flow_runs if not run.state.is_completed()]
    runs = mlflow_runs(stack, flow_run_ids)
    assert sorted(run.info.status for run in runs.values()) == ["FINISHED"] * LOAD_RUNS
    assert processes_of(home) == [] and not any((home / "clusters").glob("*/*"))
