"""The SkyPilot backend: the spec → sky.Task mapping (SkyPilot's own objects, offline) and the lifecycle
against an SDK double that behaves like SkyPilot where no cloud can be reached."""

import pickle
import threading
import time
from pathlib import Path

import pytest
import sky
import yaml

from gpuflow.cluster.backends import Job, NoCapacity, cluster_name_for
from gpuflow.cluster.backends.skypilot import (
    DEFAULT_SETUP,
    RUN,
    WHEEL_MOUNT,
    SkyPilotBackend,
    build_task,
    resources_for,
    task_yaml,
)
from gpuflow.cluster.backends.skypilot.options import no_capacity
from gpuflow.cluster.spec import parse_spec
from gpuflow.flows.experiment import run_experiment
from tests.support.processes import wait_until
from tests.support.repo import A_LOOP, REPO
from tests.support.runs import flow_logs, mlflow_run_of
from tests.support.sky_double import FakeSky

NAME = cluster_name_for("6f1e0c52-61d4-4a4b-8a0e-5a3b9d2c7e11")


def gpu_spec(**compute):
    return parse_spec(
        {
            **A_LOOP,
            "name": "digits-gpu",
            "compute": {
                "backend": "skypilot",
                "num_nodes": 2,
                "workers_per_node": 1,
                "accelerators": ["H100:1", "A100:1"],
                "use_spot": True,
                "region": "us-east-1",
                "cloud": "aws",
                "disk_size_gb": 100,
                "max_hourly_cost_usd": 9.5,
                **compute,
            },
            "precision": "bf16",
            "tracking": {"uri": "https://mlflow.example.com"},
            "storage": {"checkpoints": "s3://bucket/ckpt"},
            "data": {"train": "s3://bucket/train.parquet", "validation": "s3://bucket/val.parquet"},
            "secrets": ["HF_TOKEN"],
            "envs": {"NCCL_DEBUG": "WARN"},
        }
    )


def test_task_from_spec(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    spec = gpu_spec()
    task = build_task(spec, run_name="digits-gpu-2026", env={"GPUFLOW_MLFLOW_RUN_ID": "abc"})
    assert task.num_nodes == 2 and task.run == RUN
    assert "pip install -e ." in task.setup and "gpuflow-" in task.setup
    assert task.envs["GPUFLOW_MLFLOW_RUN_ID"] == "abc" and task.envs["NCCL_DEBUG"] == "WARN"
    assert parse_spec(yaml.safe_load(task.envs["GPUFLOW_SPEC_JSON"])) == spec
    [h100, a100] = resources_for(spec)
    assert (h100.accelerators, a100.accelerators) == ({"H100": 1}, {"A100": 1})
    assert h100.use_spot and h100.region == "us-east-1" and str(h100.cloud).lower() == "aws"
    assert h100.disk_size == 100 and h100.max_hourly_cost == 9.5
    # the YAML round-trips through SkyPilot's own parser
    again = sky.Task.from_yaml_config(yaml.safe_load(task_yaml(spec)))
    assert again.num_nodes == 2 and again.run == RUN


def test_own_setup_replaces_the_default():
    assert build_task(gpu_spec()).setup.startswith(DEFAULT_SETUP.split("{")[0])
    own = gpu_spec().model_copy(update={"setup": "uv pip install -e ."})
    assert build_task(own).setup == "uv pip install -e ."  # e.g. an image that has no pip, or has it all
    assert not build_task(own).file_mounts


def test_nodes_install_this_gpuflow_from_a_wheel_without_an_index(gpuflow_home, tmp_path):
    """The default setup installs the client's gpuflow from a wheel that a file mount carries to every node."""
    import subprocess
    import sys
    import zipfile
    from importlib import metadata

    task = build_task(gpu_spec())
    [(remote, local)] = task.file_mounts.items()
    assert remote == WHEEL_MOUNT and local.startswith(str(gpuflow_home))
    [wheel] = Path(local).glob("*.whl")
    assert wheel.name == f"gpuflow-{metadata.version('gpuflow')}-py3-none-any.whl"
    assert f"pip install {WHEEL_MOUNT}/{wheel.name}" in task.setup
    # the same mapping survives SkyPilot's own YAML round trip
    assert sky.Task.from_yaml_config(task.to_yaml_config()).file_mounts == {WHEEL_MOUNT: local}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {
        "gpuflow/cluster/job/__main__.py",
        "gpuflow/cluster/job/tracking.py",
        "gpuflow/flows/cli/__init__.py",
        "gpuflow/tasks/compute.py",
    } <= names
    # pip accepts it offline, and what it installs runs the job's module
    target = tmp_path / "installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
    )
    job = Path("cluster", "job", "__main__.py")
    assert (target / "gpuflow" / job).read_bytes() == (REPO / job).read_bytes()
    assert (target / "bin" / "gpuflow").is_file()


