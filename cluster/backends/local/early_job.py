"""The early job: the job's process, started before its run exists so that its imports (Ray, torch, MLflow: seconds of
CPU) are done by the time the run hands it over (cluster/job/__main__.py, --handoff).

`gpuflow run` starts one beside the cluster it prewarms. The warm stack starts one beside its spare cluster; the run
that claims the spare takes that job over if it was started in the same environment as the run's would be, else
stops it and starts its own. A job taken over is not the run's child: it writes its exit code to a file
(`exit_code_file`) for the run to read."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from gpuflow.cluster.config import STARTING_ENVIRONMENT, local_ray_mode
from gpuflow.cluster.protocol import JobEnv
from gpuflow.cluster.spec.model import TRACKING_CREDENTIALS
from gpuflow.cluster.util.files import write_atomically

HANDOFF_FILE = "job.json"  # in the cluster's temp dir: what the early job waits for (its spec, address, env)
OWNER_FILE = "owner"  # in the cluster's temp dir: the pid of the process that claimed a spare (its new owner)


def ray_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment (or `base`), for a Ray process or a job."""
    env = dict(os.environ if base is None else base)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nodes and drivers on 127.0.0.1 (see library facts)
    env.pop("RAY_ADDRESS", None)  # never attach to a cluster we did not start
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if local_ray_mode(env) == "lean":
        for name, value in LEAN_RAY.items():
            env.setdefault(name, value)  # a value the user set wins
    return env


# What a lean local Ray leaves out (GPUFLOW_LOCAL_RAY): each costs CPU-seconds a run, on a machine whose few cores
# train. Ray reads RAY_<setting> in every process it starts; Ray Train reads its own in the job's driver.
LEAN_RAY = {
    "RAY_enable_metrics_collection": "0",  # the daemons' and workers' metrics, exported to the dashboard agent
    "RAY_TRAIN_METRICS_ENABLED": "0",  # Ray Train's controller and worker metrics callbacks
}


# What a process reads of its environment as it starts and imports (Python's path, Ray's settings, the loader's, CUDA's,
# the threads): an early job started with other values than the run's would be cannot be taken over. The rest of its
# environment is replaced by the run's at the hand-over (`handoff_environment`).
READ_AT_START = (
    "PYTHON",
    "RAY_",
    "LD_",
    "CUDA",
    "NVIDIA",
    "OMP_",
    "MKL_",
    "TORCH",
    "PATH",
    "VIRTUAL_ENV",
    "HOME",
    "TMPDIR",
    "GPUFLOW_HOME",
)


def job_environment() -> dict[str, str]:
    """What an early job started here runs with: the environment this process was started with (not what its
    libraries set since), for Ray, less Prefect's settings (the job imports no orchestrator, and a run points its own
    at the API it uses). What the run adds comes with the hand-over."""
    return {name: value for name, value in ray_env(STARTING_ENVIRONMENT).items() if not name.startswith("PREFECT_")}


def environment_digest() -> str:
    """What an early job started here would read as it starts: one started by another process (the stack) is taken
    over only when it read the same."""
    return digest_of({name: value for name, value in job_environment().items() if name.startswith(READ_AT_START)})


# What a cluster's Ray processes inherit beyond job_environment() and no run's workers read: the shell's bookkeeping
# and the terminal's.
SHELL_NOISE = {"_", "PWD", "OLDPWD", "SHLVL", "TERM", "COLUMNS", "LINES"}


def credentials(secrets: Iterable[str] = ()) -> set[str]:
    """What the warm stack's processes never hold, the run's `secrets` and the tracking server's credentials: a run's
    workers get those from the run itself (runtime_env, cluster/spec: job_secrets), never from whoever started the
    cluster, so none outlives its run in a process kept for the next."""
    return {*TRACKING_CREDENTIALS, *secrets}


def cluster_environment_digest(secrets: Iterable[str] = ()) -> str:
    """What a cluster this process starts runs its Ray processes, and so the run's workers, with: job_environment()
    (Prefect's settings aside: no Ray process imports Prefect), less SHELL_NOISE and the `credentials`. A spare that
    another process (the stack) started serves a run only where they match: a run's workers never see another
    shell's values."""
    leave_out = SHELL_NOISE | credentials(secrets)
    return digest_of({name: value for name, value in job_environment().items() if name not in leave_out})


def digest_of(environment: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(environment.items())).encode()).hexdigest()


def handoff_environment(started_with: dict[str, str], runs_with: dict[str, str]) -> None:
    """Makes this process's environment the run's: its values set, what only the starter's had removed (what the
    imports since set themselves stays)."""
    for name in set(started_with) - set(runs_with):
        os.environ.pop(name, None)
    os.environ.update(runs_with)


def start(cluster_folder: Path, temp_dir: str, session: int, cwd: str) -> subprocess.Popen:
    """Starts the early job of a cluster (its log: job.log in the cluster's folder)."""
    with open(cluster_folder / "job.log", "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "gpuflow.cluster.job",
                "--handoff",
                str(Path(temp_dir) / HANDOFF_FILE),
                "--starter",
                str(os.getpid()),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
            env={**job_environment(), **JobEnv(local_cluster_session=session).to_env()},
        )


def hand_over(temp_dir: str, run: dict) -> None:
    """Gives the cluster's early job its run: spec, address, run name, folder, and the environment (this process's
    for a job, with the run's `env`) it is to run with."""
    run = {**run, "env": {**job_environment(), **run["env"]}}
    write_atomically(Path(temp_dir) / HANDOFF_FILE, json.dumps(run))


def exit_code_file(temp_dir: str, pid: int | str) -> Path:
    return Path(temp_dir) / f"job-{pid}.exit"


def exit_code(temp_dir: str, pid: int | str) -> int:
    """The exit code of a job that is not this process's child, from the file it wrote as it exited; a job that
    wrote none was killed."""
    try:
        return int(exit_code_file(temp_dir, pid).read_text())
    except (FileNotFoundError, ValueError):
        return -signal.SIGKILL


def owner_of(handoff: Path, starter: int) -> int:
    """The process an early job waits for a run from: whoever claimed its cluster, else whoever started it."""
    try:
        return int((handoff.parent / OWNER_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return starter
