"""The user's settings: what gpuflow reads from the environment of whoever runs it, in one place.

    GPUFLOW_HOME              where runtime state lives: the MLflow store, checkpoints, data, cluster records, logs
                              (default: .gpuflow in the current folder; never commit it)
    GPUFLOW_DAILY_BUDGET_USD  the most today's runs (UTC) may cost together; unset: no daily budget
    GPUFLOW_STACK             the warm local stack (flows/local_stack/stack.py): unset or "auto", a `gpuflow run` on
                              the local backend without a Prefect server leaves one behind for the next run;
                              "manual": runs use one that `gpuflow up` started, and leave none; "off": runs ignore it
    GPUFLOW_STACK_IDLE_MINUTES  how long the stack a run leaves behind waits for the next run (default 10)
    GPUFLOW_LOCAL_RAY         the local backend's Ray: unset or "lean", without what a run does not use (Ray's and
                              Ray Train's metrics export, the autoscaler's monitor); "full": Ray's defaults, e.g. to
                              scrape Ray's metrics with Prometheus
    GPUFLOW_REUSE             unset or "finished": a run whose work key is a FINISHED run's reuses it and trains
                              nothing (cluster/rerun/reuse.py); "never": this machine's runs always train
    GPUFLOW_OVERDUE_PASS      unset or "ask": `gpuflow run`, `status` and `quota list` against a Prefect server start a
                              reaper pass when none ran within its schedule (flows/reconcile/overdue.py); "never": not
    GPUFLOW_SHARED_PATH       a folder that every node of a cluster mounts too (a Slurm cluster's shared disk, an NFS
                              mount): stores under it count as reachable from the cluster, like a bucket
    GPUFLOW_SERVE_OVERRIDES   set by `gpuflow serve --set ...` for the flow runs it starts: the overrides, as JSON
    GPUFLOW_METADATA_URL      tests only: the base URL of a double of the clouds' node metadata service, asked for
                              spot notices instead of each cloud's own (cluster/job/notices.py); the local backend's
                              simulated node asks <url>/<its Ray node id>, and watches for notices only when it is set;
                              the flow hands it on to the job (a SkyPilot node's watch asks <url> itself)

Each is read when asked for, not at import: one process may serve runs whose environments differ
(`gpuflow serve`, a test session).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpuflow.cluster.protocol import ENV_NAMES, SERVE_OVERRIDES_ENV

# The environment this process was started with, before the libraries it loads set their own (Ray, torch and MLflow
# set variables as they load): what a process started for a run later is to inherit
# (cluster/backends/local/early_job.py).
STARTING_ENVIRONMENT = dict(os.environ)

HOME_ENV = "GPUFLOW_HOME"
DAILY_BUDGET_ENV = "GPUFLOW_DAILY_BUDGET_USD"
STACK_ENV = "GPUFLOW_STACK"
SHARED_PATH_ENV = "GPUFLOW_SHARED_PATH"
METADATA_URL_ENV = ENV_NAMES["metadata_url"]  # the flow hands it on to the job and its nodes


def state_dir() -> Path:
    """Where gpuflow keeps its runtime state (MLflow store, checkpoints, data, clusters): never in git."""
    return Path(os.environ.get(HOME_ENV, ".gpuflow")).absolute()


def default_tracking_uri() -> str:
    """The local MLflow store every spec tracks to unless tracking.uri says otherwise."""
    return f"sqlite:///{local_store()}"


def local_store() -> Path:
    return state_dir() / "mlflow.db"


def daily_budget() -> str | None:
    """The daily budget as written (cluster/cost/budget.py checks that it is a number of dollars), or None."""
    return os.environ.get(DAILY_BUDGET_ENV) or None


class SettingError(ValueError):
    """A GPUFLOW_* variable set to what gpuflow cannot use: the message names it, its value and the fix."""


STACK_MODES = ("auto", "manual", "off")
STACK_IDLE_ENV = "GPUFLOW_STACK_IDLE_MINUTES"


def stack_mode() -> str:
    """auto (the default), manual or off: see GPUFLOW_STACK above."""
    return mode_of(STACK_ENV, STACK_MODES)


def stack_enabled() -> bool:
    return stack_mode() != "off"


def stack_idle_minutes() -> float:
    """How long a stack left behind by a run waits for the next one."""
    value = os.environ.get(STACK_IDLE_ENV) or "10"
    try:
        minutes = float(value)
    except ValueError:
        minutes = -1
    if minutes <= 0:
        raise SettingError(f"{STACK_IDLE_ENV}={value!r}: set it to a number of minutes above 0, e.g. 10")
    return minutes


LOCAL_RAY_ENV = "GPUFLOW_LOCAL_RAY"
LOCAL_RAY_MODES = ("lean", "full")


def local_ray_mode(environ: dict[str, str] | None = None) -> str:
    """lean (the default) or full: see GPUFLOW_LOCAL_RAY above; `environ` is the environment a Ray process gets."""
    return mode_of(LOCAL_RAY_ENV, LOCAL_RAY_MODES, environ)


REUSE_ENV = "GPUFLOW_REUSE"
REUSE_MODES = ("finished", "never")


def reuse_mode() -> str:
    """finished (the default) or never: see GPUFLOW_REUSE above."""
    return mode_of(REUSE_ENV, REUSE_MODES)


OVERDUE_PASS_ENV = "GPUFLOW_OVERDUE_PASS"
OVERDUE_PASS_MODES = ("ask", "never")


def overdue_pass_mode() -> str:
    """ask (the default) or never: see GPUFLOW_OVERDUE_PASS above."""
    return mode_of(OVERDUE_PASS_ENV, OVERDUE_PASS_MODES)


def mode_of(name: str, modes: tuple[str, ...], environ: dict[str, str] | None = None) -> str:
    """The setting `name`: one of `modes`, the first when unset; any other value is refused, naming the choices."""
    environ = os.environ if environ is None else environ
    mode = environ.get(name, "").strip().lower() or modes[0]
    if mode not in modes:
        choices = " or ".join(modes) if len(modes) == 2 else f"one of {', '.join(modes)}"
        raise SettingError(f"{name}={environ[name]!r}: set it to {choices}, or unset it")
    return mode


def shared_path() -> str | None:
    return os.environ.get(SHARED_PATH_ENV) or None


def serve_overrides() -> list[str]:
    """The `--set` of the `gpuflow serve` that started this run (none outside one)."""
    return json.loads(os.environ.get(SERVE_OVERRIDES_ENV) or "[]")


def metadata_url() -> str | None:
    """The metadata service a test stands in for the clouds' (None: each cloud's own, on a cloud node)."""
    return os.environ.get(METADATA_URL_ENV) or None
