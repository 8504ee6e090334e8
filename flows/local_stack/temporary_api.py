"""Prefect's temporary API server for a `gpuflow run` without PREFECT_API_URL, started without loading Prefect's server.

Prefect starts the same server itself on a flow run's first API call, but to do so it imports its server package
(FastAPI, the ORM, every route) into the calling process: seconds of CPU that `gpuflow run` needs for nothing, since
the server runs in a process of its own. This starts that process as Prefect 3.8 does (uvicorn of
`prefect.server.api.server:create_app`, its UI off, ephemeral: flows/prefect_internals.py), then points this
process's Prefect settings at it (PREFECT_API_URL), so that no part of Prefect starts another one. The server stops
when this process exits, and a watcher (flows/local_stack/outlive.py) stops it if this process is killed.

`gpuflow run` launches it before it imports Prefect itself, where no settings file can say otherwise
(`launch_before_prefect`): the second that import takes then overlaps the server's start. Once Prefect has read its
settings, a server they do not want is stopped (flows/local_stack/prefect_api.py).

Its port is bound here and handed to uvicorn as an open socket: a port probed free and bound later by the server
can be taken in between (Ray's servers take ports all the time), and uvicorn's exit code does not say so once
Prefect's lifespan fails on the way out.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpuflow.cluster.util.http import probe
from gpuflow.cluster.util.processes import started_at
from gpuflow.flows.prefect_internals import refresh_settings, start_api_server


def start() -> str:
    """Starts the server, waits until it answers, makes it this process's Prefect API; returns its URL."""
    return launch().ready()


def launch() -> TemporaryApi:
    """Starts the server's process and returns at once: `ready()` waits for it. Its imports take seconds of CPU,
    which overlap whatever this process does meanwhile."""
    from prefect.settings import PREFECT_HOME, get_current_settings

    return TemporaryApi(
        with_lasting_leases(get_current_settings().to_environment_variables(exclude_unset=True)), PREFECT_HOME.value()
    )


def launch_before_prefect() -> TemporaryApi | None:
    """The same server, launched before this process imports Prefect: that import is a second of CPU that the server's
    start then overlaps. Only where Prefect's settings come from the environment alone, which the server inherits;
    None where a settings file may say otherwise (`launch` reads them, once Prefect is loaded)."""
    if settings_files():
        return None
    return TemporaryApi(with_lasting_leases({}), home_from_environment())


def settings_files() -> list[Path]:
    """Where Prefect 3.8 reads settings besides the environment, those that may hold some: its profiles, and this
    folder's prefect.toml, .env and pyproject.toml ([tool.prefect])."""
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or home_from_environment() / "profiles.toml").expanduser()
    candidates = [
        (profiles, ""),
        (Path("prefect.toml"), ""),
        (Path(".env"), "PREFECT_"),
        (Path("pyproject.toml"), "[tool.prefect"),
    ]
    return [path for path, marker in candidates if path.is_file() and marker in path.read_text(errors="replace")]


def home_from_environment() -> Path:
    """PREFECT_HOME as Prefect reads it where no settings file sets it."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


LEASE_STORAGE = "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"
FILESYSTEM_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def with_lasting_leases(settings_env: dict[str, str]) -> dict[str, str]:
    """A server's settings with its concurrency leases kept on disk (under PREFECT_HOME), unless the lease storage is
    set already: Prefect's default keeps them in memory, and a restart would leak every slot held on the GPU quota
    (flows/quota/)."""
    return {LEASE_STORAGE: FILESYSTEM_LEASES, **settings_env}


class TemporaryApi:
    def __init__(self, settings_env: dict[str, str], home: Path):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)  # its database's folder: the server makes no parents
        self.started = time.monotonic()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            self.api_url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
            self.server = start_api_server(listener, settings_env)
        self.watcher = watch(self.server)
        atexit.register(self.stop)

    def ready(self) -> str:
        """Waits until the server answers, then points this process's Prefect settings at it; returns its URL."""
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        deadline = self.started + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        if not wait_until_healthy(self.server, self.api_url, deadline):
            self.stop()
            raise RuntimeError(
                f"Prefect's temporary API server did not answer on {self.api_url} (exit code "
                f"{self.server.returncode}); set PREFECT_API_URL to a running server instead"
            )
        use(self.api_url)
        return self.api_url

    def stop(self) -> None:
        """Stops the server, then its watcher: this process's exit must leave neither (the watcher would see the
        server gone and exit by itself, but only within its poll)."""
        stop(self.server)
        stop(self.watcher)


def use(api_url: str) -> None:
    """Points this process's Prefect settings (every thread's client) at a server of ours, which serves no UI."""
    os.environ["PREFECT_API_URL"] = api_url
    os.environ["PREFECT_UI_URL"] = ""  # no "View at" link to a page that does not exist
    refresh_settings()


def wait_until_healthy(server: subprocess.Popen, api_url: str, deadline: float) -> bool:
    """True once the server answers; False if it exited or the deadline passed."""
    while time.monotonic() < deadline and server.poll() is None:
        if answers(api_url):
            return True
        time.sleep(0.1)
    return False


def answers(api_url: str, timeout_s: float = 5) -> bool:
    """True when a Prefect API answers there. Something else may: the port of an API that has stopped (the warm
    stack's, a configured one) can be taken since by another server, such as one of Ray's gRPC servers, whose reply
    is not HTTP/1."""
    return probe(f"{api_url}/health", timeout_s)[0] == 200


def watch(server: subprocess.Popen) -> subprocess.Popen:
    """A watcher in a session of its own: the server must not outlive this process, even after a kill -9."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuflow.flows.local_stack.outlive",
            "--owner",
            str(os.getpid()),
            "--kill",
            str(server.pid),
            "--kill-started",
            str(started_at(server.pid) or 0),  # read while it is our child: its pid is no one else's yet
        ],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop(process: subprocess.Popen) -> None:
    """Terminates a child of this process and reaps it (killed if it takes over 5 s)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