def test_one_skypilot_job_sets_up_and_trains(caplog):
    """The launch starts setup and training as one SkyPilot job: the flow submits no second job (`exec` would add a
    request and a job start), and that job carries the run's environment."""
    caplog.set_level("INFO", logger="gpuflow")
    fake, lines = FakeSky(), []
    backend = SkyPilotBackend(fake)
    handle = backend.launch(gpu_spec(), NAME, job=Job("digits-6f1e", {"GPUFLOW_MLFLOW_RUN_ID": "r1"}))
    [(_, _, _, _, config)] = [c for c in fake.calls if c[0] == "launch"]
    assert config["setup"] and config["run"] == RUN
    assert config["envs"]["GPUFLOW_MLFLOW_RUN_ID"] == "r1" and config["envs"]["GPUFLOW_RUN_NAME"] == "digits-6f1e"
    job_id = backend.exec(handle, gpu_spec(), "digits-6f1e", {"GPUFLOW_MLFLOW_RUN_ID": "r1"})
    assert not [c for c in fake.calls if c[0] == "exec"]
    assert backend.tail_logs(handle, job_id, lines.append) == 0
    assert any("setup and training run as SkyPilot job 1" in line for line in caplog.messages)
    assert any("epoch 0" in line for line in lines)


def test_each_job_gets_its_own_ray_token_as_a_secret():
    fake = FakeSky()
    backend = SkyPilotBackend(fake)
    handle = backend.launch(gpu_spec(), NAME, job=Job("run", {}))
    backend.exec(handle, gpu_spec(), "run", {})  # the launch's job
    backend.exec(handle, gpu_spec(), "run", {})  # another one
    configs = [c[4] for c in fake.calls if c[0] == "launch"] + [c[2] for c in fake.calls if c[0] == "exec"]
    tokens = {config["secrets"]["RAY_AUTH_TOKEN"] for config in configs}
    assert len(configs) == 2 and len(tokens) == 2 and all(len(token) == 64 for token in tokens)
    assert not any("RAY_AUTH_TOKEN" in config["envs"] for config in configs)  # secrets, not envs: SkyPilot redacts them


def test_plan_never_shows_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    text = task_yaml(gpu_spec())
    assert "hf_secret_value" not in text and "HF_TOKEN: <redacted>" in text


def test_capacity_error_leaves_nothing():
    fake = FakeSky("capacity")
    with pytest.raises(NoCapacity, match="Relax") as refused:  # SkyPilot's ResourcesUnavailableError, each reason
        SkyPilotBackend(fake).launch(gpu_spec(), NAME)
    assert fake.clusters == {}
    # the provision task returns it as its answer, which a persisted result pickles: it comes back whole
    again = pickle.loads(pickle.dumps(refused.value))
    assert (str(again), again.reasons, again.spot) == (str(refused.value), refused.value.reasons, refused.value.spot)


