"""MLflow REST calls of one `gpuflow run` of the digits spec, on MLflow's basic-auth server, and what they cost it.

    python benchmarks/mlflow_calls.py [--runs 1] [--label after] [--trace] [--no-record]

Starts `mlflow server --app-name basic-auth` (SQLite stores, one worker) on a free port of 127.0.0.1, and in front of
it a small counting reverse proxy: the run's tracking.uri is the proxy, which forwards every request as is and counts
it by method and path (ids folded). On this server every authenticated request costs a password check (scrypt), so
the calls are the server's CPU: its process tree's CPU-seconds are measured over the run too. Prints the calls by
path, the total and the server's CPU-seconds, and records a row in benchmarks/README.md (## mlflow_calls); --trace
prints each call as it is made, with the process that made it.
Everything it starts (server, proxy, the run) is stopped at its end, whatever happened; it writes into a temp folder
only, but for the README's table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import psutil

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "experiments" / "digits.yaml"
BIN = Path(sys.executable).parent
ADMIN = "admin"
RUN_TIMEOUT_S = 900
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
IDS = [
    (re.compile(r"(mlflow-artifacts/artifacts)/.*"), r"\1/…"),  # artifact up/downloads: one path per file
    (re.compile(r"m-[0-9a-f]{32}"), "{model_id}"),
    (re.compile(r"\b[0-9a-f]{32}\b"), "{run_id}"),
]
API_PREFIX = re.compile(r"^/(ajax-)?api/[23]\.0/(mlflow/)?")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoint(method: str, path: str) -> str:
    """A request as the table counts it: `POST runs/log-batch`, ids folded."""
    for pattern, replacement in IDS:
        path = pattern.sub(replacement, path)
    return f"{method} {API_PREFIX.sub('', path)}"


class CountingProxy(ThreadingHTTPServer):
    """Forwards every request to the server (method, path, headers, body), counting them by endpoint and status."""

    daemon_threads = True

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), Forward)
        self.upstream_port = upstream_port
        self.calls: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()
        self.trace = False  # print each call as it is forwarded (time, endpoint, status, what a JSON body holds)
        self.started = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.statuses.clear()


class Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's session expects

    def log_message(self, *args) -> None:
        pass

    def body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers
                pass
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def forward(self) -> None:
        body = self.body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = f"127.0.0.1:{self.server.upstream_port}"
        if body is not None:
            headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=600)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            status, reason, reply_headers, data = (
                response.status,
                response.reason,
                response.getheaders(),
                response.read(),
            )
        except OSError as exc:
            status, reason, reply_headers, data = 502, "Bad Gateway", [], str(exc).encode()
        finally:
            upstream.close()
        with self.server.lock:
            self.server.calls[endpoint(self.command, urlsplit(self.path).path)] += 1
            self.server.statuses[status] += 1
            if self.server.trace:
                print(
                    f"[proxy] {time.monotonic() - self.server.started:7.2f} {status} "
                    f"{endpoint(self.command, urlsplit(self.path).path)} {summary(body)} "
                    f"<- {caller(self.client_address[1])}",
                    flush=True,
                )
        self.send_response_only(status, reason)
        for key, value in reply_headers:
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = forward


def caller(port: int) -> str:
    """The process on the client's side of a connection from 127.0.0.1:port (for --trace)."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.pid:
            with contextlib.suppress(psutil.Error):
                command = psutil.Process(connection.pid).cmdline()
                name = command[0] if command and command[0].startswith("ray::") else " ".join(command[1:4])
                return f"{connection.pid} {name[:60]}"
    return "?"


def summary(body: bytes | None) -> str:
    """What a JSON request body holds, shortly: its lists' lengths, its tags' keys; nothing for other bodies."""
    import json

    try:
        payload = json.loads(body or b"")
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    shown = []
    for key, value in payload.items():
        if key == "tags" and isinstance(value, list):
            shown.append(f"tags={[tag.get('key') for tag in value if isinstance(tag, dict)]}")
        elif isinstance(value, list):
            shown.append(f"{key}={len(value)}")
        elif key in ("key", "status", "metric_key", "run_id") or key.endswith("name"):
            shown.append(f"{key}={value}")
    return " ".join(shown)[:200]


class TreeCpu(threading.Thread):
    """CPU-seconds of a process and its descendants, sampled until `stop()`: a worker that exits keeps its last
    sample."""

    def __init__(self, pid: int):
        super().__init__(daemon=True, name="bench-cpu")
        self.pid, self.seen, self.done = pid, {}, threading.Event()

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for process in processes:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                self.seen[(process.pid, process.create_time())] = times.user + times.system

    def total(self) -> float:
        self.sample()
        return sum(self.seen.values())

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.sample()

    def stop(self) -> None:
        self.done.set()


