"""The fault matrix: each fault injected for real, then what the user finds afterwards is checked.

For every fault: no process of the run is left (found by its GPUFLOW_HOME, which every process of a run
inherits: the cluster, the job, Ray's workers, Prefect's temporary server), the MLflow run's final status
and `stopped_by`, the checkpoints it had made, and the Prefect run in a final state. The faults on the real
SkyPilot-on-Slurm cluster are in tests/test_slurm.py; cancel and SIGTERM in tests/test_lifecycle.py; a SIGTERM
of the `gpuflow serve` runner on the team stack, with the served reaper's pass, in tests/test_team_stack.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.job.reports import persisted_reports
from gpuflow.cluster.protocol import CHECKPOINT_TAG, CHECKPOINTS_TAG
from gpuflow.cluster.util.ray_internals import SNAPSHOT_FILE
from tests.loops import PACED_LOOP_IN_MEMORY, WAITING_RUN_ENVS
from tests.support.processes import processes_of, wait_until
from tests.support.repo import REPO
from tests.support.servers import files_holding, the_one_message, webhook_receiver
from tests.test_lifecycle import ONE_WORKER, GpuflowRun, flow_run_state
from tests.test_skypilot import sky_flow  # noqa: F401  (the flow on the SkyPilot SDK double)

pytestmark = pytest.mark.full

GRACE = "limits.orphan_grace_minutes=0.2"  # 12 s without a lease renewal: the job stops itself


# How long a fault test waits for what must happen by itself (processes gone, the MLflow run closed). Alone it takes
# seconds (each test prints it); with the suite's other worker saturating the machine, over a minute was seen.
CLEANUP_S = 180


def mlflow_runs(spec) -> list:
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    return client.search_runs([experiment.experiment_id]) if experiment else []


def checkpoints_under(home: Path, file: str = "checkpoint.pt") -> list[Path]:
    """The checkpoints the runs under `home` kept, by the file each holds (the digits loop's, or another loop's)."""
    return sorted(home.glob(f"checkpoints/*/checkpoint_*/{file}"))


def reaper_in(gpuflow_home: Path, *, ephemeral_api: bool, api_url: str | None = None) -> str:
    """`python -m gpuflow.flows.reaper` as the deployment (or a user) runs it, for this run's state; its output."""
    env = {**os.environ, "GPUFLOW_HOME": str(gpuflow_home)}
    if ephemeral_api:
        env.pop("PREFECT_API_URL", None)
        env["PREFECT_HOME"] = str(gpuflow_home / "prefect")
    else:
        from prefect.settings import PREFECT_API_URL

        env["PREFECT_API_URL"] = api_url or PREFECT_API_URL.value()
    done = subprocess.run(
        [sys.executable, "-c", "from gpuflow.flows.reaper import reap_clusters; reap_clusters(backends=['local'])"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def test_sigkill_of_gpuflow_run_mid_training_leaves_nothing(digits_spec, gpuflow_home):
    """kill -9 of a plain `gpuflow run` (Prefect's temporary API, as a user without a server has it). The run's
    webhook hears it once (from the job's guard, not again from the reaper), and its URL is nowhere on disk."""
    with webhook_receiver() as (url, messages):
        added = notify_add_in(gpuflow_home, "alerts", url)
        assert "notify block 'alerts' saved" in added, added
        run = GpuflowRun(gpuflow_home, "notify.block=alerts", ONE_WORKER, ephemeral_api=True)
        run.wait_for_line("epoch 3/")
        run.process.kill()
        killed_at = time.monotonic()
        run.wait()

        wait_until(
            lambda: processes_of(gpuflow_home) == [], CLEANUP_S, "every process of the run gone (cluster, job, API)"
        )
        [mlflow_run] = wait_until(
            lambda: [r for r in mlflow_runs(digits_spec) if r.info.status != "RUNNING"],
            CLEANUP_S,
            "the MLflow run closed",
        )
        print(f"kill -9 → nothing left and MLflow closed in {time.monotonic() - killed_at:.1f}s")
        assert mlflow_run.info.status == "FAILED"
        assert mlflow_run.data.tags["stopped_by"] == "orphaned"
        assert len(checkpoints_under(gpuflow_home)) >= 3, "the checkpoints made before the kill are kept"
        flow_run_id = mlflow_run.data.tags["prefect.flow_run_id"]
        the_one_message(messages, "orphaned", mlflow_run.info.run_id, flow_run_id)
        # No reaper yet: the job's guard stopped the training and logged what it had, and what was persisted
        every_persisted_epoch_once(digits_spec, mlflow_run)

        # The flow run still reads RUNNING (nothing was left to update it): the reaper tells the truth.
        out = reaper_in(gpuflow_home, ephemeral_api=True)
        assert len(messages) == 1, messages  # the job's guard said it already: the reaper does not again
    assert "Crashed" in out and flow_run_id in out, out[-3000:]
    every_persisted_epoch_once(digits_spec, mlflow_run)
    assert processes_of(gpuflow_home) == [], "the reaper stops what it started (its API server)"
    assert files_holding(gpuflow_home, url.rsplit("/", 1)[1]) == [], "the webhook's URL is a secret"


def every_persisted_epoch_once(spec, mlflow_run) -> None:
    """Every epoch Ray Train persisted with its checkpoint is in the MLflow run once, and its last checkpoint is the
    run's, though the job was stopped with its last reports still on their way."""
    client = MlflowClient(spec.tracking_uri)
    snapshot = f"{mlflow_run.data.tags[CHECKPOINTS_TAG]}/{SNAPSHOT_FILE}"
    persisted = [report.step for report in persisted_reports(snapshot)]
    logged = sorted(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "val_accuracy"))
    assert persisted and set(persisted) <= set(logged) and len(logged) == len(set(logged)), (persisted, logged)
    assert int(client.get_run(mlflow_run.info.run_id).data.tags[CHECKPOINT_TAG + "_step"]) >= max(persisted)


def notify_add_in(gpuflow_home: Path, name: str, url: str) -> str:
    """`gpuflow notify add` as the user of an ephemeral-API `gpuflow run` runs it: into the same Prefect database."""
    env = {**os.environ, "GPUFLOW_HOME": str(gpuflow_home), "PREFECT_HOME": str(gpuflow_home / "prefect")}
    env.pop("PREFECT_API_URL", None)
    (gpuflow_home / "prefect").mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow.flows.cli", "notify", "add", name, url],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done.stdout + done.stderr


def test_prefect_api_killed_mid_run_training_goes_on_and_the_run_ends_saying_so(digits_spec, gpuflow_home, monkeypatch):
    """kill -9 of Prefect's API server mid-training (a temporary API here; the warm stack's, or a team's server, is the
    same to the run): training goes on to its last epoch, the run downs its cluster and closes its MLflow run, and
    `gpuflow run` exits saying what happened, instead of hanging on Prefect's log and event workers' retries."""
    monkeypatch.setenv("PREFECT_CLIENT_MAX_RETRIES", "1")  # each call to the dead API gives up sooner: same path
    epochs = 12
    run = GpuflowRun(gpuflow_home, f"train.epochs={epochs}", ONE_WORKER, ephemeral_api=True)
    kill_its_prefect_api_at_epoch_2(run)
    killed_at = time.monotonic()

    assert run.wait(timeout_s=CLEANUP_S) == 1
    output = "".join(run.lines)
    assert "lost Prefect's API" in output and "Traceback" not in output.split("lost Prefect's API")[1], output[-3000:]
    wait_until(lambda: processes_of(gpuflow_home) == [], CLEANUP_S, "every process of the run gone (cluster, job)")
    print(f"API killed → gpuflow run exited, nothing left in {time.monotonic() - killed_at:.1f}s")
    [mlflow_run] = mlflow_runs(digits_spec)
    # Task runs report their states as events, queued for the API and never waited on: training, teardown and the
    # MLflow run's close go on without it. The first call that needs an answer (the summary artifact) ends the flow.
    assert mlflow_run.info.status == "FINISHED"
    client = MlflowClient(tracking_uri=digits_spec.tracking_uri)
    steps = sorted(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "val_accuracy"))
    assert steps == list(range(epochs)), "every epoch trained and logged after the API went"
    assert len(checkpoints_under(gpuflow_home)) == epochs


