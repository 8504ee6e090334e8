"""`gpuflow run` without a Prefect server: its temporary API serves every Prefect call of the process, is started
without loading Prefect's server package there, and never outlives the process (kill -9 included)."""

import json
import os
import subprocess
import sys
import time

from tests.conftest import REPO, processes_of

A_FLOW = """
import json, sys
from gpuflow.flows import temporary_api
from prefect import flow, get_client

url = temporary_api.start()

@flow
def answer():
    return 42

state = answer(return_state=True)
with get_client(sync_client=True) as client:
    [run] = client.read_flow_runs()
print(json.dumps({"url": url, "result": state.result(), "stored": run.state.name, "api": client.api_url.host,
                  "server_loaded_here": "prefect.server.api.server" in sys.modules}), flush=True)
if sys.argv[1:] == ["hang"]:
    sys.stdin.read()  # until killed
"""


def started(gpuflow_home, *args) -> subprocess.Popen:
    (gpuflow_home / "prefect").mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_API")}
    env.update(GPUFLOW_HOME=str(gpuflow_home), PREFECT_HOME=str(gpuflow_home / "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = open(gpuflow_home / "stderr.log", "w")  # a file: a pipe nobody reads would fill up and block the process
    return subprocess.Popen([sys.executable, "-c", A_FLOW, *args], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)


def test_the_temporary_api_serves_the_process_and_exits_with_it(gpuflow_home):
    process = started(gpuflow_home)
    out, _ = process.communicate(timeout=300)
    err = (gpuflow_home / "stderr.log").read_text()
    assert process.returncode == 0, err[-3000:]
    shown = json.loads(out.splitlines()[-1])
    assert shown["result"] == 42 and shown["stored"] == "Completed"
    assert shown["url"].startswith("http://127.0.0.1:") and shown["api"] == "127.0.0.1"
    assert not shown["server_loaded_here"]
    assert "Starting temporary server" not in err  # Prefect never started a second one
    assert all_gone(gpuflow_home)  # the server at once; its watcher within its poll


def test_the_temporary_api_is_stopped_when_its_process_is_killed(gpuflow_home):
    process = started(gpuflow_home, "hang")
    line = process.stdout.readline()
    assert line.startswith("{"), (gpuflow_home / "stderr.log").read_text()[-3000:]  # the server answered a flow run
    assert processes_of(gpuflow_home), "the server (and its watcher) run beside the process"
    process.kill()
    process.wait()
    assert all_gone(gpuflow_home)


def all_gone(gpuflow_home, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while processes_of(gpuflow_home) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_of(gpuflow_home) == []