# SkyPilot 0.14.1's own message, as the Slurm tier got it: a partition that refused the launch, spot not tried
SLURM_REFUSAL = (
    "\x1b[31mFailed to provision all possible launchable resources.\x1b[0m Relax the task's resource requirements: "
    "1x Slurm(cpus=1+)\nTo keep retrying until the cluster is up, use the `--retry-until-up` flag.\n"
    "Reasons for provision failures (for details, please check the log above):\nProvision failures (tried 1 infra):"
    "\n\n\u2717 Slurm (skyci) \u2014 (cpus=1, mem=1, ...)\n  Failed to acquire resources in closed for "
    "{Slurm([Spot], cpus=1+), Slurm(cpus=1+)}.\n"
)
TWO_AT_ONE_PLACE = (
    "Reasons for provision failures (for details, please check the log above):\nProvision failures (tried 2 infra):"
    "\n\n\u2717 AWS (us-east-1) \u2014 (gpus=H100:1, p5.4xlarge, ...)\n  InsufficientInstanceCapacity (spot)\n\n"
    "\u2717 AWS (us-east-1) \u2014 (gpus=H100:1, p5.4xlarge, ...)\n  InsufficientInstanceCapacity (on-demand)\n"
)


@pytest.mark.parametrize(
    "options, message, reasons",
    [
        (
            [{"infra": "slurm/skyci", "use_spot": True}, {"infra": "slurm/skyci/closed"}],
            SLURM_REFUSAL,
            ["not tried: slurm has no spot instances", "Failed to acquire resources in closed for {Slurm([Spot]"],
        ),
        (
            [
                {"infra": "aws/us-east-1", "accelerators": "H100:1", "use_spot": True},
                {"infra": "aws/us-east-1", "accelerators": "H100:1"},
            ],
            TWO_AT_ONE_PLACE,
            ["InsufficientInstanceCapacity (spot)", "InsufficientInstanceCapacity (on-demand)"],
        ),
    ],
    ids=["spot never tried on slurm", "two options at one place"],
)
def test_no_capacity_names_each_option_with_its_own_reason(options, message, reasons):
    """SkyPilot's block headers name the place and GPUs, never spot: each option gets the block of its own try, in
    the order tried, and an option SkyPilot never tried says so; no colour codes reach the user."""
    spec = parse_spec(
        {
            **A_LOOP,
            "compute": {"backend": "skypilot", "options": options},
            "tracking": {"uri": "http://127.0.0.1:1"},
            "storage": {"checkpoints": "s3://bucket/ckpt"},
        }
    )
    refusal = no_capacity(spec, sky.exceptions.ResourcesUnavailableError(message))
    assert [why.split(" {")[0] for _, why in refusal.reasons] == [reason.split(" {")[0] for reason in reasons]
    assert all(f"option {n}" in str(refusal) for n in (1, 2)) and "\x1b" not in str(refusal)


def test_setup_failure_leaves_a_cluster_that_down_removes(caplog):
    caplog.set_level("INFO", logger="gpuflow")
    fake = FakeSky("setup")
    backend = SkyPilotBackend(fake)
    with pytest.raises(sky.exceptions.CommandError):
        backend.launch(gpu_spec(), NAME)  # setup alone: the launch waits for it
    assert NAME in fake.clusters  # as SkyPilot does, even with down=True
    assert any("No matching distribution" in line for line in caplog.messages)  # the setup log is shown
    assert backend.down(NAME) is True and fake.clusters == {}
    assert backend.down(NAME) is False  # idempotent


def test_a_setup_failure_in_the_job_says_so():
    fake, lines = FakeSky("setup"), []
    backend = SkyPilotBackend(fake)
    handle = backend.launch(gpu_spec(), NAME, job=Job("run", {}))
    assert backend.tail_logs(handle, backend.exec(handle, gpu_spec(), "run", {}), lines.append) != 0
    assert any("No matching distribution" in line for line in lines)
    assert lines[-1].endswith(f"setup on {NAME} failed (FAILED_SETUP); its log is above")
    assert not any("epoch 0" in line for line in lines)  # training never started