def test_a_run_whose_prefect_api_is_gone_ends_at_once_on_sigterm(digits_spec, gpuflow_home):
    """kill -9 of Prefect's API mid-training, then SIGTERM of `gpuflow run` (a scheduler's stop): the run tears down,
    marks its MLflow run KILLED and exits, instead of waiting on Prefect's log and event workers' retries of the dead
    API, for minutes, at exit."""
    run = GpuflowRun(gpuflow_home, ONE_WORKER, ephemeral_api=True)
    kill_its_prefect_api_at_epoch_2(run)
    run.wait_for_line("epoch 4/")
    run.process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()

    assert run.wait(timeout_s=CLEANUP_S) == 130, "".join(run.lines[-40:])
    print(f"SIGTERM → gpuflow run exited in {time.monotonic() - stopped_at:.1f}s")
    assert time.monotonic() - stopped_at < 60, "a teardown takes seconds; Prefect's retries at exit take minutes"
    assert "interrupted" in "".join(run.lines)
    wait_until(lambda: processes_of(gpuflow_home) == [], CLEANUP_S, "every process of the run gone (cluster, job)")
    [mlflow_run] = mlflow_runs(digits_spec)
    assert mlflow_run.info.status == "KILLED"
    assert len(checkpoints_under(gpuflow_home)) >= 4, "the checkpoints made before the stop are kept"


