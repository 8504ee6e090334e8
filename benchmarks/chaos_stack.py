"""The chaos soak's stack: a Prefect server and an MLflow server on 127.0.0.1 that can be killed and restarted on the
same database and port, a webhook that counts messages per flow run and can go down for a while, and `gpuflow serve`.
Everything lives under one temp dir; `Stack.close` stops all of it (also on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.servers import (
    BIN,
    REPO,
    base_env,
    prefect_server_at,
    serving,
    stable_port,
    stop_group,
    wait_for_http,
)

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
NOTIFY_BLOCK = "chaos-hook"


class Webhook:
    """A webhook receiver counting the messages of each flow run (the id in the message's `Prefect:` line); `down`
    closes its port for a while, as a webhook that is down does."""

    def __init__(self):
        self.messages: dict[str, list[str]] = defaultdict(list)  # flow run id -> events
        self.unmatched: list[dict] = []
        self.port, self.server, self.closed = stable_port(), None, False  # down and up again
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/chaos"

    def up(self) -> None:
        if self.closed or self.server:
            return
        messages, unmatched = self.messages, self.unmatched

        class Receiver(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null") or {}
                prefect = next(
                    (line for line in str(body.get("body", "")).splitlines() if line.startswith("Prefect:")), ""
                )
                found = UUID.search(prefect)
                event = str(body.get("subject", "")).split()[-1:] or ["?"]
                (messages[found.group(0)].append(event[0]) if found else unmatched.append(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Receiver)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def close(self) -> None:
        self.closed = True  # a timer bringing it back up after the soak finds it closed
        self.down()


class Stack:
    """The servers of one soak, in `root` (a temp dir of its own unless given)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="gpuflow-chaos-"))
        self.home = self.root / "gpuflow-home"  # GPUFLOW_HOME of every run: its processes are found by it
        self.home.mkdir(parents=True, exist_ok=True)
        self.prefect_port, self.mlflow_port = stable_port(), stable_port()  # restarted on them
        self.api_url = f"http://127.0.0.1:{self.prefect_port}/api"
        self.mlflow_url = f"http://127.0.0.1:{self.mlflow_port}"
        self.exits = contextlib.ExitStack()
        self.prefect = self.mlflow = self.serve = None
        self.webhook = Webhook()
        self.exits.callback(self.webhook.close)

    # -- servers ----------------------------------------------------------------------------------------
    def server_env(self, **extra: str) -> dict[str, str]:
        env = base_env(**extra)
        for name in ("GPUFLOW_HOME", "PREFECT_API_URL"):
            env.pop(name, None)  # servers are no run's processes: the leftover check finds those by GPUFLOW_HOME
        return env

    def start_prefect(self) -> None:
        env = self.server_env(
            PREFECT_HOME=str(self.root / "prefect-server"), PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false"
        )
        (self.root / "prefect-server").mkdir(exist_ok=True)
        context = serving(prefect_server_at(env), self.root / "prefect-server.log", "/api/health", self.prefect_port)
        self.prefect, _ = self.exits.enter_context(context)

    def start_mlflow(self) -> None:
        env = self.server_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        command = [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.mlflow_port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "mlflow-artifacts"),
        ]
        context = serving(lambda port: (command, env), self.root / "mlflow.log", "/health", self.mlflow_port)
        self.mlflow, _ = self.exits.enter_context(context)

    def kill_and_restart(self, which: str, down_s: float) -> None:
        """kill -9 of the server's process group; after down_s, the same server again (database, port)."""
        process = self.prefect if which == "prefect" else self.mlflow
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        time.sleep(down_s)
        self.start_prefect() if which == "prefect" else self.start_mlflow()

    def client_env(self, **extra: str) -> dict[str, str]:
        """The environment of every gpuflow command of the soak: its Prefect server, its home, no warm stack."""
        return base_env(
            PREFECT_API_URL=self.api_url,
            PREFECT_UI_URL=self.api_url.removesuffix("/api"),
            GPUFLOW_HOME=str(self.home),
            PREFECT_HOME=str(self.root / "prefect-client"),
            GPUFLOW_STACK="off",
            PYTHONUNBUFFERED="1",
            PREFECT_RUNNER_POLL_FREQUENCY="1",
            **extra,
        )

    def gpuflow(self, *args: str, timeout_s: float = 180) -> str:
        done = subprocess.run(
            [str(BIN / "gpuflow"), *args],
            capture_output=True,
            text=True,
            cwd=self.root,
            env=self.client_env(),
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(f"gpuflow {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout

    def start(self, quota: int, serve_overrides: list[str] | None) -> None:
        self.start_prefect()
        self.start_mlflow()
        self.gpuflow("quota", "set", "local", str(quota))
        self.gpuflow("notify", "add", NOTIFY_BLOCK, self.webhook.url)
        if serve_overrides is not None:
            self.start_serve(serve_overrides)

    def start_serve(self, overrides: list[str], limit: int = 2) -> None:
        log = open(self.root / "serve.log", "ab")
        self.exits.callback(log.close)
        self.serve = subprocess.Popen(
            [
                str(BIN / "gpuflow"),
                "serve",
                "--only=run-experiment",
                f"--limit={limit}",
                *[f"--set={item}" for item in overrides],
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=self.client_env(),
            start_new_session=True,
        )
        self.exits.callback(self.stop_serve)
        deadline = time.monotonic() + 240
        while self.deployment() is None:
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "gpuflow serve did not register run-experiment:\n" + (self.root / "serve.log").read_text()[-3000:]
                )
            time.sleep(1)

    def stop_serve(self) -> None:
        if self.serve and self.serve.poll() is None:
            stop_group(self.serve, grace_s=20)

    def deployment(self):
        with contextlib.suppress(Exception), self.client() as client:
            return client.read_deployment_by_name("run-experiment/run-experiment")
        return None

    @contextlib.contextmanager
    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}), get_client(sync_client=True) as client:
            yield client

    def prefect_answers(self, timeout_s: float = 120) -> None:
        """Waits for the Prefect server to answer again (after a restart)."""
        wait_for_http(f"{self.api_url}/health", self.prefect, self.root / "prefect-server.log", timeout_s)

    def close(self, keep: bool = False) -> None:
        try:
            self.exits.close()
        finally:
            if not keep:
                shutil.rmtree(self.root, ignore_errors=True)
