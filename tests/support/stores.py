"""Empty, migrated stores that a test's fresh Prefect server or MLflow store starts from, copied, not migrated anew.

A fresh Prefect server migrates its SQLite database first: about 9 CPU-seconds and 20 s of wall time here, in every
test that starts one (its own server, a run's temporary API in a home of its own). A fresh MLflow SQLite store
migrates too: about 2.4 CPU-seconds in the first process that opens it. Each is migrated once a session (the first
xdist worker to need it makes it, under a lock; the others wait and copy), by the installed Prefect and MLflow,
so a copy is what a fresh store is once they have migrated it. Tests of a new user's first run (their own project,
the temporary API's first test) start from nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

STORES = "GPUFLOW_TESTS_STORES"  # the session's folder of migrated stores (made in tests/conftest.py)


def seed_prefect_home(home: Path) -> None:
    """Gives a Prefect home with no database yet a migrated one (Prefect's default place: <home>/prefect.db)."""
    _seed(_migrated("prefect.db", _migrate_prefect), home / "prefect.db")


def seed_mlflow_store(database: Path) -> None:
    """Gives a path with no MLflow store yet a migrated one. Its Default experiment keeps its artifacts beside it
    (MLflow puts them under the first opener's working directory, ./mlruns)."""
    if _seed(_migrated("mlflow.db", _migrate_mlflow), database):
        with contextlib.closing(sqlite3.connect(database)) as db, db:
            db.execute(
                "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                (str(database.parent / "mlruns" / "0"),),
            )


def _seed(template: Path, target: Path) -> bool:
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, target)
    return True


def _migrated(name: str, migrate) -> Path:
    folder = Path(os.environ.get(STORES) or tempfile.gettempdir())
    template = folder / name
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one xdist worker migrates, the others wait for it
        if not template.exists():
            making = folder / f"{name}.making"
            making.unlink(missing_ok=True)
            migrate(making)
            making.replace(template)
    return template


def _migrate_prefect(database: Path) -> None:
    from tests.support.servers import BIN, base_env

    env = base_env(PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{database}")
    env.pop("PREFECT_API_URL", None)
    subprocess.run(
        [str(BIN / "prefect"), "server", "database", "upgrade", "-y"],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )


def _migrate_mlflow(database: Path) -> None:
    code = "import sys; from mlflow import MlflowClient; MlflowClient(sys.argv[1]).search_experiments()"
    subprocess.run(
        [sys.executable, "-c", code, f"sqlite:///{database}"],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=database.parent,
    )
