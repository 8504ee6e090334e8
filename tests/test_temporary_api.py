"""`gpuflow run` without a Prefect server: its temporary API serves every Prefect call of the process, is started
without loading Prefect's server package there, and never outlives the process (kill -9 included)."""

import json
import os
import subprocess
import sys
import time

import pytest

from gpuflow.flows.local_stack import temporary_api
from tests.support.processes import processes_of
from tests.support.repo import REPO
from tests.support.servers import not_http_server
from tests.support.stores import seed_prefect_home

A_FLOW = """
import json, socket, sys
from urllib.parse import urlsplit
from gpuflow.flows.local_stack import temporary_api
from prefect import flow, get_client

api = temporary_api.launch()
with socket.socket() as other:  # another process (Ray's servers take ports all the time) binding it meanwhile
    try:
        other.bind(("127.0.0.1", urlsplit(api.api_url).port))
        held = False
    except OSError:
        held = True
url = api.ready()

@flow
def answer():
    return 42

state = answer(return_state=True)
with get_client(sync_client=True) as client:
    [run] = client.read_flow_runs()
print(json.dumps({"url": url, "held": held, "result": state.result(), "stored": run.state.name,
                  "api": client.api_url.host, "server_loaded_here": "prefect.server.api.server" in sys.modules}),
      flush=True)
if "hang" in sys.argv:
    sys.stdin.read()  # until killed
"""


@pytest.fixture
def started(gpuflow_home):
    """Starts A_FLOW in a process of its own; kills it at the end of the test if the test did not."""
    processes = []

    def start(*args) -> subprocess.Popen:
        (gpuflow_home / "prefect").mkdir(parents=True, exist_ok=True)
        env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_API")}
        env.update(
            GPUFLOW_HOME=str(gpuflow_home),
            PREFECT_HOME=str(gpuflow_home / "prefect"),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
        )
        with open(gpuflow_home / "stderr.log", "w") as log:  # a file: a pipe nobody reads would fill up and block it
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", A_FLOW, *args],
                    cwd=REPO,
                    env=env,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                )
            )
        return processes[-1]

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdin.close()
        process.stdout.close()


@pytest.mark.cluster
def test_the_temporary_api_serves_the_process_and_exits_with_it(started, gpuflow_home):
    process = started()
    out, _ = process.communicate(timeout=300)
    err = (gpuflow_home / "stderr.log").read_text()
    assert process.returncode == 0, err[-3000:]
    shown = json.loads(out.splitlines()[-1])
    assert shown["result"] == 42 and shown["stored"] == "Completed"
    assert shown["url"].startswith("http://127.0.0.1:") and shown["api"] == "127.0.0.1"
    assert shown["held"], "the port is the server's from the moment it is chosen, before the server starts"
    assert not shown["server_loaded_here"]
    assert "Starting temporary server" not in err  # Prefect never started a second one
    assert all_gone(gpuflow_home)  # the server at once; its watcher within its poll


def test_what_answers_on_a_port_counts_only_if_it_is_an_http_api():
    with not_http_server() as port:  # as Ray's gRPC servers do, on a port the API had before
        assert not temporary_api.answers(f"http://127.0.0.1:{port}/api", timeout_s=5)


@pytest.mark.cluster
def test_the_temporary_api_is_stopped_when_its_process_is_killed(started, gpuflow_home):
    seed_prefect_home(gpuflow_home / "prefect")  # a first run's migration is the test above's; this one kills
    process = started("hang")
    line = process.stdout.readline()
    assert line.startswith("{"), (gpuflow_home / "stderr.log").read_text()[-3000:]  # the server answered a flow run
    assert processes_of(gpuflow_home), "the server (and its watcher) run beside the process"
    process.kill()
    process.wait()
    assert all_gone(gpuflow_home)


def all_gone(gpuflow_home, within_s: float = 30) -> bool:  # the watcher's poll, SIGTERM, 5 s, SIGKILL; a busy machine
    deadline = time.monotonic() + within_s
    while processes_of(gpuflow_home) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_of(gpuflow_home) == []


@pytest.mark.parametrize(
    "name, text",
    [
        ("prefect.toml", "[api]\nurl = 'http://127.0.0.1:4200/api'\n"),
        (".env", "PREFECT_API_URL=http://127.0.0.1:4200/api\n"),
        ("pyproject.toml", "[tool.prefect.api]\nurl = 'http://127.0.0.1:4200/api'\n"),
        ("profiles.toml", "[profiles.team]\nPREFECT_API_URL = 'x'\n"),
    ],
)
def test_a_settings_file_leaves_the_api_to_start_once_prefect_has_read_it(tmp_path, monkeypatch, name, text):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert temporary_api.settings_files() == []
    (tmp_path / ".env").write_text("OTHER=1\n")  # files that say nothing of Prefect's settings do not count
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\ndependencies = ['prefect']\n")
    assert temporary_api.settings_files() == []
    path = (tmp_path / "home" if name == "profiles.toml" else tmp_path) / name
    path.write_text(text)
    assert [found.name for found in temporary_api.settings_files()] == [name]
    assert temporary_api.launch_before_prefect() is None


def test_a_server_started_before_prefect_is_stopped_when_the_settings_want_none(gpuflow_home, tmp_path):
    """Launched before Prefect's settings are read (none is configured in the environment), it is stopped once they
    say no temporary server may start: nothing is left of it, and the command uses none."""
    check = (
        "import psutil\n"
        "from gpuflow.flows.local_stack.prefect_api import temporary_api_launched\n"
        "api = temporary_api_launched()\n"
        "servers = [child for child in psutil.Process().children() if 'uvicorn' in ' '.join(child.cmdline())]\n"
        "print(api, len(servers))\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_API")}
    env.update(
        GPUFLOW_HOME=str(gpuflow_home),
        PREFECT_HOME=str(gpuflow_home / "prefect"),
        PREFECT_SERVER_EPHEMERAL_ENABLED="false",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["None", "0"]
    assert all_gone(gpuflow_home)


@pytest.mark.parametrize("recorded", ["its own start", "another start"])
def test_the_watcher_signals_only_the_process_it_was_given(recorded):
    """Its owner gone, the watcher stops the server it watches; a pid whose start time is not the one it was given
    (the server gone, the pid another's since) it leaves alone."""
    from gpuflow.cluster.util.processes import started_at

    target = subprocess.Popen(["sleep", "60"], start_new_session=True)
    owner = subprocess.Popen(["true"])
    owner.wait()
    started = started_at(target.pid) if recorded == "its own start" else 1.0
    try:
        watcher = [sys.executable, "-m", "gpuflow.flows.local_stack.outlive", "--owner", str(owner.pid)]
        subprocess.run([*watcher, "--kill", str(target.pid), "--kill-started", str(started)], timeout=30, check=True)
        time.sleep(0.2)
        assert (target.poll() is None) == (recorded == "another start"), recorded
    finally:
        target.kill()
        target.wait()
