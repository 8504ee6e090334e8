"""`gpuflow run` without a Prefect server: its temporary API serves every Prefect call of the process, is started
without loading Prefect's server package there, and never outlives the process (kill -9 included)."""

import json
import os
import subprocess
import sys
import time

import pytest

from gpuflow.flows.local_stack import temporary_api
from tests.support.repo import REPO
from tests.support.processes import processes_of
from tests.support.servers import not_http_server

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
        (gpuflow_home / "prefect").mkdir(parents=True)
        env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_API")}
        env.update(GPUFLOW_HOME=str(gpuflow_home), PREFECT_HOME=str(gpuflow_home / "prefect"),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false")
        with open(gpuflow_home / "stderr.log", "w") as log:  # a file: a pipe nobody reads would fill up and block it
            processes.append(subprocess.Popen([sys.executable, "-c", A_FLOW, *args], cwd=REPO, env=env, text=True,
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
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
