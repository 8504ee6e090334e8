"""The warm local stack: a Prefect API and a spare Ray cluster kept up between runs, so a run does not wait for them.

    gpuflow up [experiments/digits.yaml] [--idle-minutes 30]     # then gpuflow run ... as usual
    gpuflow down                                                 # or let it stop itself once idle

Without it, each `gpuflow run` starts Prefect's temporary API and a Ray cluster of its own: seconds of CPU before
the first step. With it, a run uses the stack's API and claims its spare cluster (one of the run's shape, started in
the environment the run's own cluster would get: cluster/backends/local/warm.py), which from then on is the run's
alone: owned by the run's process, downed at its end or with its death, as any other. A run from a shell with other
values starts its own cluster; `gpuflow down`, and the next stack is that shell's. The stack starts without the
run's secrets and the tracking server's credentials: a run's workers get those from the run, and no process kept
for the next run holds them.
Once no run is going, the stack starts the next spare in the shape of the last run, and the job process that waits
on it for a run (cluster/backends/local/early_job.py). It stops itself after
`--idle-minutes` without a run; its API and spare stop with it, even after a kill -9 (each watches its owner).

Without `gpuflow up`, the first `gpuflow run` on the local backend (with no Prefect server configured) leaves a stack
behind as it exits, for GPUFLOW_STACK_IDLE_MINUTES (default 10): the next run is warm without asking. Idle, it holds
a Prefect API and a spare Ray cluster (memory, and the CPU of their idle polls: benchmarks/README.md). A stack that
is gone or does not answer is ignored: the run starts cold, as without one. GPUFLOW_STACK=manual uses a stack of
`gpuflow up` and leaves none; GPUFLOW_STACK=off makes a run start its own, as without a stack.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from gpuflow.cluster.backends.local import CHILDREN, LocalBackend
from gpuflow.cluster.backends.local.early_job import credentials
from gpuflow.cluster.backends.local.warm import SPARE_PREFIX
from gpuflow.cluster.config import STARTING_ENVIRONMENT, stack_enabled, state_dir
from gpuflow.cluster.util.files import write_atomically
from gpuflow.cluster.util.processes import session_alive, started_at, still_the_process, stop_sessions
from gpuflow.cluster.util.waiting import wait_until
from gpuflow.flows.local_stack.idle import IdleClock, since_api_used

POLL_S = 1.0
UP_TIMEOUT_S = 180


def stack_file() -> Path:
    return state_dir() / "stack" / "stack.json"


def shape_file() -> Path:
    """The shape of the next spare cluster: the last run's (or `gpuflow up SPEC`'s)."""
    return state_dir() / "stack" / "shape.json"


def read_stack() -> dict | None:
    """The running stack's record (its pid, API URL, spare), or None when no stack is up (or GPUFLOW_STACK=off)."""
    if not stack_enabled():
        return None
    try:
        record = json.loads(stack_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    # a zombie (killed, not yet reaped) is not a stack, nor a process that got its pid after a reboot or a crash
    return record if still_the_process(record["pid"], record.get("started")) else None


def want_shape(shape: dict) -> None:
    write_json(shape_file(), shape)


def write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(value))


# -- gpuflow up / down ---------------------------------------------------------------------------------------------
def up(idle_minutes: float, shape: dict | None = None, secrets: Iterable[str] = ()) -> dict:
    """Starts the stack unless one is up; returns its record once its API answers and its spare (if it has a shape
    to make one of) is up."""
    return wait_until_ready(shape, start(idle_minutes, shape, secrets))


def start(idle_minutes: float, shape: dict | None = None, secrets: Iterable[str] = ()) -> subprocess.Popen | None:
    """Starts the stack's process unless one is up, and returns at once (None: one was up). It gets the environment
    this process was started with (a run's process has more by its end: what Ray, torch and MLflow set as they load),
    less the run's `secrets` and the tracking server's credentials: no process kept for the next run holds them."""
    if shape:
        want_shape(shape)
    if read_stack() is not None:
        return None
    log = state_dir() / "stack" / "stack.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuflow.flows.local_stack.stack", "--idle-minutes", f"{idle_minutes:g}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={name: value for name, value in STARTING_ENVIRONMENT.items() if name not in credentials(secrets)},
        )


def wait_until_ready(shape: dict | None, process: subprocess.Popen | None) -> dict:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        record = read_stack()
        if record and record.get("api_url") and (not shape or record.get("spare_shape") == shape):
            return record
        time.sleep(0.2)
    log = state_dir() / "stack" / "stack.log"
    tail = log.read_text()[-2000:] if log.exists() else ""
    raise RuntimeError(f"the warm stack did not come up within {UP_TIMEOUT_S}s:\n{tail}")


