"""`gpuflow down` signals the warm stack's process only while its record still names it: a pid alone is reused once its
process is gone (a reboot, a crash), and the record lives in the project folder."""

import json
import os
import subprocess
import sys

from gpuflow.cluster.util.processes import alive, started_at
from tests.support.processes import wait_until
from tests.support.repo import REPO


def gpuflow_down(gpuflow_home) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow.flows.cli", "down"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GPUFLOW_HOME": str(gpuflow_home)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_down_leaves_alone_a_process_that_got_the_stacks_pid_and_removes_the_stale_record(gpuflow_home):
    record = gpuflow_home / "stack" / "stack.json"
    record.parent.mkdir(parents=True)
    unrelated = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        # the stack that wrote the record started before this process: the pid is the same, the process is not
        for started in (started_at(unrelated.pid) - 3600, None):  # None: a record from before start times were kept
            record.write_text(json.dumps({"pid": unrelated.pid, "started": started, "api_url": "http://127.0.0.1:1"}))
            said = gpuflow_down(gpuflow_home)
            assert f"removed a stale record (pid {unrelated.pid} is not the stack's" in said, said
            assert alive(unrelated.pid) and not record.exists()

        # the record of the process itself: that one is the stack's, and it is stopped with its session
        record.write_text(json.dumps({"pid": unrelated.pid, "started": started_at(unrelated.pid), "api_url": None}))
        assert gpuflow_down(gpuflow_home) == "gpuflow: warm stack stopped\n"
        wait_until(lambda: unrelated.poll() is not None, 30, "the recorded process stopped")
        assert not record.exists()
        assert gpuflow_down(gpuflow_home) == "gpuflow: warm stack was not up (nothing to stop)\n"

        # the record of a stack killed with kill -9: nothing to signal
        record.write_text(json.dumps({"pid": unrelated.pid, "started": started_at(unrelated.pid) or 1.0}))
        assert "removed a stale record" in gpuflow_down(gpuflow_home) and not record.exists()
    finally:
        unrelated.kill()
        unrelated.wait()
