"""Real servers for tests, on 127.0.0.1 and free ports: Prefect API + UI, MLflow tracking server, `gpuflow serve`.

used by the fixtures in tests/conftest.py; each context manager stops its whole process group on exit
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import os
import random
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tests.support import tiers

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 240  # generous: the machine is shared with Ray jobs
RAY_WORKER_PORTS_END = 19999  # Ray's default max_worker_port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STABLE_PORTS_GIVEN: set[int] = set()


def stable_port() -> int:
    """A free port that no other process takes by chance, for a server started well after the probe or stopped and
    started again on it: below the kernel's ephemeral range, so no outgoing connection gets it as its local port,
    and above Ray's worker ports. Never the same port twice in one process."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    untaken = sorted(set(range(RAY_WORKER_PORTS_END + 1, low)) - STABLE_PORTS_GIVEN)
    for port in random.sample(untaken, 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            STABLE_PORTS_GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port between {RAY_WORKER_PORTS_END + 1} and {low}")


def wait_for_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:3]} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not up yet, or another server's port (not HTTP/1)
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")


def stop_group(process: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the process group, then SIGKILL what is left: no server outlives its test. A group whose leader was
    reaped and that has no member left is not signalled: its id may be another session's since (pids wrap here in
    half an hour of a whole matrix), such as the Slurm harness's sshd."""
    if ours_to_signal(process):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if ours_to_signal(process):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def ours_to_signal(process: subprocess.Popen) -> bool:
    """The process group of `process` (a session leader we started) is still its own: the leader not reaped yet (a
    zombie keeps its id), or a member of its session alive (no new group or session can take an id in use)."""
    from gpuflow.cluster.util.processes import session_members

    return process.returncode is None or bool(session_members(process.pid))


@contextlib.contextmanager
def started(command: list[str], log: Path, env: dict[str, str], cwd: Path = REPO, stop_grace_s: float = 15):
    tiers.started(f"a server ({Path(command[0]).name} {command[1]})")
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
    try:
        yield process
    finally:
        stop_group(process, stop_grace_s)


@contextlib.contextmanager
def serving(launch_at, log: Path, health: str, port: int | None = None, tries: int = 3):
    """Starts the (command, env) of `launch_at(port)`; yields (process, url) once url + health answers. Ray's servers
    take ports all the time, so a port probed free can be taken before the server binds it: then it tries another
    (unless a port was asked for)."""
    for attempt in range(1, tries + 1):
        chosen = port or free_port()
        url, logged = f"http://127.0.0.1:{chosen}", log.stat().st_size if log.exists() else 0
        command, env = launch_at(chosen)
        with started(command, log, env) as process:
            try:
                wait_for_http(f"{url}{health}", process, log)
            except RuntimeError:
                taken = "already in use" in log.read_bytes()[logged:].decode(errors="replace").lower()
                if taken and port is None and attempt < tries:
                    continue
                raise
            yield process, url
            return


# what an HTTP/2-only server (Ray's gRPC servers) answers to an HTTP/1 request: its SETTINGS, then GOAWAY
HTTP2_REPLY = bytes.fromhex("0000000400000000000000080700000000000000000000000001")


@contextlib.contextmanager
def not_http_server():
    """A server on a free port of 127.0.0.1 that answers every connection as an HTTP/2-only server does; yields
    its port."""

    class Reply(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.settimeout(5)
            with contextlib.suppress(OSError):
                self.request.recv(65536)
                self.request.sendall(HTTP2_REPLY)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True  # a client that never sends must not hold the process at exit

    with Server(("127.0.0.1", 0), Reply) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()


def base_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "RAY_USAGE_STATS_ENABLED": "0",
        "NO_PROXY": "127.0.0.1,localhost",
        **extra,
    }


@contextlib.contextmanager
def prefect_server(home: Path, port: int | None = None, lease_storage: str | None = None):
    """`prefect server start` with its own database; yields the API URL (the UI is the same origin). The same home
    and port again: the same server, restarted. Its concurrency leases are kept on disk, in its home (lease_storage:
    another of Prefect's lease storages)."""
    with prefect_server_process(home, port, lease_storage) as (_, api_url):
        yield api_url