@contextlib.contextmanager
def basic_auth_server(scratch: Path):
    """`mlflow server --app-name basic-auth` on SQLite; yields (process, port, admin password)."""
    password = secrets.token_hex(12)
    config = scratch / "basic_auth.ini"
    config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{scratch}/auth.db\nadmin_username = {ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
    }
    for _attempt in range(3):  # a port probed free can be taken before the server binds it
        port = free_port()
        log = scratch / "mlflow-server.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [
                    str(BIN / "mlflow"),
                    "server",
                    "--app-name",
                    "basic-auth",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--workers",
                    "1",
                    "--backend-store-uri",
                    f"sqlite:///{scratch}/mlflow.db",
                    "--artifacts-destination",
                    str(scratch / "artifacts"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=scratch,
                start_new_session=True,
            )
        try:
            if wait_for_health(f"http://127.0.0.1:{port}/health", process, log):
                yield process, port, password
                return
        finally:
            stop_group(process)
    raise RuntimeError(f"mlflow server did not start:\n{log.read_text()[-3000:]}")


def wait_for_health(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 240) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if "already in use" in log.read_text().lower():
                return False
            raise RuntimeError(f"mlflow server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return True
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")


def stop_group(process: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group (a run tears its cluster down on it), then SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def gpuflow_run(home: Path, tracking_uri: str, password: str) -> float:
    """One `gpuflow run` of the digits spec as the admin user, its state in `home`; returns its wall seconds."""
    env = {
        **os.environ,
        "GPUFLOW_HOME": str(home),
        "GPUFLOW_STACK": "off",
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_USERNAME": ADMIN,
        "MLFLOW_TRACKING_PASSWORD": password,
    }
    env.pop("PREFECT_API_URL", None)
    settings = [
        f"data.train={home}/data/train.parquet",
        f"data.validation={home}/data/validation.parquet",
        f"tracking.uri={tracking_uri}",
        "secrets=[MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD]",
    ]
    command = [str(BIN / "gpuflow"), "run", str(SPEC), *[arg for item in settings for arg in ("--set", item)]]
    home.mkdir(parents=True, exist_ok=True)
    log = home / "gpuflow-run.log"
    started = time.monotonic()
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    try:
        code = process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        stop_group(process)
    if code != 0:
        raise RuntimeError(f"gpuflow run exited {code}:\n{log.read_text()[-4000:]}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="digits runs, one after the other; figures per run")
    parser.add_argument("--label", default="", help="a word for the table's row, e.g. before / after")
    parser.add_argument("--no-record", action="store_true", help="print only, add no row to benchmarks/README.md")
    parser.add_argument("--trace", action="store_true", help="print every call as it is made")
    args = parser.parse_args()
    # Stopped early (a `timeout`, a kill), it still stops what it started: SIGTERM runs the finally blocks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    scratch = Path(tempfile.mkdtemp(prefix="gpuflow-bench-mlflow-"))
    try:
        with basic_auth_server(scratch) as (server, port, password):
            proxy = CountingProxy(port)
            proxy.trace = args.trace
            threading.Thread(target=proxy.serve_forever, daemon=True, name="bench-proxy").start()
            cpu = TreeCpu(server.pid)
            try:
                cpu.start()
                walls, cpu_before = [], cpu.total()
                for i in range(args.runs):
                    walls.append(gpuflow_run(scratch / f"home-{i}", proxy.url, password))
                    print(f"run {i + 1}: {walls[-1]:.1f} s, {sum(proxy.calls.values())} calls so far", flush=True)
                server_cpu = cpu.total() - cpu_before
            finally:
                cpu.stop()
                proxy.shutdown()
                proxy.server_close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    calls, runs = proxy.calls, args.runs
    total = sum(calls.values())
    print(f"\nMLflow REST calls per run (of {runs} run(s)), by endpoint:")
    for name, count in calls.most_common():
        print(f"  {count / runs:6.1f}  {name}")
    print(f"  {total / runs:6.1f}  total; statuses {dict(proxy.statuses)}")
    print(f"server CPU-s per run {server_cpu / runs:.1f}; run wall s {sum(walls) / runs:.1f}")
    top = ", ".join(f"{name.split(' ', 1)[1]} {count / runs:g}" for name, count in calls.most_common(4))
    if not args.no_record:
        sys.path.insert(0, str(REPO))
        from benchmarks.record import record

        record(
            "mlflow_calls",
            {
                "label": args.label or "—",
                "runs": runs,
                "calls per run": total / runs,
                "server CPU-s per run": server_cpu / runs,
                "run wall s": sum(walls) / runs,
                "top calls per run": top,
            },
        )


if __name__ == "__main__":
    main()
