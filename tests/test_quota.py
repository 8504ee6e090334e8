"""The team's GPU quota on Prefect's global concurrency limits: runs over it wait their turn, in the order they
were submitted, and a run that dies gives its share back once its cluster is gone.

    .venv/bin/python -m pytest --full tests/test_quota.py

On the local backend the quota's unit is the worker: each run here has one, so `gpuflow quota set local 2` lets
two runs hold it at once. Runs go through a served deployment of a Prefect server of the test's own.
"""

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

from gpuflow.cluster.backends import cluster_name_for
from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.flows.quota import LIMIT_PREFIX, WAITING
from tests.support.repo import REPO
from tests.support.processes import processes_of
from tests.loops import PLAIN_LOOP
from tests.support.servers import BIN, base_env, gpuflow_serve, prefect_server
from tests.support.processes import wait_until
from tests.support.tiers import carrying



def test_a_run_needs_its_clusters_gpus_of_its_pool():
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.flows.quota import lease_seconds, need_of

    loop = {"loop": "experiments.digits:train_loop"}
    remote = {"tracking": {"uri": "http://mlflow.team:5000"}, "storage": {"checkpoints": "s3://team/checkpoints"}}
    local = parse_spec({"train": loop, "compute": {"workers_per_node": 3}})
    assert (need_of(local).pool, need_of(local).slots, need_of(local).describe()) == \
        ("local", 3, "3 workers of quota 'local'")
    cloud = parse_spec({"train": loop, "compute": {"backend": "skypilot", "num_nodes": 2, "accelerators": "H100:8",
                                                   "cloud": "aws"}, "limits": {"orphan_grace_minutes": 2}, **remote})
    assert (need_of(cloud).pool, need_of(cloud).slots, need_of(cloud).unit) == ("aws-h100", 16, "GPU")
    named = parse_spec({"train": loop, "compute": {"backend": "skypilot", "accelerators": ["A100:4", "H100:1"],
                                                   "infra": "slurm/skyci", "quota": "team-a100"}, **remote})
    assert (need_of(named).pool, need_of(named).slots) == ("team-a100", 4)
    options = parse_spec({"train": loop, "compute": {"backend": "skypilot", "options": [  # the first option's pool
        {"infra": "k8s/ctx", "accelerators": "L4:2"}, {"cloud": "aws", "accelerators": "H100:1"}]}, **remote})
    assert (need_of(options).pool, need_of(options).slots) == ("k8s-l4", 2)
    assert lease_seconds(cloud) == 150 and lease_seconds(parse_spec(
        {"train": loop, "limits": {"orphan_grace_minutes": 0.2}})) == 60  # Prefect's shortest lease


@contextlib.contextmanager
def served_with_quota(tmp_path, size: int, grace_minutes: float = 2):
    """A Prefect server, `gpuflow quota set local SIZE` on it, and `gpuflow serve --limit 5` of run-experiment."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "served"
    # a plain Ray Train loop, no data: the queue is the point, not what trains (an epoch a second, a checkpoint each)
    overrides = [f"workdir={REPO}", f"train.loop={PLAIN_LOOP}", "train.epochs=4", "train.params={offset: 0, pace_s: 1}",
                 "compute.workers_per_node=1", f"limits.orphan_grace_minutes={grace_minutes}",
                 "tracking.register_model=false", "data=null"]
    with prefect_server(tmp_path / "prefect") as api_url, temporary_settings({PREFECT_API_URL: api_url}):
        quota = gpuflow("quota", "set", "local", str(size), api_url=api_url, home=home)
        assert quota.returncode == 0 and f"quota local: {size} at once" in quota.stdout, quota.stderr
        with gpuflow_serve(api_url, home, overrides, ("run-experiment",), only=True, limit=5):
            yield api_url, home


def gpuflow(*args: str, api_url: str, home) -> subprocess.CompletedProcess:
    env = base_env(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(home))
    return subprocess.run([str(BIN / "gpuflow"), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def submit(count: int, **train) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("run-experiment/run-experiment")
        spec = {**deployment.parameters["spec"]}
        spec["train"] = {**spec["train"], **train}
        ids = []
        for _ in range(count):  # one after the other: their submission order is their creation order
            ids.append(client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec}).id)
            time.sleep(0.2)
        return ids


def runs_and_held(ids) -> tuple[list, int]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return ([client.read_flow_run(run_id) for run_id in ids],
                client.read_global_concurrency_limit_by_name(LIMIT_PREFIX + "local").active_slots)


def steps_of(flow_run_id) -> set[str]:
    """The names of the tasks a flow run ran (provision, open-mlflow-run, ...)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0] for run in runs}


def holding(run) -> bool:
    return bool(run.state and run.state.is_running() and run.state.name != WAITING
                and "holding" in (run.state.message or ""))


