"""A local MLflow store (sqlite://) made once, not by several runs at the same time.

MLflow creates a SQLite store's tables on first use, with Alembic migrations that are not safe to run twice at once:
runs started together on a fresh GPUFLOW_HOME (a served deployment taking four runs) fail with
"table _alembic_tmp_experiments already exists". The first run makes it under a file lock; the others wait for it."""

from __future__ import annotations

import fcntl
from pathlib import Path

_ready: set[str] = set()


def store_exists(tracking_uri: str) -> bool:
    """False for a sqlite:/// store not yet made: reading one creates it, tables and all; any other URI is a server.
    A store another process is making this instant is waited for (its lock), not read half made: a reader of a
    file with no tables yet would make them too."""
    if not tracking_uri.startswith("sqlite:///"):
        return True
    if not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        return False
    ready_local_store(tracking_uri)
    return True


def ready_local_store(tracking_uri: str) -> None:
    """Creates (or upgrades) a sqlite:/// store under a lock beside it; any other URI is the server's business."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri in _ready:
        return
    from mlflow import MlflowClient

    database = Path(tracking_uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        MlflowClient(tracking_uri).search_experiments(max_results=1)  # MLflow makes its tables here
    _ready.add(tracking_uri)
