"""What the README shows a user works: every `gpuflow` command line in it parses, every spec it names and every
spec in experiments/ validates (quick tier), and every shipped spec and `gpuflow init`'s starter runs (whole matrix)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.spec import load_spec
from gpuflow.flows.cli import command_line
from tests.support.processes import processes_of
from tests.support.repo import REPO

SHIPPED_SPECS = sorted((REPO / "experiments").glob("*.yaml"))
PLACEHOLDER_SPECS = {"my.yaml"}  # a name the README uses for "your spec"
STARTER_SPEC = "experiment.yaml"  # what `gpuflow init` writes


def readme_command_lines() -> list[str]:
    """Each `gpuflow ...` command in the code blocks of the README and of docs/ (a `&&` chain's parts, comments and
    prompts removed)."""
    text = "\n".join(path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    commands = []
    for language, block in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        if language not in ("bash", "sh", "shell", "console", "text", ""):
            continue
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.strip().removeprefix("$ ")
                if re.match(r"(\S*/)?gpuflow(\s|$)", part):
                    commands.append(shlex.join(["gpuflow", *shlex.split(part, comments=True)[1:]]))
    return commands


README_COMMANDS = readme_command_lines()


def test_the_readme_shows_commands():
    assert len(README_COMMANDS) >= 10 and any(
        c.startswith("gpuflow run experiments/digits.yaml") for c in README_COMMANDS
    )


@pytest.mark.parametrize("command", README_COMMANDS)
def test_every_command_line_in_the_readme_parses_and_its_spec_loads(command, tmp_path, monkeypatch):
    try:
        args = command_line().parse_args(shlex.split(command)[1:])
    except SystemExit:
        pytest.fail(f"the README shows a command gpuflow refuses: {command}")
    spec = getattr(args, "spec", None)
    if spec is None or spec in PLACEHOLDER_SPECS:
        return
    if spec == STARTER_SPEC:  # written by `gpuflow init`, as the README shows just before
        assert init_starter(tmp_path) == 0
        monkeypatch.chdir(tmp_path)
    else:
        assert (REPO / spec).is_file(), f"the README names a spec that is not in the repository: {spec} ({command})"
        monkeypatch.chdir(REPO)
    load_spec(spec, getattr(args, "overrides", []))  # raises SpecError naming the field


def init_starter(folder: Path) -> int:
    from gpuflow.flows.cli import main

    return main(["init", str(folder)])


@pytest.mark.parametrize("path", SHIPPED_SPECS, ids=lambda path: path.name)
def test_every_shipped_spec_validates(path, monkeypatch, capsys, gpuflow_home):
    """With every check `gpuflow validate` makes (the loop's import, data, storage, tracking). A cloud spec's bucket
    and tracking server are placeholders that cannot answer here: they are swapped for ones that can."""
    from gpuflow.flows.cli import main

    monkeypatch.chdir(REPO)
    overrides = []
    if load_spec(path).compute.backend != "local":
        monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))  # stores here count as shared
        overrides = [
            "--set",
            f"storage.checkpoints={gpuflow_home}/checkpoints",
            "--set",
            f"tracking.uri=sqlite:///{gpuflow_home}/mlflow.db",
            "--set",
            "limits.hourly_rate_usd=3",
        ]  # SkyPilot's price catalog is not downloadable here
    assert main(["validate", str(path.relative_to(REPO)), *overrides]) == 0, capsys.readouterr()


# -- the whole matrix: each shipped spec runs, tiny -------------------------------------------------------------------
TINY = {  # one epoch, small enough for a CPU; everything else as shipped
    # one trial: the shipped sweep's fields, one of each of its values (tests/test_sweep.py runs trials side by side)
    "digits-sweep.yaml": [
        "train.epochs=1",
        "sweep.early_stopping=null",
        "sweep.parameters={train.lr: {grid: [0.002]}, train.params.hidden: {grid: [32]}}",
    ],
    # the cloud specs on this machine's local backend: their loop, params, precision and profile as shipped
    "digits-gpu.yaml": [
        "train.epochs=1",
        "compute.backend=local",
        "compute.accelerators=null",
        "tracking.uri=null",
        "storage.checkpoints=null",
        "limits.max_cost_usd=null",
    ],
    "chargpt-gpu.yaml": [
        "train.epochs=1",
        "compute.backend=local",
        "compute.accelerators=null",
        "tracking.uri=null",
        "storage.checkpoints=null",
        "limits.max_cost_usd=null",
        "limits.min_gpu_utilization=null",
        "train.params.n_layer=1",
        "train.params.n_embd=64",
        "train.params.n_head=2",
        "train.params.block_size=64",
        "train.params.steps_per_epoch=30",
        "profile.after=2",
        "profile.steps=2",
    ],
}


def gpuflow_run(spec: Path, overrides: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    """`gpuflow run` as a user types it, in `cwd`: the spec's relative paths mean what they mean there. On the tests'
    Prefect server (the `prefect_server` fixture), as a user with PREFECT_API_URL set: a new user's temporary API is
    started by the run in tests/test_own_project.py (and tests/test_temporary_api.py), not once per shipped spec."""
    from prefect.settings import PREFECT_API_URL

    command = [str(Path(sys.executable).parent / "gpuflow"), "run", str(spec)]
    for override in overrides:
        command += ["--set", override]
    env = {**os.environ, "GPUFLOW_HOME": str(home), "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.full
@pytest.mark.parametrize("name", sorted(TINY), ids=str)
def test_every_shipped_spec_runs(name, prefect_server, tmp_path, gpuflow_home):
    run_shipped(name, TINY[name], tmp_path, gpuflow_home)


def run_shipped(name: str, overrides: list[str], tmp_path: Path, home: Path) -> list:
    """`gpuflow run experiments/NAME` in a project folder of its own (a copy of experiments/), so relative data paths
    land in the test's folder; checks that it finished and left nothing, and returns its MLflow runs."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(REPO / "experiments", project / "experiments")
    done = gpuflow_run(Path("experiments") / name, overrides, cwd=project, home=home)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs and {run.info.status for run in runs} == {"FINISHED"}, [(r.info.run_name, r.info.status) for r in runs]
    assert list(project.rglob("*.parquet"))  # the data, made where the spec's relative paths point: here
    assert processes_of(home) == []
    return runs


def test_every_shipped_spec_has_a_tiny_run():
    # digits.yaml runs in tests/test_digits_run.py, chargpt-cpu.yaml as shipped in tests/test_telemetry.py;
    # `gpuflow init`'s starter in tests/test_own_project.py
    assert {path.name for path in SHIPPED_SPECS} - {"digits.yaml", "chargpt-cpu.yaml"} == set(TINY)
