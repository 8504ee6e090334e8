"""The warm local stack (`gpuflow up`): runs start on its Prefect API and spare cluster, and every guarantee holds.

Each test starts its own stack in its own gpuflow home, and leaves no process of that home behind."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from tests.support.processes import alive, processes_of, wait_until
from tests.support.repo import REPO
from tests.test_lifecycle import GpuflowRun

pytestmark = pytest.mark.full

SPEC = REPO / "experiments" / "digits.yaml"


@pytest.fixture
def stack_env(gpuflow_home):
    """`gpuflow` as a user without a Prefect server runs it: Prefect's home (its database) under the gpuflow home."""
    env = {**os.environ, "GPUFLOW_HOME": str(gpuflow_home), "PREFECT_HOME": str(gpuflow_home / "prefect")}
    env.pop("PREFECT_API_URL", None)
    yield env
    subprocess.run([sys.executable, "-m", "gpuflow.flows.cli", "down"], env=env, cwd=REPO, capture_output=True)
    wait_until(lambda: processes_of(gpuflow_home) == [], 60, "nothing of the stack left")


def gpuflow(env: dict, *args: str, timeout_s: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow.flows.cli", *args],
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


def data_of(home) -> list[str]:
    return [f"data.train={home}/data/train.parquet", f"data.validation={home}/data/validation.parquet"]


def stack_record(home) -> dict:
    return json.loads((home / "stack" / "stack.json").read_text())


def spare_pids(home) -> list[int]:
    """The spare cluster's processes: its supervisor's session."""
    from gpuflow.cluster.backends.local import LocalBackend

    return LocalBackend(home / "clusters").pids(stack_record(home)["spare"])


def digits_runs(home) -> list:
    """The MLflow runs of the digits experiment (the store's first) in the home's local store, newest first."""
    return MlflowClient(f"sqlite:///{home / 'mlflow.db'}").search_runs(["1"])


def flow_runs_in(api_url: str) -> list:
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def read():
        async with PrefectClient(api_url) as client:
            return await client.read_flow_runs()

    return asyncio.run(read())


def test_a_run_on_the_stack_uses_its_api_and_spare_a_kill_9_of_one_stops_its_cluster_and_of_the_stack_all_of_it(
    stack_env, digits_spec, gpuflow_home
):
    # the run's secret and the tracking server's password are in the shell: they reach the run's workers from the
    # run, and no process the stack keeps for the next run holds them
    secrets = {"GPUFLOW_TEST_TOKEN": f"token-{uuid.uuid4().hex}", "MLFLOW_TRACKING_PASSWORD": f"pw-{uuid.uuid4().hex}"}
    stack_env.update(secrets)
    spec = gpuflow_home / "digits-with-a-secret.yaml"
    spec.write_text(SPEC.read_text() + f"workdir: {REPO}\nsecrets: [GPUFLOW_TEST_TOKEN]\n")
    out = gpuflow(stack_env, "up", str(spec), "--idle-minutes", "5")
    assert "spare        a local Ray cluster of 1 node(s) × 3 CPU(s)" in out, out
    stack = stack_record(gpuflow_home)
    spare = spare_pids(gpuflow_home)
    assert spare, "the spare cluster is up"
    again = gpuflow(stack_env, "up", "--idle-minutes", "30")  # one up keeps its idle time, and says so
    assert "stops after 5 idle min" in again and "it was up already" in again and stack_record(gpuflow_home) == stack

    # The run's Prefect home is another: had it started an API of its own, the flow run would be stored there.
    run_env = {**stack_env, "PREFECT_HOME": str(gpuflow_home / "prefect-of-the-run")}
    out = gpuflow(run_env, "run", str(spec), "--set", "train.epochs=2", *sets(data_of(gpuflow_home)))
    assert "finished in" in out, out
    assert_a_clean_console(out)

    [flow_run] = flow_runs_in(stack["api_url"])
    assert flow_run.state.is_completed()
    assert not (gpuflow_home / "prefect-of-the-run" / "prefect.db").exists(), "the run started no Prefect API"
    assert alive(spare) == [], "the run trained on the spare, and downed it at its end as its own cluster"
    [finished] = digits_runs(gpuflow_home)
    assert finished.info.status == "FINISHED"

    # once the run is over, the stack makes the next spare
    wait_until(
        lambda: (
            stack_record(gpuflow_home)["spare"] not in (None, stack["spare"])
            and stack_record(gpuflow_home)["spare_shape"]
        ),
        120,
        "a new spare",
    )
    for pid in processes_of(gpuflow_home):
        held = psutil.Process(pid).environ()
        assert not set(secrets.values()) & set(held.values()), f"{psutil.Process(pid).cmdline()[:3]} holds a secret"

    # The next spare changes owner when claimed: a kill -9 of the run that claimed it must stop it, while the stack
    # goes on.
    own = set(processes_of(gpuflow_home)) - set(spare_pids(gpuflow_home))  # the stack, its API, their watchers
    run = GpuflowRun(gpuflow_home, ephemeral_api=True)  # a long, paced digits run
    run.wait_for_line("epoch 3/")
    of_the_run = set(processes_of(gpuflow_home)) - own
    run.process.kill()
    run.wait()

    wait_until(lambda: alive(of_the_run) == [], 60, "the claimed cluster, the job and its workers gone")
    [mlflow_run] = wait_until(
        lambda: [
            r for r in digits_runs(gpuflow_home) if r.info.run_id != finished.info.run_id and r.info.status != "RUNNING"
        ],
        60,
        "the MLflow run closed",
    )
    assert mlflow_run.info.status == "FAILED" and mlflow_run.data.tags["stopped_by"] == "orphaned"
    assert set(alive(own)) == own, "the stack goes on"
    assert stack_record(gpuflow_home)["api_url"] == stack["api_url"]

    # A kill -9 of the stack itself, its next spare up: its API and spare go with it; the next run starts cold
    wait_until(lambda: stack_record(gpuflow_home)["spare"] and spare_pids(gpuflow_home), 120, "the next spare")
    kill_9_the_stack_then_run_cold_then_warm(stack_env, gpuflow_home)


def kill_9_the_stack_then_run_cold_then_warm(stack_env, gpuflow_home) -> None:
    """A kill -9 of the stack leaves nothing. Then, without `gpuflow up`: the first run starts cold and leaves a stack
    behind, the second is warm without asking (and, on a terminal, shows one line rewritten in place), and left alone
    the stack goes."""
    before = {run.info.run_id for run in digits_runs(gpuflow_home)}
    dead = stack_record(gpuflow_home)["pid"]
    os.kill(dead, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: processes_of(gpuflow_home) == [], 60, "the API and the spare gone with the stack")
    print(f"kill -9 of the stack → nothing left in {time.monotonic() - killed_at:.1f}s")
    log = gpuflow_home / "stack" / "stack.log"
    logged = log.stat().st_size if log.exists() else 0

    # the next run finds the dead stack's record, and starts cold instead of failing
    assert (gpuflow_home / "stack" / "stack.json").exists()
    auto = {
        **stack_env,
        "PREFECT_HOME": str(gpuflow_home / "prefect-after-the-kill"),
        "GPUFLOW_STACK": "auto",
        "GPUFLOW_STACK_IDLE_MINUTES": "0.5",
    }
    out = gpuflow(auto, "run", str(SPEC), "--set", "train.epochs=1", *sets(data_of(gpuflow_home)))
    assert "finished in" in out and "warm stack   up for your next run until 0.5 min idle" in out, out
    assert (gpuflow_home / "prefect-after-the-kill" / "prefect.db").exists(), "it started Prefect's API itself"
    wait_until(
        lambda: stack_record(gpuflow_home)["pid"] != dead and stack_record(gpuflow_home).get("spare_shape"),
        120,
        "the stack's API and spare up once the run ended",
    )
    stack = stack_record(gpuflow_home)
    spare = spare_pids(gpuflow_home)
    [waiting_job] = json.loads((gpuflow_home / "clusters" / stack["spare"] / "cluster.json").read_text())["jobs"]

    # the second run in a terminal: what a person at one sees of a warm run (the first, in a pipe, printed lines)
    second = {**auto, "PREFECT_HOME": str(gpuflow_home / "prefect-of-the-second-run")}
    out = gpuflow_in_a_terminal(second, "run", str(SPEC), "--set", "train.epochs=2", *sets(data_of(gpuflow_home)))
    assert_a_live_line(out, epochs=2)
    assert "finished in" in out and "warm stack   up" not in out, out
    run_log = Path(out.split("full log     ", 1)[1].split(" ", 1)[0]).read_text()
    assert f"(job pid {waiting_job})" in run_log, "it trained with the job the stack had started, its imports done"
    # the stack's API keeps its flow runs in the first run's Prefect home (it inherited its settings): both are there
    assert [run.state.is_completed() for run in flow_runs_in(stack["api_url"])] == [True, True]
    assert not (gpuflow_home / "prefect-of-the-second-run" / "prefect.db").exists(), "no Prefect API of its own"
    assert alive(spare) == [], "it trained on the stack's spare, and downed it as its own cluster"
    runs = digits_runs(gpuflow_home)
    assert [run.info.status for run in runs if run.info.run_id not in before] == ["FINISHED", "FINISHED"]

    # left alone, the stack stops after its idle time: its API, its next spare, itself
    wait_until(lambda: processes_of(gpuflow_home) == [], 180, "the stack gone once idle, with its API and spare")
    assert "stopping" in log.read_bytes()[logged:].decode(errors="replace")


def test_a_spare_serves_only_a_run_from_its_shell_and_each_runs_workers_see_their_own_values(stack_env, gpuflow_home):
    """A spare's workers would see the values of the shell that started the stack: a run from another shell starts
    its own cluster, and the workers of a warm run and of a cold one each see their own shell's value."""
    spec = gpuflow_home / "report-shell.yaml"
    spec.write_text(
        f"name: report-shell\nworkdir: {REPO}\ntrain:\n  loop: tests.loops.plain:report_shell\n  epochs: 1\n"
        "  params: {variable: GPUFLOW_TEST_SHELL_VALUE}\ntracking: {register_model: false}\n"
        "compute: {backend: local, workers_per_node: 1}\n"
    )
    first = {**stack_env, "GPUFLOW_TEST_SHELL_VALUE": "1"}
    gpuflow(first, "up", str(spec), "--idle-minutes", "5")
    spare = spare_pids(gpuflow_home)
    gpuflow(first, "run", str(spec))
    assert alive(spare) == [], "the run from the stack's shell trained on its spare"
    wait_until(lambda: stack_record(gpuflow_home)["spare"] and spare_pids(gpuflow_home), 120, "the next spare")
    spare = spare_pids(gpuflow_home)
    gpuflow({**stack_env, "GPUFLOW_TEST_SHELL_VALUE": "2"}, "run", str(spec))
    assert sorted(alive(spare)) == sorted(spare), "a run from another shell left the spare alone"
    client = MlflowClient(f"sqlite:///{gpuflow_home / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("report-shell").experiment_id], order_by=["start_time"])
    assert [run.data.metrics["shell_value"] for run in runs] == [1.0, 2.0]  # warm, then cold: each its own shell's
    assert gpuflow(stack_env, "down") == "gpuflow: warm stack stopped\n"
    wait_until(lambda: processes_of(gpuflow_home) == [], 30, "nothing of the stack left")


def assert_a_clean_console(out: str) -> None:
    """What a person reads of a 2-epoch run: a line per epoch and the end of training in readable metrics; not the
    job's result JSON, Ray's or MLflow's own lines, nor raw metric dicts. The log file keeps every line."""
    epoch_lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in epoch_lines] == ["1/2", "2/2"], out  # one short line per epoch, in a pipe
    for line in epoch_lines:
        assert len(line) <= 120 and "val_accuracy " in line and " s/epoch" in line and "$" in line, line
    for hidden in ("perf/", "TrainController", "RayTrainWorker", "[gpuflow] epoch", "\r"):
        assert not any(hidden in line for line in out.splitlines() if "metrics      " not in line), hidden
    [finished] = [line for line in out.splitlines() if "training finished in" in line]
    assert "val_accuracy=" in finished and "perf/" not in finished and "{" not in finished, finished
    for hidden in (
        "[gpuflow] result ",
        "{'train_loss'",
        "INFO worker.py",
        "Started training worker group",
        "Running hook 'notify_end'",
    ):
        assert hidden not in out, hidden
    log_file = out.split("full log     ", 1)[1].split(" ", 1)[0]
    kept = Path(log_file).read_text()
    assert "[gpuflow] result " in kept and "Started training worker group" in kept and "[gpuflow] epoch 1: " in kept
    assert "Running hook 'notify_end'" in kept


LIVING_FLOW = """
import sys, time
from prefect import flow

@flow(name="elsewhere")
def elsewhere():  # a run on another backend (SkyPilot), or one waiting for the quota: no local cluster
    print("started", flush=True)
    time.sleep(float(sys.argv[1]))

# the state the API accepted for its end; the exit's flush of logs to an API that may have gone comes after
print("done", elsewhere(return_state=True).name, flush=True)
"""


def test_the_stack_stays_up_while_a_run_on_its_api_lives_without_a_local_cluster(stack_env, gpuflow_home):
    """A run whose cluster is not local (SkyPilot), or that waits for the quota, uses the stack's API with no local
    cluster up: the stack waits for it, judged by its heartbeats, and goes its idle time after the run's end."""
    gpuflow(stack_env, "up", "--idle-minutes", "0.2")  # 12 s; no spec: no spare
    stack = stack_record(gpuflow_home)
    env = {**stack_env, "PREFECT_API_URL": stack["api_url"], "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    run = subprocess.Popen([sys.executable, "-c", LIVING_FLOW, "45"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "started"
        time.sleep(30)  # past two idle times
        assert alive([stack["pid"]]), "the stack went while a run on its API lived"
        # its end as the stack's API recorded it (the stack goes its idle time after it: no read of the API after)
        assert select.select([run.stdout], [], [], 90)[0] and run.stdout.readline().strip() == "done Completed"
        ended = time.monotonic()
    finally:
        run.kill()  # its exit may still be flushing logs to the stack's API, gone 12 s after the run ended
        run.wait()
    wait_until(lambda: processes_of(gpuflow_home) == [], 60, "the stack gone once its run was over and it was idle")
    went_s = time.monotonic() - ended
    print(f"the stack went {went_s:.1f} s after its last run ended")
    assert went_s > 6, "idle its 12 s from the run's end (read here a moment after it), not from an earlier ask"


def gpuflow_in_a_terminal(env: dict, *args: str) -> str:
    """What `gpuflow ARGS` shows on a pseudo-terminal, all of it."""
    import pty

    main, other = pty.openpty()
    command = [sys.executable, "-m", "gpuflow.flows.cli", *args]
    process = subprocess.Popen(
        command, cwd=REPO, env={**env, "COLUMNS": "160"}, stdin=other, stdout=other, stderr=other
    )
    os.close(other)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal's other end closed: the run is over
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert process.wait(timeout=60) == 0, shown[-3000:]
    return shown.decode(errors="replace")


def assert_a_live_line(shown: str, epochs: int) -> None:
    """On a terminal: one line rewritten in place (phase, epoch i/N, ETA), then the summary; no line per epoch."""
    redrawn = [part.split("\r")[0] for part in shown.split("\r\x1b[K")]  # what each redraw of the line wrote
    for i in range(1, epochs + 1):
        assert any(f"training  epoch {i}/{epochs}  ETA " in part for part in redrawn), shown[-3000:]
    assert any(part.startswith("provisioning") for part in redrawn), shown[-3000:]
    assert not any(line.startswith("epoch ") for line in shown.splitlines()), shown[-3000:]
    summary = shown.rstrip().split("\r\x1b[K")[-1].lstrip("\r\n")
    assert summary.startswith("gpuflow: digits-mlp finished in"), shown[-3000:]


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]
