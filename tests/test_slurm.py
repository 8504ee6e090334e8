"""`gpuflow run` with compute.backend=skypilot for real: SkyPilot launches onto a one-node Slurm cluster on
127.0.0.1 (tests/infra/slurm), the node installs gpuflow, trains, logs to a real MLflow server; then teardown.

    .venv/bin/python -m pytest --full -m slurm -s        # -s prints each run's phase timings

A launch here costs minutes of this machine's CPU, so only what the node side decides launches: a run that trains on its
third compute option (a partition that refuses the launch, and spot, which this cluster has none of: SkyPilot's own
failover), a setup that fails, a cancel mid-launch, a spot-only run that falls back to on-demand until a limit stops
it, a kill -9 of the flow (the job's own guard, autodown), and one run that takes a spot notice (the notice's
checkpoint, the replacement provisioned on it) and then loses the replacement's allocation (relaunch, resume). A
failing job and a SIGTERM of `gpuflow run` are client-side: they run for real on the local backend
(tests/test_experiment_e2e.py, tests/test_lifecycle.py) and on the SkyPilot double (tests/test_skypilot.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.backends import flow_run_id_of
from gpuflow.cluster.protocol import CLUSTER_TAG, SPEC_LOADED
from tests.infra.slurm import harness
from tests.loops import paced_overrides
from tests.support.runs import mlflow_run_of

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]
GPUFLOW = str(Path(sys.executable).parent / "gpuflow")
RUN_TIMEOUT_S = 900  # a launch is 25-80 s here, a down 7-55 s; the machine is shared
# The node installs gpuflow itself, as a cloud node would: uv (SkyPilot puts it in ~/.local/bin) with its
# per-user cache, and the local CPU torch wheel (a bare torch==2.13.0 would be PyPI's CUDA build).
NODE_SETUP = 'export PATH=$HOME/.local/bin:$PATH; uv pip install -q --python "$(which python)" "torch==2.13.0+cpu" -e .'
CLUSTER_LINE = re.compile(r"provisioning skypilot cluster (gpuflow-[0-9a-f]{32})")


@pytest.fixture(scope="session")
def shared_disk(slurm_infra):
    """A folder both this machine (root) and the node (skyci) can use: the tests' stand-in for a bucket."""
    folder = slurm_infra.base / "shared" / uuid.uuid4().hex[:8]
    folder.mkdir(parents=True)
    for path in (folder.parent, folder):
        path.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# long runs train an epoch a second: the Slurm node is this machine, whose CPU the other tests need
PACED = paced_overrides(1)  # runs kept alive for a kill or a limit: no Ray Data on the node