def test_every_launch_sets_autostop_and_autodown():
    fake = FakeSky()
    spec = gpu_spec()
    SkyPilotBackend(fake).launch(spec, NAME)
    [(verb, name, idle_minutes, down, _)] = [c for c in fake.calls if c[0] == "launch"]
    assert (name, idle_minutes, down) == (NAME, spec.limits.idle_minutes_to_autostop, True)
    assert fake.clusters[NAME]["autostop"] == spec.limits.idle_minutes_to_autostop


def test_down_cancels_a_launch_in_flight():
    fake = FakeSky(launch_s=5)
    backend = SkyPilotBackend(fake)
    failure = []
    launcher = threading.Thread(target=lambda: failure.append(_launch_error(backend)))
    launcher.start()
    wait_until(
        lambda: any(r.name == "launch" and r.status == "RUNNING" for r in list(fake.requests.values())),
        30,
        "a launch in flight",
    )
    started = time.monotonic()
    backend.down(NAME)
    launcher.join(timeout=10)
    assert time.monotonic() - started < 5  # did not wait for the launch to finish
    assert isinstance(failure[0], sky.exceptions.RequestCancelled)
    assert any(call[0] == "api_cancel" and call[1] for call in fake.calls)
    assert fake.clusters == {}


def _launch_error(backend):
    try:
        backend.launch(gpu_spec(), NAME)
    except BaseException as exc:  # noqa: BLE001
        return exc


def spec_on_the_double(gpuflow_home, compute: dict, limits: dict):
    """A digits spec for the SkyPilot double: its stores and data under the test's gpuflow home."""
    return parse_spec(
        {
            **A_LOOP,
            "compute": {"backend": "skypilot", **compute},
            "limits": limits,
            "tracking": {"uri": f"sqlite:///{gpuflow_home}/mlflow.db"},
            "storage": {"checkpoints": str(gpuflow_home / "checkpoints")},
            "data": {
                "train": str(gpuflow_home / "train.parquet"),
                "validation": str(gpuflow_home / "val.parquet"),
                "generate": "experiments.digits:write_parquet",
            },
        }
    )


@pytest.fixture
def sky_flow(monkeypatch, gpuflow_home, prefect_server):
    """Runs the real flow with the SkyPilot backend on the SDK double; stores on this machine count as shared."""
    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))

    def run(scenario, compute: dict | None = None, **double):
        fake = FakeSky(scenario, **double)
        monkeypatch.setattr("gpuflow.cluster.backends.skypilot.load_sdk", lambda: fake)
        # no price catalog offline: price it as a user may; a short wait for capacity
        spec = spec_on_the_double(
            gpuflow_home,
            {"accelerators": "H100:1", "infra": "aws", **(compute or {})},
            {"hourly_rate_usd": 2.5, "max_queue_minutes": 0.05},
        )
        state = run_experiment(spec, return_state=True)
        flow_run_id = state.state_details.flow_run_id
        _, mlflow_run = mlflow_run_of(spec.tracking_uri, flow_run_id, spec.experiment_name)
        return fake, state, mlflow_run, flow_logs(flow_run_id)

    return run


@pytest.mark.parametrize(
    "scenario, status, evidence",
    [
        ("ok", "FINISHED", "SkyPilot job 1"),
        ("capacity", "FAILED", "Relax the task's resource requirements"),
        ("setup", "FAILED", "No matching distribution found"),
        ("job", "FAILED", "fail_at_epoch=1: failing on purpose"),
    ],
)
def test_flow_lifecycle_on_skypilot(sky_flow, scenario, status, evidence):
    fake, state, mlflow_run, logs = sky_flow(scenario)
    assert state.is_completed() == (scenario == "ok"), state.message
    assert mlflow_run.info.status == status
    assert evidence in logs
    assert fake.clusters == {}  # whatever happened, nothing is left billing
