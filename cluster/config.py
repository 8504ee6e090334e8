"""The user's settings: what gpuflow reads from the environment of whoever runs it, in one place.

    GPUFLOW_HOME              where runtime state lives: the MLflow store, checkpoints, data, cluster records, logs
                              (default: .gpuflow in the current folder; never commit it)
    GPUFLOW_DAILY_BUDGET_USD  the most today's runs (UTC) may cost together; unset: no daily budget
    GPUFLOW_STACK             "off": `gpuflow run` ignores a warm local stack (`gpuflow up`)
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
    return f"sqlite:///{state_dir() / 'mlflow.db'}"


def daily_budget() -> str | None:
    """The daily budget as written (cluster/cost/budget.py checks that it is a number of dollars), or None."""
    return os.environ.get(DAILY_BUDGET_ENV) or None


def stack_enabled() -> bool:
    return os.environ.get(STACK_ENV, "").lower() != "off"


def shared_path() -> str | None:
    return os.environ.get(SHARED_PATH_ENV) or None


def serve_overrides() -> list[str]:
    """The `--set` of the `gpuflow serve` that started this run (none outside one)."""
    return json.loads(os.environ.get(SERVE_OVERRIDES_ENV) or "[]")


def metadata_url() -> str | None:
    """The metadata service a test stands in for the clouds' (None: each cloud's own, on a cloud node)."""
    return os.environ.get(METADATA_URL_ENV) or None
