"""A `gpuflow run` that is cancelled from Prefect or sent SIGTERM leaves no cluster and no RUNNING MLflow run."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelling

from tests.loops import paced_overrides
from tests.support.processes import processes_of
from tests.support.repo import REPO
from tests.support.runs import mlflow_run_of
from tests.support.stores import seed_prefect_home

pytestmark = pytest.mark.full

FLOW_RUN_URL = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")


# a run that is still training when a test strikes, without taking the CPU from the tests beside it; what these tests
# strike is the flow, its cluster and its job, not Ray Data's ingest (each run would start its actors: ~7 CPU-s)
PACED = [arg for item in paced_overrides(0.5) for arg in ("--set", item)]
# one Ray Train worker: what these tests strike is the flow, its cluster and its job, not the workers' all-reduce
ONE_WORKER = "compute.workers_per_node=1"


class GpuflowRun:
    """`gpuflow run` as a user starts it, in its own process, its output read line by line.

    It runs the digits spec at a walking pace for 400 epochs, its digits in memory, or `spec_file` as it is.
    With `ephemeral_api`, it starts Prefect's temporary API itself (PREFECT_HOME under the gpuflow home), as a
    user without a Prefect server would; otherwise it uses the tests' Prefect server."""

    def __init__(self, gpuflow_home, *overrides: str, ephemeral_api: bool = False, spec_file=None):
        env = {**os.environ, "GPUFLOW_HOME": str(gpuflow_home)}
        if ephemeral_api:
            env.pop("PREFECT_API_URL", None)
            env["PREFECT_HOME"] = str(gpuflow_home / "prefect")
            seed_prefect_home(
                gpuflow_home / "prefect"
            )  # its database migrated once a session (tests/support/stores.py)
        else:
            env["PREFECT_API_URL"] = PREFECT_API_URL.value()
        # the digits spec, paced and long; or a spec file of the test's own, as it is
        args = [] if spec_file else ["--set", "train.epochs=400", *PACED]
        for item in overrides:
            args += ["--set", item]
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuflow.flows.cli",
                "run",
                str(spec_file or REPO / "experiments" / "digits.yaml"),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.lines, self.flow_run_id = [], None
        self.training = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def wait_for_line(self, text: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in list(self.lines)):
            assert time.monotonic() < deadline and self.process.poll() is None, "".join(self.lines[-30:])
            time.sleep(0.05)

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)
            found = FLOW_RUN_URL.search(line)
            if found and not self.flow_run_id:
                self.flow_run_id = found.group(1)
            if line.startswith("epoch ") or "[gpuflow] epoch" in line:  # a run's epoch line; a sweep trial's
                self.training.set()

    def wait_for_training(self):
        assert self.training.wait(300), "".join(self.lines[-30:])
        return self.flow_run_id

    def wait(self, timeout_s: float = 180):
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"gpuflow run still running after {timeout_s}s:\n{''.join(self.lines[-40:])}"
            ) from None
        finally:
            if self.process.poll() is None:
                self.process.kill()


def flow_run_state(flow_run_id):
    async def read():
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).state

    return asyncio.run(read())


def cancel(flow_run_id):
    async def request():
        async with get_client() as client:
            await client.set_flow_run_state(flow_run_id, Cancelling(message="cancelled by the test"), force=True)

    asyncio.run(request())


def test_cancel_from_prefect_tears_down_a_cli_run(prefect_server, digits_spec, gpuflow_home):
    run = GpuflowRun(gpuflow_home, ONE_WORKER)
    flow_run_id = run.wait_for_training()
    cancel(flow_run_id)
    assert run.wait() != 0, "".join(run.lines[-30:])

    assert flow_run_state(flow_run_id).is_cancelled()
    _, mlflow_run = mlflow_run_of(digits_spec.tracking_uri, flow_run_id, digits_spec.experiment_name)
    assert mlflow_run.info.status == "KILLED"
    assert mlflow_run.data.tags["stopped_by"] == "cancelled"
    assert processes_of(gpuflow_home) == []


def test_sigterm_tears_down_before_exit(prefect_server, digits_spec, gpuflow_home):
    run = GpuflowRun(gpuflow_home, ONE_WORKER)
    flow_run_id = run.wait_for_training()
    run.process.send_signal(signal.SIGTERM)
    assert run.wait() != 0

    _, mlflow_run = mlflow_run_of(digits_spec.tracking_uri, flow_run_id, digits_spec.experiment_name)
    assert mlflow_run.info.status == "KILLED"
    assert not flow_run_state(flow_run_id).is_running()
    assert processes_of(gpuflow_home) == []
    assert list((gpuflow_home / "checkpoints").glob("*/checkpoint_*")), "the checkpoints made before SIGTERM are kept"
