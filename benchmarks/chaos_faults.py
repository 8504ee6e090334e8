"""The chaos soak's runs and faults: one run (a `gpuflow run` in its own session, or a flow run of the served
deployment), and the table of faults, each applied at a random moment of a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.loops import WAITING_RUN_OVERRIDES
from tests.support.servers import BIN, REPO

FLOW_RUN_URL = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")

# The fault table: one row per fault. `target`: what it strikes (the run's flow process, its cluster, Prefect's API, a
# server, the webhook, its cluster's teardown, nothing); `down_s`: how long a server, the webhook or the teardown stays
# down.
FAULTS = [
    {"name": "none", "target": "nothing"},
    {"name": "kill-9-flow", "target": "flow", "signal": signal.SIGKILL, "group": True},
    {"name": "sigterm-run", "target": "flow", "signal": signal.SIGTERM, "group": False},
    {"name": "kill-9-raylet", "target": "cluster"},
    {"name": "cancel", "target": "api"},
    {"name": "prefect-restart", "target": "prefect", "down_s": 5},
    {"name": "mlflow-restart", "target": "mlflow", "down_s": 5},
    {"name": "webhook-down", "target": "webhook", "down_s": 30},
    {"name": "teardown-fails", "target": "teardown", "down_s": 60},
]
NOT_YET = "not yet: "  # a fault that needs the run's id or cluster is tried again until the run ends
STRIKE_WINDOW_S = (2.0, 30.0)  # seconds after a run's start: queueing, provisioning, training or teardown


def soak_overrides(stack) -> list[str]:
    """The spec of every run: the plain Ray Train loop (no data), 8 epochs of a second, one worker (one quota slot),
    a short orphan grace (12 s), tracked on the soak's MLflow server, messages to its webhook."""
    return [
        f"workdir={REPO}",
        "name=chaos-soak",
        "train.loop=tests.loops.plain:epochs_with_checkpoints",
        "train.epochs=8",
        "train.params={offset: 0, pace_s: 1}",
        *WAITING_RUN_OVERRIDES,
        "compute.workers_per_node=1",
        "limits.orphan_grace_minutes=0.2",
        "limits.max_queue_minutes=4",
        "limits.max_runtime_minutes=6",
        "tracking.register_model=false",
        f"tracking.uri={stack.mlflow_url}",
        "data=null",
        "notify.block=chaos-hook",
    ]


@dataclass
class Run:
    index: int
    via: str  # "cli" or "serve"
    fault: dict
    strike_at_s: float
    process: subprocess.Popen | None = None
    flow_run_id: str | None = None
    started: float = 0.0
    ended: float | None = None
    applied: str = ""  # what the fault did, or why it could not
    struck_s: float | None = None  # when it was applied (later than drawn while another fault held the soak)
    hung: bool = False
    without_process: bool = False  # a served run found over with no process running it
    lines: list[str] = field(default_factory=list)

    def describe(self) -> str:
        at = f"{self.struck_s:.0f}s" if self.struck_s is not None else "-"
        return (
            f"run {self.index} ({self.via}, flow run {self.flow_run_id or '?'}): fault {self.fault['name']} drawn "
            f"at {self.strike_at_s:.0f}s, applied at {at}: {self.applied or 'not applied'}"
            + (" (hung: killed)" if self.hung else "")
        )


def draw(rng: random.Random, runs: int, serve: bool) -> list[Run]:
    """Each run's fault and moment, from the seed alone; every other run through the served deployment. The faults
    come in rounds of the whole table, each round in an order of its own: as many runs as faults strike each once."""
    faults = [fault for _ in range(0, runs, len(FAULTS)) for fault in rng.sample(FAULTS, len(FAULTS))]
    return [
        Run(i, "serve" if serve and i % 2 else "cli", faults[i], rng.uniform(*STRIKE_WINDOW_S)) for i in range(runs)
    ]


def launch(run: Run, stack) -> None:
    run.started = time.monotonic()
    if run.via == "cli":
        run.process = subprocess.Popen(
            [
                str(BIN / "gpuflow"),
                "run",
                str(REPO / "experiments" / "digits.yaml"),
                *[f"--set={item}" for item in soak_overrides(stack)],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=stack.root,
            env=stack.client_env(),
            start_new_session=True,
        )
        threading.Thread(target=read_lines, args=(run,), daemon=True).start()
        return
    with stack.client() as client:
        deployment = client.read_deployment_by_name("run-experiment/run-experiment")
        spec = deployment.parameters["spec"]
        run.flow_run_id = str(client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec}).id)


def read_lines(run: Run) -> None:
    for line in run.process.stdout:
        run.lines.append(line)
        found = FLOW_RUN_URL.search(line)
        if found and not run.flow_run_id:
            run.flow_run_id = found.group(1)


def flow_processes(run: Run) -> list:
    """The processes that run the flow: the `gpuflow run` process, or the served flow run's engine process."""
    import psutil

    from tests.support.tiers import carrying

    if run.via == "cli":
        return [psutil.Process(run.process.pid)] if run.process.poll() is None else []
    return carrying("PREFECT__FLOW_RUN_ID", run.flow_run_id, {os.getpid()}, settle_s=0.5) if run.flow_run_id else []


def group_of(process, stack) -> list:
    """The flow's process group: a `gpuflow run`'s session; a served engine and those of its descendants in its
    group (it shares the serve's group, which is not the run's to kill; its cluster has a session of its own)."""
    import psutil

    group = os.getpgid(process.pid)
    if stack.serve and group == os.getpgid(stack.serve.pid):
        return [process, *[child for child in process.children(recursive=True) if safe_pgid(child.pid) == group]]
    return [p for p in psutil.process_iter() if safe_pgid(p.pid) == group]


