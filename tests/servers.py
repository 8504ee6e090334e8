"""Real servers for tests, on 127.0.0.1 and free ports: the MLflow tracking server.

    used by the fixtures in tests/conftest.py; each context manager stops its whole process group on exit
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240  # generous: the machine is shared with Ray jobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:3]} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")


def stop_group(process: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the process group, then SIGKILL what is left: no server outlives its test."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


@contextlib.contextmanager
def started(command: list[str], log: Path, env: dict[str, str], cwd: Path = REPO):
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
    try:
        yield process
    finally:
        stop_group(process)


def base_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
            "RAY_USAGE_STATS_ENABLED": "0", "NO_PROXY": "127.0.0.1,localhost", **extra}


@contextlib.contextmanager
def mlflow_server(home: Path):
    """`mlflow server` with a sqlite store and proxied artifacts; yields its URL.

    Proxied: clients (a cluster node running as another user, say) upload through the server,
    so only the server's own user writes under home/artifacts.
    """
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = base_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    command = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination", str(home / "artifacts")]
    with started(command, home / "mlflow.log", env) as process:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/health", process, home / "mlflow.log")
        yield url