@pytest.fixture
def gpuflow_on_slurm(slurm_infra, mlflow_url, shared_disk, prefect_server, tmp_path):
    """Starts `gpuflow run experiments/digits.yaml` on the Slurm cluster; stops whatever it left on exit."""
    with launcher(slurm_infra, mlflow_url, shared_disk, tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def digits_on_the_third_option(slurm_infra, mlflow_url, shared_disk, prefect_server, tmp_path_factory):
    """One digits run, read by two tests (a launch is minutes of CPU). Its options fail over both ways SkyPilot does:
    a partition that refuses the launch (sbatch fails: the harness's `closed` partition takes no jobs), spot nodes,
    which a Slurm cluster has none of (dropped before launch), then the cluster as it is."""
    options = (
        f'[{{infra: "{slurm_infra.infra}/closed"}}, {{infra: "{slurm_infra.infra}", use_spot: true}}, '
        f'{{infra: "{slurm_infra.infra}"}}]'
    )
    with launcher(slurm_infra, mlflow_url, shared_disk, tmp_path_factory.mktemp("third-option")) as start:
        run = start("compute.use_gpu=false", "compute.infra=null", f"compute.options={options}", epochs=3)
        run.wait()
        yield run


@contextlib.contextmanager
def launcher(slurm_infra, mlflow_url, shared_disk, logs: Path):
    from prefect.settings import PREFECT_API_URL

    runs = []

    def start(*overrides: str, epochs: int = 3, env: dict[str, str] | None = None) -> Run:
        args, run_env = digits_on_slurm(
            "run", slurm_infra, mlflow_url, shared_disk, f"train.epochs={epochs}", *overrides
        )
        env = {**run_env, **(env or {}), "PREFECT_API_URL": PREFECT_API_URL.value()}
        run = Run(
            subprocess.Popen(
                args,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
        runs.append(run)
        return run

    try:
        yield start
    finally:
        stop_what_is_left(runs, slurm_infra, logs)


def stop_what_is_left(runs: list, slurm_infra, logs: Path) -> None:
    for number, run in enumerate(runs):
        (logs / f"gpuflow-run-{number}.log").write_text(run.output)  # kept by pytest for a look afterwards
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.wait()
        if run.cluster:
            subprocess.run(
                [str(Path(sys.executable).parent / "sky"), "down", "-y", run.cluster],
                env=slurm_infra.subprocess_env(),
                capture_output=True,
                timeout=300,
            )


def digits_on_slurm(command: str, slurm_infra, mlflow_url, shared_disk, *overrides: str) -> tuple[list, dict]:
    """`gpuflow COMMAND experiments/digits.yaml` for the Slurm cluster, and its environment."""
    args = [
        GPUFLOW,
        command,
        "experiments/digits.yaml",
        "--set",
        "compute.backend=skypilot",
        "--set",
        f"compute.infra={slurm_infra.infra}",
        "--set",
        "compute.workers_per_node=1",
        "--set",
        f"tracking.uri={mlflow_url}",
        "--set",
        f"storage.checkpoints={shared_disk}/checkpoints",
        "--set",
        f"data.train={shared_disk}/data/train.parquet",
        "--set",
        f"data.validation={shared_disk}/data/validation.parquet",
        # one node on this machine: keep Ray on 127.0.0.1 (a real multi-node cluster must not set this)
        "--set",
        'envs={RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: "0"}',
        "--set",
        f"setup={NODE_SETUP}",
    ]
    for item in overrides:
        args += ["--set", item]
    env = slurm_infra.subprocess_env(
        {
            "GPUFLOW_SHARED_PATH": str(shared_disk),
            "GPUFLOW_HOME": str(shared_disk / "home"),
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost",
        }
    )
    return args, env


class Run:
    """A `gpuflow run` subprocess whose output is read as it comes, each line with the time it arrived."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.started = process, time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic() - self.started, line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    @property
    def cluster(self) -> str | None:
        found = CLUSTER_LINE.search(self.output)
        return found.group(1) if found else None

    def wait_for(self, text: str, timeout_s: float = RUN_TIMEOUT_S) -> float:
        """Seconds since start when a line containing `text` arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if text in line:
                    return at
            if self.process.poll() is not None and not self.reader.is_alive():
                raise AssertionError(
                    f"gpuflow exited {self.process.returncode} before {text!r}:\n{self.output[-6000:]}"
                )
            time.sleep(0.5)
        raise TimeoutError(f"no {text!r} within {timeout_s}s:\n{self.output[-6000:]}")

    def wait(self) -> int:
        code = self.process.wait(timeout=RUN_TIMEOUT_S)
        self.reader.join(timeout=30)
        return code

    def at(self, text: str) -> float | None:
        return next((at for at, line in self.lines if text in line), None)

    def phases(self) -> dict[str, float]:
        """Phase wall times as seen from the output (the flow also logs gpuflow.*_seconds to MLflow)."""
        marks = {
            name: self.at(text)
            for name, text in (
                ("start", "provisioning skypilot cluster"),
                ("provisioned", "[gpuflow] provisioned"),
                ("setup_done", "[gpuflow] setup finished"),
                ("first_epoch", "epoch 1/"),
                ("down_start", "tearing down cluster"),
                ("down_end", " is down ("),
            )
        }
        spans = {
            "provision": ("start", "provisioned"),
            "setup": ("provisioned", "setup_done"),
            "to_first_epoch": ("setup_done", "first_epoch"),
            "down": ("down_start", "down_end"),
        }
        return {
            name: round(marks[b] - marks[a], 1)
            for name, (a, b) in spans.items()
            if marks[a] is not None and marks[b] is not None
        }


def mlflow_run_on(mlflow_url: str, cluster: str):
    """(client, the MLflow run of the flow run that launched `cluster`), checked to name that cluster."""
    client, run = mlflow_run_of(mlflow_url, flow_run_id_of(cluster), "digits-mlp")
    assert run.data.tags[CLUSTER_TAG] == cluster
    return client, run


def assert_nothing_left(slurm_infra, *clusters: str):
    assert set(clusters).isdisjoint(harness.sky_clusters(slurm_infra))
    assert harness.slurm_jobs(user=slurm_infra.ssh_user) == []
    # nor a process of the clusters on the node (a Ray that escaped the job would hold port 6390)
    deadline = time.monotonic() + 120
    while (
        left := [p for p in harness.leftover_processes() if any(c in p for c in clusters)]
    ) and time.monotonic() < deadline:
        time.sleep(2)
    assert left == []


def report(name: str, run: Run, mlflow_metrics: dict):
    seconds = {k: round(v, 1) for k, v in mlflow_metrics.items() if k.startswith("gpuflow.")}
    print(f"\n[{name}] phases from the output: {run.phases()}\n[{name}] phases in MLflow: {seconds}")


def test_digits_trains_on_slurm_and_leaves_nothing(digits_on_the_third_option, slurm_infra, mlflow_url):
    run = digits_on_the_third_option
    assert run.process.returncode == 0, run.output[-6000:]
    assert "finished in" in run.output and "[gpuflow] setup finished" in run.output

    client, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
    assert mlflow_run.info.status == "FINISHED"
    tags = mlflow_run.data.tags
    assert tags["gpuflow.backend"] == "skypilot"
    assert flow_run_id_of(run.cluster) == tags["prefect.flow_run_id"]
    for metric in ("train_loss", "val_accuracy"):  # logged by rank 0 on the node, once per epoch
        assert sorted(m.step for m in client.get_metric_history(mlflow_run.info.run_id, metric)) == [0, 1, 2]
    assert {"gpuflow.provision_seconds", "gpuflow.first_epoch_seconds", "gpuflow.teardown_seconds"} <= set(
        mlflow_run.data.metrics
    )
    assert client.search_logged_models(
        [mlflow_run.info.experiment_id], filter_string=f"source_run_id = '{mlflow_run.info.run_id}'"
    )

    checkpoints = sorted(Path(tags["gpuflow.checkpoints"]).glob("checkpoint_*/checkpoint.pt"))
    assert len(checkpoints) == 3
    assert_nothing_left(slurm_infra, run.cluster)
    report("digits", run, mlflow_run.data.metrics)


def test_a_failing_setup_shows_its_log_and_downs_the_cluster(gpuflow_on_slurm, slurm_infra, mlflow_url):
    # SkyPilot leaves a cluster UP after a setup failure, even with down=True: our teardown must remove it.
    run = gpuflow_on_slurm("setup=echo no matching distribution for torch==9.9 && exit 3")
    assert run.wait() == 1, run.output[-6000:]
    assert "no matching distribution for torch==9.9" in run.output  # the setup's own log
    assert f"setup on {run.cluster} failed" in run.output and "ended Failed" in run.output
    assert run.output.count("provisioning skypilot cluster") == 1  # a broken setup is not retried
    _, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
    assert mlflow_run.info.status == "FAILED"
    assert_nothing_left(slurm_infra, run.cluster)
    report("setup fails", run, mlflow_run.data.metrics)


def test_cancel_from_prefect_while_launching_downs_the_cluster(gpuflow_on_slurm, slurm_infra, mlflow_url):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    run = gpuflow_on_slurm()
    # the Slurm job is allocated, SkyPilot is still installing its runtime: the launch request is in flight
    run.wait_for("Instance is up.")
    flow_run_id = flow_run_id_of(run.cluster)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled by the test"), force=True)
        assert run.wait() == 1
        assert client.read_flow_run(flow_run_id).state.is_cancelled()
    assert "request" in run.output and "cancelled" in run.output  # SkyPilot's own word on the launch
    assert "SkyPilot job" not in run.output  # neither setup nor training ever ran
    _, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
    assert mlflow_run.info.status == "KILLED"
    assert_nothing_left(slurm_infra, run.cluster)
    report("cancel while launching", run, mlflow_run.data.metrics)


# -- faults on the real cluster (see tests/test_faults.py for the local ones) ---------------------------------


def test_sigkill_of_the_flow_the_job_stops_itself_and_autodown_deletes_the_cluster(
    gpuflow_on_slurm, slurm_infra, mlflow_url, shared_disk
):
    """No flow is left to tear down: the job notices the lease, stops, shortens autostop; SkyPilot downs the cluster.
    The run held the team's quota: its slot stays held while the cluster lives, and one reaper pass afterwards marks
    the run Crashed and gives the slot back."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from gpuflow.flows.quota.pools import LIMIT_PREFIX, set_quota

    set_quota("skypilot", 1)  # the pool of a skypilot run with no GPUs: its workers
    try:
        slot_held_while_up = quota_checked_sigkill(gpuflow_on_slurm, slurm_infra, mlflow_url)
        with get_client(sync_client=True) as client:
            flow_run_id = slot_held_while_up.pop()
            reaper = subprocess.run(
                [sys.executable, "-m", "gpuflow.flows.reaper"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
                env=slurm_infra.subprocess_env(
                    {
                        "PREFECT_API_URL": PREFECT_API_URL.value(),
                        "GPUFLOW_HOME": str(shared_disk / "home"),
                        "NO_PROXY": "127.0.0.1,localhost",
                    }
                ),
            )
            assert reaper.returncode == 0, reaper.stdout[-3000:] + reaper.stderr[-3000:]
            assert client.read_flow_run(flow_run_id).state.is_crashed()
            assert client.read_global_concurrency_limit_by_name(LIMIT_PREFIX + "skypilot").active_slots == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + "skypilot")


def quota_checked_sigkill(gpuflow_on_slurm, slurm_infra, mlflow_url) -> list[str]:
    """The kill -9 and what follows; checks the run's quota slot stayed held until its allocation was gone. Returns
    [its flow run id]."""
    from prefect.client.orchestration import get_client

    from gpuflow.flows.quota.pools import LIMIT_PREFIX

    def slots_held() -> int:
        with get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name(LIMIT_PREFIX + "skypilot").active_slots

    run = gpuflow_on_slurm("limits.orphan_grace_minutes=0.25", "limits.idle_minutes_to_autostop=5", *PACED, epochs=400)
    run.wait_for("epoch 2/")
    assert slots_held() == 1
    # the backstop when the flow dies: every launch sets autostop with autodown, so SkyPilot deletes the cluster
    [record] = [r for r in harness.sky_status(slurm_infra) if r["name"] == run.cluster]
    assert (record["status"], record["autostop"], record["to_down"]) == ("UP", 5, True)
    os.killpg(run.process.pid, signal.SIGKILL)  # gpuflow run and anything it started in its session
    killed = time.monotonic()
    client = MlflowClient(mlflow_url)

    def closed():
        _, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
        return mlflow_run if mlflow_run.info.status != "RUNNING" else None

    mlflow_run = wait_for_value(closed, 180, "the job to close its MLflow run")
    job_stopped_s = time.monotonic() - killed
    assert (mlflow_run.info.status, mlflow_run.data.tags["stopped_by"]) == ("FAILED", "orphaned")
    assert client.get_metric_history(mlflow_run.info.run_id, "val_accuracy")
    samples = []  # (allocation still there, slots held): the slot must not come back while the GPUs would bill

    def allocation_gone() -> bool:
        samples.append((bool(harness.slurm_jobs(user=slurm_infra.ssh_user)), slots_held()))
        return not samples[-1][0]

    wait_for_value(allocation_gone, 600, "autodown to release the Slurm allocation")
    assert all(held == 1 for up, held in samples if up), samples
    gone_s = time.monotonic() - killed
    print(
        f"\n[sigkill on slurm] job stopped itself {job_stopped_s:.0f}s after the kill (grace 15 s); "
        f"cluster gone by autodown after {gone_s:.0f}s"
    )
    # the grace, plus the guard's poll and the MLflow round trips on a busy machine; not autostop's 5 minutes
    assert job_stopped_s < 15 + 120
    assert run.cluster not in harness.sky_clusters(slurm_infra, refresh=True)  # SkyPilot agrees: it is gone
    assert_nothing_left(slurm_infra, run.cluster)
    return [flow_run_id_of(run.cluster)]


# One limit launches for real here (budget and timeout share the watchdog and the job's guard: both are stopped for
# real on the local backend in tests/test_watchdog.py, and which fires is decided in unit tests). The same launch is
# the spot-only fallback's: a launch is minutes of this machine's CPU.
def test_limits_stop_a_skypilot_run(gpuflow_on_slurm, slurm_infra, mlflow_url):
    """A spot-only spec on a cluster with no spot: no capacity, a bounded wait (the flow run says so), then after
    compute.spot_fallback_after=2 the on-demand relaunch; the node accepts the spec it is handed and trains, until
    limits.max_runtime_minutes, counted from the job's start (the wait is not its runtime), stops it."""
    run = gpuflow_on_slurm(
        "compute.use_gpu=false",
        "compute.use_spot=true",
        "compute.spot_fallback_after=2",
        "limits.max_queue_minutes=3",
        "limits.max_runtime_minutes=0.75",
        *PACED,
        epochs=400,
    )
    assert run.wait() == 1, run.output[-6000:]
    assert "no option has capacity: waiting for one of 1 option(s)" in run.output
    assert "spot loss(es) of compute.spot_fallback_after=2; relaunching on-demand" in run.output
    assert f"launched option 1: {slurm_infra.infra} CPU on-demand" in run.output
    # the job on the on-demand node loaded the spec it was handed (its first epoch, even its connection to Ray, may
    # come after the limit: the job's start to its first epoch took 29 s on a quiet machine, over 45 s on CI's)
    assert SPEC_LOADED in run.output, run.output[-6000:]
    assert "stopped by timeout" in run.output
    client, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
    assert (mlflow_run.info.status, mlflow_run.data.tags["stopped_by"]) == ("KILLED", "timeout")
    assert mlflow_run.data.tags["gpuflow.option"] == f"1: {slurm_infra.infra} CPU on-demand"
    assert mlflow_run.data.tags["gpuflow.launched.spot"] == "false"
    assert_nothing_left(slurm_infra, run.cluster)
    report("spot only, on-demand after the wait, stopped by timeout", run, mlflow_run.data.metrics)


def wait_for_value(get, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = get()
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def test_two_options_cannot_be_had_the_run_launches_on_the_third(digits_on_the_third_option, slurm_infra, mlflow_url):
    """compute.options: SkyPilot fails over (the ordered list of resources) from a launch refused at provision time
    and from spot, which it drops before launching; the run trains on the third option and its MLflow run says so."""
    run = digits_on_the_third_option
    assert run.process.returncode == 0, run.output[-6000:]
    assert f"launched option 3: {slurm_infra.infra} CPU on-demand" in run.output
    assert run.output.count("provisioning skypilot cluster") == 1  # SkyPilot's own failover, in one launch
    _, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
    tags = mlflow_run.data.tags
    assert mlflow_run.info.status == "FINISHED"
    assert tags["gpuflow.option"] == f"3: {slurm_infra.infra} CPU on-demand"
    assert tags["gpuflow.launched.region"] == slurm_infra.infra.split("/")[1]
    assert_nothing_left(slurm_infra, run.cluster)


def test_no_option_has_capacity_the_wait_ends_naming_each_option_and_why(gpuflow_on_slurm, slurm_infra, mlflow_url):
    """Nothing to be had (a partition that takes no jobs, and spot): the run waits limits.max_queue_minutes, then
    fails naming each option with SkyPilot's reason for it; no cluster and no Slurm job is left."""
    options = f'[{{infra: "{slurm_infra.infra}/closed"}}, {{infra: "{slurm_infra.infra}", use_spot: true}}]'
    run = gpuflow_on_slurm(
        "compute.use_gpu=false", "compute.infra=null", f"compute.options={options}", "limits.max_queue_minutes=0.3"
    )
    assert run.wait() == 1, run.output[-6000:]
    final = next(line for line in run.output.splitlines() if "limits.max_queue_minutes: no capacity" in line)
    assert f"option 1 ({slurm_infra.infra}/closed CPU on-demand): " in final, final
    assert f"option 2 ({slurm_infra.infra} CPU spot): " in final, final
    assert "nothing is running and nothing was billed" in final
    print(f"\n[no capacity on slurm] {final}")
    _, mlflow_run = mlflow_run_on(mlflow_url, run.cluster) if run.cluster else (None, None)
    assert mlflow_run is None or mlflow_run.info.status == "FAILED"
    assert harness.slurm_jobs(user=slurm_infra.ssh_user) == []


def test_a_partition_the_cluster_lacks_is_refused_before_anything_starts(slurm_infra, mlflow_url, shared_disk):
    """SkyPilot checks a Slurm partition only once a launch builds its resources (a bare ValueError); validate
    asks the cluster first, naming the field and the partitions there are."""
    wrong = f"{slurm_infra.infra}/no-such-partition"
    args, env = digits_on_slurm("validate", slurm_infra, mlflow_url, shared_disk, f"compute.infra={wrong}")
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"compute.infra: '{wrong}': Partition 'no-such-partition' not found" in done.stderr, done.stderr
    assert "Available partitions: [" in done.stderr
    args, env = digits_on_slurm("validate", slurm_infra, mlflow_url, shared_disk)
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # the cluster as it is passes
    assert harness.slurm_jobs(user=slurm_infra.ssh_user) == []


NOTICE_LEAD_S = 15  # the cloud's notice comes this long before the allocation goes (AWS's is 120 s, GCP's 30 s)


@pytest.mark.timeout(1800)  # the two tests it replaced had 900 s each: three launches on a shared machine
def test_a_spot_notice_then_a_lost_allocation_each_relaunch_and_resume_in_the_same_run(
    gpuflow_on_slurm, slurm_infra, mlflow_url, shared_disk
):
    """Two losses of one run (a launch is minutes of CPU). First the notice path of docs/spot.md on a SkyPilot node:
    a spec with a spot option (SkyPilot drops it here, there is no spot on Slurm, and launches the on-demand one), the
    AWS metadata double on 127.0.0.1 standing in for the node's metadata service (the flow hands GPUFLOW_METADATA_URL
    to the node). Mid-epoch the double gives the notice: the node's watch drains it in Ray and tags the run, the loop
    checkpoints at every step, the flow provisions the replacement (-r1); at the deadline the allocation is
    scancelled, as the cloud takes the node, and the run resumes on the replacement from the notice's checkpoint.
    Then, with no notice, `scancel` of the replacement's Slurm job is a real loss (SkyPilot submits with --no-requeue
    and wipes the node's home): the flow relaunches (-r2) and resumes from the checkpoints on the shared disk. All in
    the same MLflow run, each epoch logged once."""
    from gpuflow.cluster.protocol import PREEMPTION_NOTICE_TAG
    from tests.loops import STEPPED_LOOP
    from tests.loops.stepped import steps_done
    from tests.support.metadata_double import metadata_double
    from tests.support.runs import flow_logs

    started = time.monotonic()
    epochs = 3  # the notice comes in epoch 0, the second loss once two epochs are done: the rest is -r2's
    step_log = shared_disk / f"steps-{uuid.uuid4().hex[:8]}.log"
    options = f'[{{infra: "{slurm_infra.infra}", use_spot: true}}, {{infra: "{slurm_infra.infra}"}}]'
    with metadata_double("aws") as double:
        run = gpuflow_on_slurm(
            "compute.use_gpu=false",
            "compute.infra=null",
            f"compute.options={options}",
            f"train.loop={STEPPED_LOOP}",
            "train.params.step_pace_s=0.5",
            f"train.params.step_log={step_log}",
            "tracking.register_model=false",
            "limits.max_runtime_minutes=60",  # three launches on a shared machine can outlast digits.yaml's 15
            epochs=epochs,
            env={"GPUFLOW_METADATA_URL": double.url},
        )
        wait_for_value(
            lambda: len(steps_done(step_log)) >= 3 or run.process.poll() is not None,
            RUN_TIMEOUT_S,
            "three steps trained on the first cluster",
        )
        assert run.process.poll() is None, run.output[-6000:]
        [job] = harness.slurm_jobs(user=slurm_infra.ssh_user)  # the replacement's comes on the notice
        noticed_at = time.time()
        deadline = double.notify(in_s=NOTICE_LEAD_S)  # the node asks <url> itself: node ""
        time.sleep(max(0.0, deadline - time.time()))
        killed = time.monotonic() - run.started
        subprocess.run(["scancel", job["id"]], check=True, timeout=60)
        double.taken()  # the replacement's node asks the same URL: its own service would have no notice
        # the second loss, no notice: the replacement's allocation once two epochs are done
        run.wait_for(f"epoch 2/{epochs}")
        [job] = harness.slurm_jobs(user=slurm_infra.ssh_user)
        subprocess.run(["scancel", job["id"]], check=True, timeout=60)
        lost_at = time.monotonic()
        code = run.wait()
    assert code == 0, run.output[-6000:]
    assert double.polls.get("", 0) > 0, "the node's watch asked the double"
    client, mlflow_run = mlflow_run_on(mlflow_url, run.cluster)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.metrics["recoveries"] == 2
    assert "aws takes node" in mlflow_run.data.tags[PREEMPTION_NOTICE_TAG]
    steps = sorted(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "val_accuracy"))
    assert steps == list(range(epochs)), "each epoch logged exactly once"

    logs = flow_logs(flow_run_id_of(run.cluster))
    assert "[gpuflow] preemption notice: aws takes node" in logs, logs[-3000:]
    assert f"notice: replacement cluster provisioning: {run.cluster}-r1" in logs, logs[-3000:]
    provisioning = run.at(f"notice: replacement cluster provisioning: {run.cluster}-r1")
    assert provisioning is not None and provisioning < killed, "the replacement was asked for before the loss"
    resumed = re.search(r"resuming at epoch 0 step (\d+) from the checkpoint taken on a preemption notice", logs)
    assert resumed, logs[-3000:]
    # the loss without a notice: from a checkpoint of a finished epoch, not from scratch nor the notice's again
    # (one epoch behind the console's count at most: Ray Train may not have registered the last one)
    after_the_loss = re.findall(r"resuming at epoch (\d+) from the checkpoint of epoch", run.output)
    assert after_the_loss and int(after_the_loss[0]) >= 1, run.output[-6000:]
    assert f"{run.cluster}-r2" in run.output
    written = checkpoint_of_step(Path(mlflow_run.data.tags["gpuflow.checkpoints"]), int(resumed[1]))
    trained = steps_done(step_log)
    lost_pid = trained[0][1]
    # the node trains on while Slurm takes it (scancel, then KillWait): bounded by its own last step, not the scancel
    lost_last_step = max(at for at, pid in trained if pid == lost_pid)
    assert noticed_at < written <= lost_last_step + 2, "the lost node's checkpoint, after the notice"
    assert len({pid for _, pid in trained if pid != lost_pid}) >= 2, "both replacements trained"
    redone = [at for at, pid in trained if pid == lost_pid and at > written]
    # Redone: the step in flight, and any whose checkpoint Ray Train's controller had not registered when the node
    # went (a loaded machine delays that by a step or two). Without the notice's checkpoints: every step since the
    # epoch began, 3 + the notice's lead / pace = over 30.
    assert len(redone) <= 3, f"seconds redone, not the notice's lead: {len(redone)} steps"
    assert_nothing_left(slurm_infra, run.cluster, f"{run.cluster}-r1", f"{run.cluster}-r2")
    print(
        f"\n[spot notice on slurm] replacement asked for {killed - provisioning:.0f}s before the loss; resumed at "
        f"step {resumed[1]}, {len(redone)} step(s) redone; [scancel on slurm] resumed at epoch {after_the_loss[0]}, "
        f"run ended {time.monotonic() - lost_at:.0f}s after the scancel; recovery (the longer) "
        f"{mlflow_run.data.metrics['recovery_seconds']:.0f}s, lost compute "
        f"{mlflow_run.data.metrics['lost_compute_seconds']:.0f}s; test wall {time.monotonic() - started:.0f}s"
    )
    report("spot notice, then scancel", run, mlflow_run.data.metrics)


def checkpoint_of_step(checkpoints: Path, step: int) -> float:
    """When the checkpoint taken on the notice at `step` (epoch 0) was written."""
    import torch

    for path in checkpoints.glob("checkpoint_*/checkpoint.pt"):
        state = torch.load(path, weights_only=False)
        if state["epoch"] == 0 and state.get("within_epoch", {}).get("step") == step:
            return path.stat().st_mtime
    raise AssertionError(f"no checkpoint of epoch 0 step {step} under {checkpoints}")