def test_gpuflow_status_reads_as_a_table():
    from gpuflow.flows.cli.status import RunStatus, table

    rows = [RunStatus("digits-mlp-1", "1", "Running", "local", "gpuflow-1 (UP)", "1 worker", 0.5, 0.0125,
                      "alive, renewed 3 s ago (grace 120 s)", None, "http://mlflow:5000/#/experiments/1/runs/a"),
            RunStatus("digits-mlp-2", "2", WAITING, "local", gpus="1 worker", queue="1 of 1 in local")]
    header, first, second = table(rows).splitlines()
    assert header.split() == ["run", "state", "cluster", "GPUs", "$/h", "spent", "lease", "queue", "MLflow"]
    assert "$0.50" in first and "$0.01" in first and "alive, renewed 3 s ago" in first
    assert "Waiting for GPUs" in second and "1 of 1 in local" in second
    assert second.index("1 of 1 in local") == header.index("queue")  # columns line up
    assert table([]) == "nothing running or waiting"


@pytest.mark.full
def test_runs_over_the_quota_wait_their_turn_in_submission_order(tmp_path):
    with served_with_quota(tmp_path, size=2) as (api_url, home):
        ids = submit(4)
        first_held, most_held, status = {}, 0, None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            runs, held = runs_and_held(ids)
            most_held = max(most_held, held, sum(holding(run) for run in runs))
            for run in runs:
                if holding(run) or (run.state and run.state.is_final()):
                    first_held.setdefault(run.id, time.monotonic())
            if status is None and sum(run.state.name == WAITING for run in runs if run.state) == 2 \
                    and sum(holding(run) for run in runs) == 2:
                status = json.loads(gpuflow("status", "--json", api_url=api_url, home=home).stdout)
            if all(run.state and run.state.is_final() for run in runs):
                break
            time.sleep(0.5)
    assert [run.state_name for run in runs] == ["Completed"] * 4, [run.state.message for run in runs]
    assert most_held <= 2
    assert sorted(ids, key=first_held.get) == ids  # they got the quota in the order they were submitted
    assert status is not None, "never saw 2 holding and 2 waiting"
    rows = {row["flow_run_id"]: row for row in status}
    assert [rows[str(run_id)]["state"] for run_id in ids] == ["Running", "Running", WAITING, WAITING]
    assert [rows[str(run_id)]["queue"] for run_id in ids[2:]] == ["1 of 2 in local", "2 of 2 in local"]
    assert all(rows[str(run_id)]["gpus"] == "1 worker" for run_id in ids)
    assert processes_of(home) == []


@pytest.mark.full
def test_a_killed_holder_gives_its_share_back_once_its_cluster_is_gone_and_a_cancelled_waiter_leaves_nothing(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with served_with_quota(tmp_path, size=1, grace_minutes=0.2) as (api_url, home):
        holder, waiter, cancelled = submit(3, epochs=400)
        wait_until(lambda: holding(runs_and_held([holder])[0][0]), 300, "the first run holding the quota")
        wait_until(lambda: [run.state.name for run in runs_and_held([waiter, cancelled])[0]] == [WAITING] * 2, 120,
                   "the others waiting")
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(cancelled, Cancelling(), force=True)
        flow_process = [p for p in carrying("PREFECT__FLOW_RUN_ID", str(holder))
                        if p.parent() is None or p.parent().environ().get("PREFECT__FLOW_RUN_ID") != str(holder)]
        assert len(flow_process) == 1, flow_process
        os.kill(flow_process[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        backend = LocalBackend(home / "clusters")
        cluster = cluster_name_for(str(holder))
        gone = wait_until(lambda: cluster not in {c.name for c in backend.status()} and time.monotonic(), 120,
                          "the killed run's cluster gone")
        wait_until(lambda: holding(runs_and_held([waiter])[0][0]), 180, "the waiting run taking the quota")
        took_over = time.monotonic()
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(waiter, Cancelling(), force=True)  # it has shown what it had to
        wait_until(lambda: all(run.state.is_final() for run in runs_and_held([holder, waiter, cancelled])[0]), 180,
                   "every run over")
        final, _ = runs_and_held([holder, waiter, cancelled])
        # the cancelled waiter never opened an MLflow run nor asked for a cluster; the one that took over did both
        assert not {"open-mlflow-run", "provision"} & steps_of(cancelled)
        assert {"open-mlflow-run", "provision"} <= steps_of(waiter)
    assert took_over >= gone  # never while the killed run's cluster still ran
    assert took_over - killed_at < 60 + 15 + 10  # within its lease (Prefect's 60 s minimum) and a repossessor pass
    assert final[2].state.is_cancelled(), final[2].state.message
    assert processes_of(home) == []
