"""A throwaway PostgreSQL server for the team-stack tests: Debian's `postgresql`, on 127.0.0.1, data in a temp folder.

from tests.infra.postgres import harness
ok, why = harness.available()          # installs Debian's postgresql when root and missing
with harness.postgres(tmp_path) as pg:  # initdb, start on a free port, password auth; stopped and removed on exit
    url = pg.url("prefect", driver="postgresql+asyncpg")
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support import tiers
from tests.support.servers import stable_port

USER = "gpuflow"
READY_TIMEOUT_S = 60


def bin_dir() -> Path | None:
    """Debian puts the server tools under /usr/lib/postgresql/<version>/bin (not on PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def available(install: bool = True) -> tuple[bool, str]:
    """(True, "") when a PostgreSQL server can run here; installs Debian's package as root (as for Slurm, Chromium)."""
    if bin_dir() is None and install and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        command = ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]
        if subprocess.run(command, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(command, env=env, capture_output=True)
    if bin_dir() is None:
        return False, "no PostgreSQL server (/usr/lib/postgresql/*/bin/initdb); apt-get install postgresql"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return False, "running as root and no 'postgres' user to run the server as (initdb refuses root)"
    return True, ""


@dataclass
class Postgres:
    port: int
    password: str
    user: str = USER

    def url(self, database: str, driver: str = "postgresql") -> str:
        return f"{driver}://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"


def as_server_user(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """initdb and postgres refuse to run as root: run them as Debian's `postgres` user then."""
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return subprocess.run(prefix + command, check=True, capture_output=True, text=True, **kwargs)


@contextlib.contextmanager
def postgres(folder: Path, databases: tuple[str, ...] = ("prefect", "mlflow", "mlflow_auth")):
    """A fresh cluster in `folder`, password (scram) auth for USER, listening on 127.0.0.1 only; removed on exit."""
    tiers.started("PostgreSQL")
    tools = bin_dir()
    data, sockets = folder / "pgdata", folder / "pgsocket"
    folder.mkdir(parents=True, exist_ok=True)
    sockets.mkdir(exist_ok=True)
    password = secrets.token_hex(16)
    password_file = folder / "pgpass"
    password_file.write_text(password)
    if os.geteuid() == 0:
        for path in (folder, sockets, password_file):
            shutil.chown(path, "postgres", "postgres")
        folder.chmod(0o755)
    port = stable_port()  # initdb runs between the probe and the bind
    as_server_user(
        [
            str(tools / "initdb"),
            "-D",
            str(data),
            "-U",
            USER,
            "--pwfile",
            str(password_file),
            "--auth-host=scram-sha-256",
            "--auth-local=scram-sha-256",
            "-E",
            "UTF8",
        ]
    )
    password_file.unlink()
    log = folder / "postgres.log"
    as_server_user(
        [
            str(tools / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(log),
            "-w",
            "-t",
            str(READY_TIMEOUT_S),
            "-o",
            f"-p {port} -c listen_addresses=127.0.0.1 -k {sockets} -c max_connections=200",
            "start",
        ]
    )
    server = Postgres(port, password)
    try:
        env = {**os.environ, "PGPASSWORD": password}
        for database in databases:
            subprocess.run(
                [str(tools / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, database],
                check=True,
                capture_output=True,
                env=env,
            )
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            as_server_user([str(tools / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"])
        shutil.rmtree(data, ignore_errors=True)


def wait_gone(port: int, timeout_s: float = 10) -> bool:
    """True once nothing listens on the port (the server has stopped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return True
        time.sleep(0.2)
    return False