def kill_its_prefect_api_at_epoch_2(run: GpuflowRun) -> None:
    """kill -9 of the temporary Prefect API server that `gpuflow run` started, once its second epoch is reported."""
    run.wait_for_line("epoch 2/")
    [server] = [
        pid
        for pid in children_of(run.process.pid)
        if b"prefect.server.api.server:create_app" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    os.kill(server, signal.SIGKILL)


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_sigkill_during_provisioning_leaves_nothing(prefect_server, digits_spec, gpuflow_home):
    run = GpuflowRun(gpuflow_home, GRACE, ONE_WORKER)
    run.wait_for_line("provisioning local cluster")
    run.process.kill()
    run.wait()
    wait_until(lambda: processes_of(gpuflow_home) == [], CLEANUP_S, "the half-made cluster gone with its owner")

    time.sleep(15)  # let the lease (0.2 min) go stale, then the reaper's pass
    out = reaper_in(gpuflow_home, ephemeral_api=False)
    runs = mlflow_runs(digits_spec)
    assert all(r.info.status == "FAILED" and r.data.tags.get("stopped_by") == "orphaned" for r in runs), out
    if runs:  # the MLflow run opens side by side with provisioning: it may not exist yet
        assert flow_run_state(runs[0].data.tags["prefect.flow_run_id"]).is_crashed()
    assert processes_of(gpuflow_home) == []


def freeze_outside_a_write(process, store: Path, tries: int = 20) -> None:
    """SIGSTOP at a moment the process holds no lock on the local MLflow store (SQLite): frozen mid-write, or mid-read
    (a shared lock keeps every writer from committing, and a writer waiting on it keeps readers out), it would lock
    the job out of the store, as no frozen laptop whose cluster and tracking server are elsewhere does."""
    import sqlite3

    for _ in range(tries):
        process.send_signal(signal.SIGSTOP)
        db = sqlite3.connect(store, timeout=2)
        try:
            db.execute("BEGIN EXCLUSIVE")  # no other lock at all: waits out the others' locks, not a frozen one
            db.rollback()
            return
        except sqlite3.OperationalError:
            process.send_signal(signal.SIGCONT)
            time.sleep(0.3)
        finally:
            db.close()
    raise AssertionError(f"the flow process held the store's write lock at each of {tries} tries")


def test_frozen_flow_process_is_an_orphan(prefect_server, digits_spec, gpuflow_home):
    """SIGSTOP: the flow process lives on but does nothing; the job notices the lease, stops itself, and the
    flow, once thawed, ends Failed with the same reason."""
    run = GpuflowRun(gpuflow_home, GRACE, ONE_WORKER)
    flow_run_id = run.wait_for_training()
    freeze_outside_a_write(run.process, Path(digits_spec.tracking_uri.removeprefix("sqlite:///")))
    stopped_at = time.monotonic()
    try:
        [mlflow_run] = wait_until(
            lambda: [r for r in mlflow_runs(digits_spec) if r.info.status != "RUNNING"],
            CLEANUP_S,
            "the job closing the MLflow run on its own",
        )
        print(f"frozen flow → job stopped itself in {time.monotonic() - stopped_at:.1f}s")
        assert mlflow_run.data.tags["stopped_by"] == "orphaned" and mlflow_run.info.status == "FAILED"
        # the cluster is gone while the flow is still frozen: only the frozen process itself is left
        wait_until(lambda: processes_of(gpuflow_home) == [run.process.pid], CLEANUP_S, "the cluster gone")
    finally:
        run.process.send_signal(signal.SIGCONT)
    assert run.wait(60) != 0
    assert "stopped: the flow stopped renewing its lease" in "".join(run.lines)
    assert flow_run_state(flow_run_id).is_failed()
    assert processes_of(gpuflow_home) == []
    assert checkpoints_under(gpuflow_home)


@pytest.mark.parametrize("failures", [4])
def test_teardown_that_fails_still_closes_the_run_and_the_reaper_finishes_it(sky_flow, failures):  # noqa: F811
    """A cloud API that will not delete the cluster: the flow says so, the MLflow run is closed anyway, the run's quota
    slot stays held while the cluster may bill, and the reaper's next pass downs the cluster and gives the slot back
    (SkyPilot SDK double: no cloud here)."""
    from prefect.client.orchestration import get_client

    from gpuflow.cluster.backends.skypilot import SkyPilotBackend
    from gpuflow.flows.quota.pools import LIMIT_PREFIX, set_quota
    from gpuflow.flows.reaper import reap_clusters

    pool = f"teardown-{uuid.uuid4().hex[:8]}"  # the session's Prefect server is shared: a pool no other test uses
    set_quota(pool, 1)

    def held() -> int:
        with get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name(LIMIT_PREFIX + pool).active_slots

    fake, state, mlflow_run, logs = sky_flow("ok", compute={"quota": pool}, down_failures=failures)
    assert state.is_failed() and "could not tear down cluster" in state.message and "reaper" in state.message
    assert mlflow_run.info.status != "RUNNING"
    backend = SkyPilotBackend(sdk=fake)
    assert [s.name for s in backend.status()] == [mlflow_run.data.tags["gpuflow.cluster"]]
    assert held() == 1, "the slot stays held while the cluster may bill"
    [verdict] = reap_clusters(ttl_hours=1, backends=["skypilot"])  # the SDK is still the double
    assert verdict["downed"] and "FAILED" in verdict["reason"]
    assert backend.status() == [] and held() == 0, "the cluster gone, its slot is back"


def test_tracking_server_killed_mid_run_and_restarted_loses_no_metric(
    prefect_server, digits_spec, gpuflow_home, tmp_path, monkeypatch
):
    """Training goes on while MLflow is down; what it logged meanwhile arrives once the server is back."""
    import threading

    from gpuflow.flows.experiment import run_experiment
    from tests.support.servers import mlflow_server, stable_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # MLflow's client would retry for minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    # an epoch a second: still training when the server is back (down 10 s, then its start-up)
    store, port, epochs = tmp_path / "mlflow-server", stable_port(), 60
    spec = digits_spec.model_copy(
        update={
            "train": digits_spec.train.model_copy(
                update={
                    "epochs": epochs,
                    "loop": PACED_LOOP_IN_MEMORY,
                    "params": {**digits_spec.train.params, "pace_s": 1.0},
                }
            ),
            "data": None,
            "envs": {**digits_spec.envs, **WAITING_RUN_ENVS},
            "compute": digits_spec.compute.model_copy(update={"workers_per_node": 1, "num_workers": 1}),
            "tracking": digits_spec.tracking.model_copy(
                update={"uri": f"http://127.0.0.1:{port}", "register_model": False}
            ),
        }
    )
    outcome = {}
    with mlflow_server(store, port):
        flow = threading.Thread(target=lambda: outcome.update(state=run_experiment(spec, return_state=True)))
        flow.start()
        wait_until(lambda: len(history(spec, "val_accuracy")) >= 3, 600, "three epochs in MLflow")
    down_at = time.monotonic()
    time.sleep(10)  # training goes on meanwhile
    with mlflow_server(store, port):
        print(f"MLflow was down {time.monotonic() - down_at:.0f}s")
        flow.join(900)
        state = outcome["state"]
        assert state.is_completed(), state.message
        [run] = mlflow_runs(spec)
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in history(spec, "val_accuracy")) == list(range(epochs)), "each epoch once"
    assert processes_of(gpuflow_home) == []