@contextlib.contextmanager
def prefect_server_process(home: Path, port: int | None = None, lease_storage: str | None = None):
    """prefect_server's process (the leader of its process group) and API URL."""
    from gpuflow.flows.local_stack.temporary_api import LEASE_STORAGE
    from tests.support.stores import seed_prefect_home

    seed_prefect_home(home)  # migrated once a session, not by each fresh server
    env = base_env(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
        # the scheduler makes runs of a new schedule within seconds, not within its default minute
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="5",
    )
    env.pop("GPUFLOW_HOME", None)  # not a process of any run: the fault tests find a run's processes by this
    if lease_storage:
        env[LEASE_STORAGE] = lease_storage
    with serving(prefect_server_at(env), home / "server.log", "/api/health", port) as (process, url):
        yield process, f"{url}/api"


def prefect_server_at(env: dict[str, str]):
    """`prefect server start` on a port, with its UI (same origin) and its own settings pointed at that port; its
    concurrency leases on disk unless env names a lease storage (as gpuflow's own servers: flows/local_stack)."""
    from gpuflow.flows.local_stack.temporary_api import with_lasting_leases

    def launch_at(port: int) -> tuple[list[str], dict[str, str]]:
        url = f"http://127.0.0.1:{port}"
        return (
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            with_lasting_leases(
                {**env, "PREFECT_API_URL": f"{url}/api", "PREFECT_UI_API_URL": f"{url}/api", "PREFECT_UI_URL": url}
            ),
        )

    return launch_at


@contextlib.contextmanager
def mlflow_server(home: Path, port: int | None = None):
    """`mlflow server` with a sqlite store and proxied artifacts; yields its URL. The same home and port again:
    the same server, restarted."""
    home.mkdir(parents=True, exist_ok=True)
    env = base_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")

    def launch_at(port: int) -> tuple[list[str], dict[str, str]]:
        return (
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{home / 'mlflow.db'}",
                "--artifacts-destination",
                str(home / "artifacts"),
            ],
            env,
        )

    with serving(launch_at, home / "mlflow.log", "/health", port) as (_, url):
        yield url


@contextlib.contextmanager
def gpuflow_serve(
    api_url: str,
    gpuflow_home: Path,
    overrides: list[str],
    names: tuple[str, ...],
    only: bool = False,
    limit: int | None = None,
    stop_grace_s: float = 15,
    poll_s: float = 1,
    env: dict[str, str] | None = None,
):
    """`gpuflow serve` against the test's Prefect server; yields once every named deployment is registered
    (only: serve only those; limit: its --limit; poll_s: how often it polls for runs; env: more of its environment)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    gpuflow_home.mkdir(parents=True, exist_ok=True)
    env = base_env(
        PREFECT_API_URL=api_url,
        PREFECT_UI_URL=api_url.removesuffix("/api"),
        GPUFLOW_HOME=str(gpuflow_home),
        PREFECT_RUNNER_POLL_FREQUENCY=f"{poll_s:g}",
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1",
        PYTHONUNBUFFERED="1",
        **(env or {}),
    )
    command = [
        str(BIN / "gpuflow"),
        "serve",
        *[f"--set={item}" for item in overrides],
        *[f"--only={name}" for name in (names if only else ())],
        *([f"--limit={limit}"] if limit else []),
    ]
    log = gpuflow_home / "serve.log"
    with contextlib.ExitStack() as stack:
        stack.callback(stop_left_behind, gpuflow_home)  # after serve itself is stopped
        process = stack.enter_context(started(command, log, env, stop_grace_s=stop_grace_s))
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        deadline = time.monotonic() + READY_TIMEOUT_S
        with get_client(sync_client=True) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"gpuflow serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
                found = {d.name for d in client.read_deployments()}
                if set(names) <= found:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"deployments {names} not registered; found {found}:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield process


def stop_left_behind(gpuflow_home: Path, grace_s: float = 10) -> None:
    """Stops what serve's flow runs started in sessions of their own and left behind when serve was stopped in the
    middle of one: a reaper run that had started SkyPilot's local API server (it stops it when it finishes, not when
    it is killed). Found by the gpuflow home in their environment (processes_of names each one)."""
    from tests.support.processes import alive, processes_of

    left = [pid for pid in processes_of(gpuflow_home) if os.getsid(pid) != os.getsid(0)]  # never the tests' own
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(left):
        time.sleep(0.2)
    for pid in alive(left):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


RUN_TIMEOUT_S = 900  # a full digits run takes 1-2 min alone; the machine is shared


@dataclass
class ServedDeployments:
    api_url: str
    mlflow_url: str
    home: Path

    @property
    def ui_url(self) -> str:
        return self.api_url.removesuffix("/api")

    @contextlib.contextmanager
    def client(self):
        """A sync Prefect client for the test's server (not the session's temporary test harness)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}), get_client(sync_client=True) as client:
            yield client

    def deployment(self, name: str):
        with self.client() as client:
            return client.read_deployment_by_name(f"run-experiment/{name}")

    def wait_until_final(self, flow_run_id, timeout_s: float = RUN_TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while True:
                flow_run = client.read_flow_run(flow_run_id)
                if flow_run.state and flow_run.state.is_final():
                    return flow_run
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"flow run {flow_run_id} still {flow_run.state_name} after {timeout_s}s:\n"
                        + (self.home / "serve.log").read_text()[-3000:]
                    )
                time.sleep(1)


