"""Prefect's temporary API server for a `gpuflow run` without PREFECT_API_URL, started without loading Prefect's server.

Prefect starts the same server itself on a flow run's first API call, but to do so it imports its server package
(FastAPI, the ORM, every route) into the calling process: ~3 s of CPU that `gpuflow run` needs for nothing, since
the server runs in a process of its own. This starts that process as Prefect 3.8 does (uvicorn of
`prefect.server.api.server:create_app`, its UI off, ephemeral), then points this process's Prefect settings at it
(PREFECT_API_URL), so that no part of Prefect starts another one. The server stops when this process exits, and
a watcher (flows/outlive.py) stops it if this process is killed.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

PORT_IN_USE = 3  # uvicorn's exit code when the port was taken between our probe and its bind


def start() -> str:
    """Starts the server, waits until it answers, makes it this process's Prefect API; returns its URL."""
    return launch().ready()


def launch() -> TemporaryApi:
    """Starts the server's process and returns at once: `ready()` waits for it. Its imports take seconds of CPU,
    which overlap whatever this process does meanwhile."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, get_current_settings

    return TemporaryApi(get_current_settings().to_environment_variables(exclude_unset=True),
                        time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())


class TemporaryApi:
    def __init__(self, settings_env: dict[str, str], deadline: float):
        self.settings_env, self.deadline = settings_env, deadline
        self.server, self.api_url = self._launch()

    def _launch(self) -> tuple[subprocess.Popen, str]:
        port = free_port()
        server = uvicorn(port, self.settings_env)
        atexit.register(stop, server)
        watch(server)
        return server, f"http://127.0.0.1:{port}/api"

    def ready(self) -> str:
        """Waits until the server answers, then points this process's Prefect settings at it; returns its URL."""
        while not wait_until_healthy(self.server, self.api_url, self.deadline):
            if self.server.returncode != PORT_IN_USE:
                stop(self.server)
                raise RuntimeError(f"Prefect's temporary API server did not answer on {self.api_url} (exit code "
                                   f"{self.server.returncode}); set PREFECT_API_URL to a running server instead")
            self.server, self.api_url = self._launch()
        use(self.api_url)
        return self.api_url


def use(api_url: str) -> None:
    """Points this process's Prefect settings (every thread's client) at a server of ours, which serves no UI."""
    from prefect.context import refresh_global_settings_context

    os.environ["PREFECT_API_URL"] = api_url
    os.environ["PREFECT_UI_URL"] = ""  # no "View at" link to a page that does not exist
    refresh_global_settings_context()


def uvicorn(port: int, settings_env: dict[str, str]) -> subprocess.Popen:
    import prefect

    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
         "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "error",
         "--lifespan", "on"],
        env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
             **settings_env},
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, api_url: str, deadline: float) -> bool:
    """True once the server answers; False if it exited or the deadline passed."""
    while time.monotonic() < deadline and server.poll() is None:
        if answers(api_url):
            return True
        time.sleep(0.1)
    return False


def answers(api_url: str, timeout_s: float = 5) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def watch(server: subprocess.Popen) -> None:
    """A watcher in a session of its own: the server must not outlive this process, even after a kill -9."""
    subprocess.Popen([sys.executable, "-m", "gpuflow.flows.outlive", "--owner", str(os.getpid()),
                      "--kill", str(server.pid)], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