def test_the_end_of_a_run_waits_for_a_tracking_server_that_is_down(tmp_path, monkeypatch):
    """A model (or profile) logged while the server restarts waits for it; a request MLflow refuses is not retried."""
    import threading

    import requests
    from mlflow.exceptions import MlflowException

    from gpuflow.cluster.loop_logging import when_mlflow_answers
    from tests.support.servers import mlflow_server, stable_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    store, port = tmp_path / "mlflow-server", stable_port()
    client = MlflowClient(f"http://127.0.0.1:{port}")
    with mlflow_server(store, port):
        run_id = client.create_run(client.create_experiment("down")).info.run_id
    back = threading.Event()

    def restart_later():
        time.sleep(8)
        with mlflow_server(store, port):
            back.wait(120)

    restarter = threading.Thread(target=restart_later)
    restarter.start()
    try:
        when_mlflow_answers(lambda: client.log_metric(run_id, "loss", 1.0), "metric", wait_s=120)
        assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.0]
        refused_at = time.monotonic()
        with pytest.raises(MlflowException, match="RESOURCE_DOES_NOT_EXIST|not found"):
            when_mlflow_answers(lambda: client.get_run("0" * 32), "run", wait_s=120)
        with pytest.raises(requests.HTTPError, match="404"):  # an HTTP error is an answer too (OSError by type)
            when_mlflow_answers(
                lambda: requests.get(f"{client.tracking_uri}/no-such-page").raise_for_status(), "page", wait_s=120
            )
        assert time.monotonic() - refused_at < 30, "a refused request is not retried"
    finally:
        back.set()
        restarter.join()
    started = time.monotonic()
    with pytest.raises(MlflowException):  # gone for good: gives up after its wait
        when_mlflow_answers(lambda: client.get_run(run_id), "run", wait_s=3)
    assert time.monotonic() - started < 30


def history(spec, key: str) -> list:
    runs = mlflow_runs(spec)
    return MlflowClient(tracking_uri=spec.tracking_uri).get_metric_history(runs[0].info.run_id, key) if runs else []