def safe_pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def done(run: Run, stack) -> bool:
    """The run's flow is over: its process exited (cli), or its flow run is final or no process runs it (serve)."""
    if run.via == "cli":
        return run.process.poll() is not None
    with contextlib.suppress(Exception), stack.client() as client:
        state = client.read_flow_run(run.flow_run_id).state
        if state and state.is_final():
            return True
        # a served run whose engine is gone (killed, or it died as the API restarted) stays Running, Pending or
        # Cancelling: over once nothing runs it, for the reaper to judge by its silence
        run.without_process = (
            bool(state and (state.is_running() or state.is_pending() or state.is_cancelling()))
            and not flow_processes(run)
            and time.monotonic() - run.started > 60
        )
        return run.without_process
    return False


def strike(run: Run, stack) -> None:
    """Applies the run's fault now; says in run.applied what it did."""
    fault, target = run.fault, run.fault["target"]
    run.struck_s = time.monotonic() - run.started
    try:
        if target == "nothing":
            run.applied = "nothing to do"
        elif target == "flow":
            processes = flow_processes(run)
            if not processes:
                run.applied = "its flow process was already gone"
            for process in processes:
                struck = group_of(process, stack) if fault["group"] else [process]
                for member in struck:
                    with contextlib.suppress(OSError):
                        os.kill(member.pid, fault["signal"])
                run.applied = f"{fault['signal'].name} to pid {process.pid}" + (
                    f" and its group ({len(struck)} processes)" if fault["group"] else ""
                )
        elif target == "cluster":
            run.applied = kill_raylet(run, stack)
        elif target == "api":
            from prefect.states import Cancelling

            if not run.flow_run_id:
                run.applied = NOT_YET + "no flow run id known"
            else:
                with stack.client() as client:
                    client.set_flow_run_state(run.flow_run_id, Cancelling(message="chaos: cancelled"), force=True)
                run.applied = "Cancelling set through the API"
        elif target == "mlflow" and not run.flow_run_id:
            # before its flow run exists, `gpuflow run` refuses a silent server at once: the restart must strike a
            # run that has begun, the run it is to train through
            run.applied = NOT_YET + "its flow run has not begun"
        elif target in ("prefect", "mlflow"):
            stack.kill_and_restart(target, fault["down_s"])
            run.applied = f"{target} server killed (-9), restarted after {fault['down_s']}s"
        elif target == "teardown":
            run.applied = pin_cluster(run, stack, fault["down_s"])
        elif target == "webhook":
            stack.webhook.down()
            timer = threading.Timer(fault["down_s"], stack.webhook.up)
            timer.daemon = True  # the soak may end first: the webhook is closed then, and stays closed
            timer.start()
            run.applied = f"webhook down for {fault['down_s']}s"
    except Exception as exc:  # the soak goes on; the row says what the fault could not do
        run.applied = f"could not apply: {type(exc).__name__}: {str(exc)[:200]}"


def cluster_folder(run: Run, stack) -> Path | None:
    """The local backend's folder of the run's cluster; None while its flow run id is not known."""
    from gpuflow.cluster.backends import cluster_name_for

    return stack.home / "clusters" / cluster_name_for(run.flow_run_id) if run.flow_run_id else None


def kill_raylet(run: Run, stack) -> str:
    """kill -9 of the head raylet of the run's cluster (its pid in the cluster's nodes.json)."""
    folder = cluster_folder(run, stack)
    if folder is None:
        return NOT_YET + "no flow run id known"
    try:
        record = json.loads((folder / "cluster.json").read_text())
        nodes = json.loads((Path(record["temp_dir"]) / "nodes.json").read_text())
    except (OSError, ValueError, KeyError):
        return NOT_YET + "its cluster is not up (no nodes.json)"
    pid = nodes[0]["raylet"]
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL to raylet pid {pid}"


PIN = "chaos-pinned"  # a file in a cluster's folder that no one can remove, root included, while it is immutable


def pin_cluster(run: Run, stack, for_s: float) -> str:
    """Makes the run's cluster impossible to down for `for_s` seconds, as a cloud whose delete call fails does: an
    immutable file (chattr +i) in its folder, so that the local backend's down raises while it is there."""
    folder = cluster_folder(run, stack)
    if folder is None:
        return NOT_YET + "no flow run id known"
    if not (folder / "cluster.json").exists():
        return NOT_YET + "its cluster is not up"
    pin = folder / PIN
    pin.touch()
    subprocess.run(["chattr", "+i", str(pin)], check=True, capture_output=True)
    timer = threading.Timer(for_s, unpin, args=(pin,))
    timer.daemon = True  # the soak's clean-up unpins what is left
    timer.start()
    return f"its cluster pinned (chattr +i) for {for_s}s: its teardown fails meanwhile"


def unpin(pin: Path) -> None:
    subprocess.run(["chattr", "-i", str(pin)], capture_output=True)


def unpin_all(home: Path) -> None:
    for pin in (home / "clusters").glob(f"*/{PIN}"):
        unpin(pin)


def stop(run: Run) -> None:
    """Kills what is left of a run that did not end in time (its session, cli; its engine, serve)."""
    run.hung = True
    for process in flow_processes(run):
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(process.pid), signal.SIGKILL) if run.via == "cli" else process.kill()
