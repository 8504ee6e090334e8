"""Workers anywhere: a Prefect worker in an empty folder, with a Python of its own, runs the deployed commit, pulled
from the project's git remote (a bare repository here), and a cancel from the UI reaches its run. The worker's venv
borrows this one's dependencies (torch, Ray, ...), not gpuflow: gpuflow is installed from the remote.

    .venv/bin/python -m pytest --full tests/test_workers.py -s

The deployed commit adds a training loop that the worker's own install (the commit before) does not have: a run
that trains ran the pulled code. The run, scheduled a few seconds ahead, trains until a cancel from the UI.
"""

import contextlib
import os
import subprocess
import sys
import sysconfig
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.support.processes import processes_of
from tests.support.repo import REPO
from tests.support.runs import mlflow_runs_of
from tests.support.servers import BIN, base_env, prefect_server, started
from tests.support.tiers import require

pytestmark = pytest.mark.full

MARKER_LOOP = '''"""Only in the deployed commit: the paced digits loop under another name, its digits in memory."""
from tests.loops import paced


def train_loop(config):
    paced.without_ray_data(config)
'''


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        },
    ).stdout.strip()


@pytest.fixture(scope="module")
def remote_and_worker_python(tmp_path_factory):
    """A bare repository with this project's HEAD, then a commit that adds experiments/marker.py (the deployed one);
    a fresh venv, in a folder of its own, with gpuflow installed from the remote at the commit before."""
    require(subprocess.run(["git", "--version"], capture_output=True).returncode == 0, "git", "apt-get install git")
    base = tmp_path_factory.mktemp("workers")
    remote, checkout = base / "remote.git", base / "checkout"
    git("clone", "--quiet", "--bare", str(REPO), str(remote), cwd=base)
    git("clone", "--quiet", str(remote), str(checkout), cwd=base)
    before = git("rev-parse", "HEAD", cwd=checkout)
    (checkout / "experiments" / "marker.py").write_text(MARKER_LOOP)
    git("add", "experiments/marker.py", cwd=checkout)
    git("commit", "--quiet", "-m", "A loop only the deployed commit has", cwd=checkout)
    git("push", "--quiet", "origin", "HEAD", cwd=checkout)
    venv = base / "worker-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    worker_python = venv / "bin" / "python"
    lend_dependencies(worker_python)
    subprocess.run(
        [
            str(worker_python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"git+file://{remote}@{before}",
        ],
        check=True,
    )
    return remote, checkout, worker_python


def lend_dependencies(worker_python: Path) -> None:
    """Puts this venv's site-packages on the worker venv's path, after its own: pip finds torch, Ray, Prefect and
    MLflow already there, so the installs (here and the pull step's) fetch and build gpuflow alone, not 3 GB of
    wheels. gpuflow itself is the worker venv's own: its site-packages come first, and this venv's editable
    install of gpuflow is a .pth file that a path added this way does not run."""
    theirs = subprocess.run(
        [str(worker_python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(theirs) / "lent-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")


@contextlib.contextmanager
def worker(api_url: str, worker_python: Path, folder: Path):
    """`prefect worker start --pool gpuflow-process` in an empty folder, with the fresh venv's Python only."""
    folder.mkdir(parents=True)
    env = base_env(
        PREFECT_API_URL=api_url,
        GPUFLOW_HOME=str(folder / ".gpuflow"),
        PATH=f"{worker_python.parent}:/usr/bin:/bin",
        PREFECT_WORKER_QUERY_SECONDS="2",
    )
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    command = [str(worker_python), "-m", "prefect", "worker", "start", "--pool", "gpuflow-process"]
    with started(command, folder / "worker.log", env, cwd=folder) as process:
        yield process


def final(client, flow_run_id, timeout_s: float = 600, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.name} still {run.state_name}\n" + (log.read_text()[-4000:] if log else ""))
        time.sleep(2)


def mlflow_run_in(folder: Path, flow_run_id):
    """The flow run's MLflow run in the project folder's own store, or None while there is none."""
    _, runs = mlflow_runs_of(f"sqlite:///{folder / '.gpuflow' / 'mlflow.db'}", flow_run_id)
    return runs[0] if runs else None


def test_a_worker_elsewhere_runs_the_deployed_commit_and_a_cancel_reaches_it(remote_and_worker_python, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling, Scheduled

    remote, checkout, worker_python = remote_and_worker_python
    folder = tmp_path / "empty-folder"
    with prefect_server(tmp_path / "prefect") as api_url, temporary_settings({PREFECT_API_URL: api_url}):
        deployed = subprocess.run(
            [str(BIN / "gpuflow"), "deploy", "--only", "run-experiment"],
            cwd=checkout,
            env=base_env(PREFECT_API_URL=api_url),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert f"workers will pull {remote} at {git('rev-parse', 'HEAD', cwd=checkout)[:12]}" in deployed.stderr
        with get_client(sync_client=True) as client, worker(api_url, worker_python, folder):
            deployment = client.read_deployment_by_name("run-experiment/run-experiment")
            spec = {**deployment.parameters["spec"]}
            spec["train"] = {
                **spec["train"],
                "loop": "experiments.marker:train_loop",
                "epochs": 400,
                "params": {"hidden": 32, "pace_s": 1},
            }
            spec["compute"] = {**spec["compute"], "workers_per_node": 1}
            spec["data"] = None  # what a worker elsewhere runs is the point, not Ray Data's ingest
            # scheduled, not clicked: it trains at a walking pace until a cancel from the UI stops it
            soon = datetime.now(timezone.utc) + timedelta(seconds=5)
            scheduled = client.create_flow_run_from_deployment(
                deployment.id, parameters={"spec": spec}, state=Scheduled(scheduled_time=soon)
            ).id
            deadline = time.monotonic() + 300
            while not ((run := mlflow_run_in(folder, scheduled)) and "train_loss" in run.data.metrics):
                assert time.monotonic() < deadline, (folder / "worker.log").read_text()[-4000:]
                time.sleep(2)
            client.set_flow_run_state(scheduled, Cancelling(), force=True)  # what the UI's Cancel does
            stopped = final(client, scheduled, timeout_s=180, log=folder / "worker.log")
    assert stopped.state.is_cancelled(), stopped.state.message
    # experiments.marker exists only in the deployed commit: the run trained the pulled code, until the cancel
    assert mlflow_run_in(folder, scheduled).info.status == "KILLED"
    assert processes_of(folder / ".gpuflow") == [] and processes_of(folder) == []