def run_on_a_schedule_a_minute_away(served: ServedDeployments, name: str, overrides: dict):
    """Adds a once-a-year cron schedule for the next whole minute (+1) to a deployment; waits for the run it makes.

    Nobody starts the run: the server's scheduler makes it and the `gpuflow serve` process picks it up.
    """
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.schedules import CronSchedule

    deployment = served.deployment(name)
    spec = copy.deepcopy(deployment.parameters["spec"])
    spec["train"].update(overrides)
    at = datetime.now(timezone.utc).replace(second=0, microsecond=0) + timedelta(minutes=2)
    cron = f"{at.minute} {at.hour} {at.day} {at.month} *"  # fires once (a year from now next)
    with served.client() as client:
        client.create_deployment_schedules(
            deployment.id,
            [
                DeploymentScheduleCreate(
                    schedule=CronSchedule(cron=cron, timezone="UTC"), active=True, parameters={"spec": spec}
                )
            ],
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            runs = [
                run
                for run in client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
                )
                if run.auto_scheduled
                and run.expected_start_time
                and abs((run.expected_start_time - at).total_seconds()) < 1
            ]
            if runs:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no run of {name} scheduled for {at}")
            time.sleep(2)
    return served.wait_until_final(runs[0].id)


@contextlib.contextmanager
def webhook_receiver(down_for: int = 0, headers: list | None = None):
    """A webhook on 127.0.0.1 keeping the JSON of every message it gets. Its URL carries a token of its own, for
    tests that look for the URL where it must not be (a webhook's URL is a secret). down_for: it answers 503 to that
    many requests first (a webhook down for a while), keeping none of them. headers: a list that gets each kept
    message's headers."""
    import json
    import uuid
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    messages: list[dict] = []
    refused = 0

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            nonlocal refused
            if refused < down_for:
                refused += 1
                self.send_response(503)
                self.end_headers()
                return
            messages.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null"))
            if headers is not None:
                headers.append(dict(self.headers))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hooks/{uuid.uuid4().hex}", messages
    finally:
        server.shutdown()
        server.server_close()


def files_holding(folder: Path, text: str) -> list[Path]:
    """Every file under `folder` whose bytes contain `text` (databases, logs, artifacts alike)."""
    needle = text.encode()
    return [
        path for path in folder.rglob("*") if path.is_file() and not path.is_symlink() and needle in path.read_bytes()
    ]


def the_one_message(messages: list[dict], event: str, run_id: str, flow_run_id: str, timeout_s: float = 60) -> dict:
    """The one message a run's event sent (waited for: the job's guard sends from its own process), as its fields
    (event, run, reason, cost, mlflow, prefect); fails on none, on more than one, and on one that lacks the reason,
    the cost or either link."""
    return the_messages(messages, [event], run_id, flow_run_id, timeout_s)[0]


def the_messages(
    messages: list[dict], events: list[str], run_id: str, flow_run_id: str, timeout_s: float = 60
) -> list[dict]:
    """The messages of a run's events, exactly these and in this order, each checked as the_one_message checks."""
    deadline = time.monotonic() + timeout_s
    while len(messages) < len(events) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # one more message, if one were coming, would come with the others
    assert [message["subject"].split()[-1] for message in messages] == events, messages
    return [
        message_fields(message, event, run_id, flow_run_id) for message, event in zip(messages, events, strict=True)
    ]


def message_fields(message: dict, event: str, run_id: str, flow_run_id: str) -> dict:
    fields = dict(line.split(": ", 1) for line in message["body"].splitlines())
    fields = {
        "event": event,
        "run": message["subject"].split()[1],
        "reason": fields["reason"],
        "cost": fields["cost so far"],
        "mlflow": fields["MLflow"],
        "prefect": fields["Prefect"],
    }
    assert fields["reason"] and float(fields["cost"].lstrip("$")) >= 0, message
    assert fields["mlflow"].startswith("http"), message  # Prefect's: its UI's page, or the id (temporary API)
    assert run_id in fields["mlflow"] and flow_run_id in fields["prefect"], message
    return fields