def down() -> str:
    """Stops the stack (its API, its spare cluster, itself) and says what it did: "stopped", "was not up", or, for a
    record naming a process that is not the stack's (gone, or its pid reused since), that it removed the record and
    signalled nothing."""
    record = read_stack()
    if record is None:
        if not stack_enabled() or not stack_file().exists():
            return "was not up (nothing to stop)"
        try:
            pid = json.loads(stack_file().read_text()).get("pid")
        except json.JSONDecodeError:
            pid = None
        stack_file().unlink(missing_ok=True)
        return f"was not up: removed a stale record (pid {pid} is not the stack's; nothing was signalled)"
    os.kill(record["pid"], signal.SIGTERM)
    wait_until(lambda: not session_alive(record["pid"]), 15)
    stop_sessions([record["pid"]])  # whatever did not stop in time
    stack_file().unlink(missing_ok=True)
    return "stopped"


# -- the stack's own process ---------------------------------------------------------------------------------------
class Stack:
    def __init__(self, idle_minutes: float):
        self.backend = LocalBackend()
        self.api = None
        self.spare: str | None = None
        self.clock = IdleClock(idle_minutes * 60, time.monotonic())

    def start_api(self) -> str:
        from gpuflow.flows.local_stack import temporary_api

        self.api = temporary_api.launch()
        return self.api.ready()

    def runs_going(self) -> bool:
        """Any local cluster up other than the spare: a run is using this machine (and its CPUs)."""
        return any(status.status == "UP" and status.name != self.spare for status in self.backend.status())

    def keep_a_spare(self) -> None:
        """A spare of the wanted shape, started only while no run goes: its start would take CPU from one."""
        record = self.backend.record(self.spare) if self.spare else None
        if record and not session_alive(record["session"]):
            self.backend.down(self.spare)
            record = None
        if record is None:  # claimed (a run renamed it: its cluster now, not ours) or gone
            self.spare = None
        try:
            shape = json.loads(shape_file().read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        if record and record.get("shape") != shape:  # the runs changed shape: this spare would never be claimed
            self.backend.down(self.spare)
            self.spare = None
        if self.spare is None and not self.runs_going():
            self.spare = f"{SPARE_PREFIX}{uuid.uuid4().hex[:12]}"
            self.backend.start_shaped(shape, self.spare, os.getpid())
            self.backend.wait_until_up(self.spare)
            self.backend.start_early_job(self.spare, os.getcwd())  # the job's imports done before a run claims it
            self.backend.offer_spare(self.spare)  # claimable from now: the stack writes its record no more
            self.clock.busy(time.monotonic())  # idle from when the spare is ready, not while it starts
            print(f"spare cluster {self.spare} up: {shape}", flush=True)

    def record(self) -> dict:
        """What `gpuflow down` and the runs read (stack.json); no API yet as it starts, no spare until one is up."""
        spare = self.backend.record(self.spare) if self.spare else None
        return {
            "pid": os.getpid(),
            "started": started_at(),
            "api_url": self.api.api_url if self.api else None,
            "idle_minutes": self.clock.idle_s / 60,
            "spare": self.spare,
            "spare_shape": spare.get("shape") if spare and spare.get("address") else None,
        }

    def serve(self) -> None:
        write_json(stack_file(), self.record())  # `gpuflow down` finds it from now
        print(f"Prefect API at {self.start_api()}", flush=True)
        self.clock.busy(time.monotonic())
        while True:
            for child in list(CHILDREN.values()):  # a spare's early job ends as a run's job: reaped here
                child.poll()
            if self.runs_going():
                self.clock.busy(time.monotonic())
            elif self.clock.idle_out(time.monotonic(), lambda: since_api_used(self.api.api_url)):
                print(f"no run for {self.clock.idle_s / 60:g} min: stopping", flush=True)
                return
            try:
                self.keep_a_spare()
            except Exception as exc:  # the spare went while it started (downed, its session gone): the API stays
                print(f"spare cluster {self.spare} lost as it started: {type(exc).__name__}: {exc}", flush=True)
                if self.spare:
                    self.backend.down(self.spare)
                self.spare = None
            write_json(stack_file(), self.record())
            time.sleep(POLL_S)

    def stop(self) -> None:
        if self.spare:
            self.backend.down(self.spare)
        if self.api:
            self.api.stop()
        try:
            if json.loads(stack_file().read_text())["pid"] == os.getpid():
                stack_file().unlink()
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-minutes", type=float, default=30)
    args = parser.parse_args()
    os.environ.pop("PREFECT_API_URL", None)  # the stack serves its own API
    stack = Stack(args.idle_minutes)

    def terminate(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminate)
    try:
        stack.serve()
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
