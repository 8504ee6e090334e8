"""gpuflow from a project of the user's own: pip install from a path into a fresh virtualenv, `gpuflow init`,
`validate`, `run` on 2 local nodes; the loop imports only ray.train and torch and is tracked anyway."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.support.processes import processes_of
from tests.support.repo import REPO

pytestmark = pytest.mark.full


def tracked_files(repo: Path, into: Path) -> Path:
    """A copy of the repo's tracked files: pip builds there, leaving no build output in the repo."""
    files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / name, into / name)
    return into


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new virtualenv with gpuflow pip-installed from a path (not editable). Its dependencies come from this
    test's environment through a .pth line, so that the test does not download gigabytes of wheels."""
    root = tmp_path_factory.mktemp("venv")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    source = tracked_files(REPO, root / "gpuflow-src")
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(source),
        ],
        check=True,
    )
    return venv


def gpuflow(venv: Path, project: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    # output to files, not pipes: a process the command leaves behind would hold a pipe open, and hang us
    out, err = project.parent / "stdout.txt", project.parent / "stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.run(
            [str(venv / "bin" / "gpuflow"), *args], cwd=project, env=env, stdout=stdout, stderr=stderr, timeout=900
        ).returncode
    result = subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())
    print(result.stdout[-4000:], result.stderr[-4000:])
    return result


def test_init_validate_run_in_an_own_project(fresh_venv, tmp_path):
    project = tmp_path / "my-regression"
    project.mkdir()
    home = project / ".gpuflow"
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "GPUFLOW_", "MLFLOW_"))
    }
    env.update(GPUFLOW_STACK="manual")  # a run here leaves no warm stack: the test's processes stop with it
    env.update(
        GPUFLOW_HOME=str(home),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PYTHONPATH="",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
    )  # a busy machine starts Prefect slowly

    # the installed gpuflow is the one that runs, not this repo
    where = subprocess.run(
        [str(fresh_venv / "bin" / "python"), "-c", "import gpuflow.cluster as c; print(c.__file__)"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(REPO) not in where and "site-packages" in where
    # the project has packages of its own named like the repo's folders: gpuflow must never import them
    for name in ("flows", "tasks", "cluster"):
        (project / name).mkdir()
        (project / name / "__init__.py").write_text(f"raise ImportError('the project's own {name}, not gpuflow')\n")

    assert gpuflow(fresh_venv, project, "init", env=env).returncode == 0
    loop = (project / "train.py").read_text()
    imports = {line.split()[1] for line in loop.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"os", "tempfile", "ray.train", "ray.train.torch", "torch"}, imports
    assert gpuflow(fresh_venv, project, "init", env=env).returncode == 2  # never overwrites the user's files

    two_nodes = ["--set", "compute.num_nodes=2", "--set", "compute.workers_per_node=1", "--set", "train.epochs=4"]
    validated = gpuflow(fresh_venv, project, "validate", "experiment.yaml", *two_nodes, env=env)
    assert validated.returncode == 0 and "2 node(s) × 1 worker(s)" in validated.stdout

    ran = gpuflow(fresh_venv, project, "run", "experiment.yaml", *two_nodes, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("my-regression")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train_loss", "val_loss"):  # every report, at step = the report's epoch
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 1, 2, 3]
    val_loss = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "val_loss"), key=lambda m: m.step)]
    assert val_loss == sorted(val_loss, reverse=True) and val_loss[-1] < val_loss[0] / 2  # it learns y = 3x - 1
    checkpoint = run.data.tags["gpuflow.checkpoint"]
    assert Path(checkpoint, "state.pt").is_file() and run.data.tags["gpuflow.checkpoint_step"] == "3"
    # the loop logged no model: its last checkpoint is in the run instead
    assert [f.path for f in client.list_artifacts(run.info.run_id, "checkpoint")] == ["checkpoint/state.pt"]
    assert processes_of(home) == []
