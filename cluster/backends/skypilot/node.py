"""Runs on every node of a SkyPilot cluster: joins one Ray cluster, watches for a spot notice, on rank 0 runs the job.

    run: python -m gpuflow.cluster.backends.skypilot.node          (the whole `run:` of gpuflow's SkyPilot task)

Topology comes from SkyPilot's SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS / SKYPILOT_NUM_NODES; the
spec and run name from the job's environment (cluster/protocol.py: JobEnv), set by the flow.
The job on the head calls `shorten_autostop_on_node` here when it stops the run itself.
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from gpuflow.cluster.backends.base import HEAD_NODE_RESOURCES
from gpuflow.cluster.job.spot_watch import start_node_watch, stop_watches
from gpuflow.cluster.protocol import SETUP_DONE, JobEnv
from gpuflow.cluster.spec.elastic import node_resources

# Our own Ray head on 6390: SkyPilot's internal Ray uses 6380, and the default 6379 may be anyone's.
RAY_PORT = 6390
HEAD_STARTED = "Ray runtime started."  # what `ray start` prints once its node is up


def ray(*args: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def wait_until_started(head: subprocess.Popen) -> None:
    """Passes the head's output on until it says Ray runs (the rest from a thread): no probe process importing Ray."""
    for line in head.stdout:
        print(line, end="", flush=True)
        if HEAD_STARTED in line:
            threading.Thread(target=pass_on, args=(head.stdout,), daemon=True).start()
            return
    raise RuntimeError(f"`ray start --head` exited with {head.wait()}; its log is above")


def pass_on(stream) -> None:
    for line in stream:
        print(line, end="", flush=True)


def main() -> int:
    rank = int(os.environ.get("SKYPILOT_NODE_RANK", "0"))
    num_nodes = int(os.environ.get("SKYPILOT_NUM_NODES", "1"))
    head_ip = os.environ.get("SKYPILOT_NODE_IPS", "127.0.0.1").split()[0]
    address = f"{head_ip}:{RAY_PORT}"
    # Ray 2.60 wants token auth; `ray start` with RAY_AUTH_MODE=token needs the token to exist, and every
    # node needs the same one: the flow passes one per job as a secret (RAY_AUTH_TOKEN).
    if os.environ.get("RAY_AUTH_TOKEN"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    # On SIGTERM, Ray 2.60 drains the node for up to 30 s (for Ray Serve's replicas) before it stops: a cluster
    # billing 30 s for nothing at the end of every run. Our job has ended (or is being cancelled) by then.
    os.environ["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    temp_dir = tempfile.mkdtemp(prefix="gf-ray-")
    common = ["--disable-usage-stats", f"--temp-dir={temp_dir}", "--include-dashboard=false"]
    watch = start_node_watch(address, temp_dir)  # for the cloud's spot notice to this node, if it can get one
    try:
        if rank != 0:
            return subprocess.call(
                ray("start", f"--address={address}", "--block", f"--resources={json.dumps(worker_slots())}", *common)
            )
        return run_head(address, num_nodes, temp_dir, common)
    finally:
        stop_watches([watch] if watch else [])


def run_head(address: str, num_nodes: int, temp_dir: str, common: list[str]) -> int:
    """Rank 0: Ray's head, and the job beside it; returns the job's exit code."""
    print(f"{SETUP_DONE}: starting Ray on {num_nodes} node(s)", flush=True)
    # --block keeps every Ray process a child of this job, so whatever ends the job (a cancel, a Slurm
    # scancel, SIGKILL: Ray's reaper) ends Ray too; a daemonized Ray outlives it and holds the port.
    # Not `ray stop`: it stops every Ray of this user on the machine, other jobs' included.
    spec_file = Path(temp_dir) / "spec.json"
    job = JobEnv.from_env()
    spec_file.write_text(job.spec_json)
    ray_started = Path(temp_dir) / "ray-started"
    # The job starts beside Ray: its imports (seconds) overlap Ray's start. It connects once Ray is up, then waits
    # for the other nodes to join.
    job = subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "gpuflow.cluster.job",
            "--spec",
            str(spec_file),
            "--address",
            address,
            "--run-name",
            job.run_name,
            "--nodes",
            str(num_nodes),
            "--after",
            str(ray_started),
        ]
    )
    head = subprocess.Popen(
        ray(
            "start",
            "--head",
            f"--port={RAY_PORT}",
            "--block",
            f"--resources={json.dumps({**HEAD_NODE_RESOURCES, **worker_slots()})}",
            *common,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_started(head)
        ray_started.touch()
        return job.wait()
    finally:
        for process in (job, head):  # the job first: it is still waiting if Ray never started
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def worker_slots() -> dict[str, float]:
    """This node's slots for Ray Train's workers (cluster/spec/elastic.py): its spec's workers_per_node."""
    spec_json = JobEnv.from_env().spec_json
    per_node = json.loads(spec_json)["compute"]["workers_per_node"] if spec_json else 0
    return node_resources(per_node) if per_node else {}


def shorten_autostop_on_node(idle_minutes: int = 0) -> bool:
    """On a cluster's head node: make its autostop (with autodown) fire after `idle_minutes`, as `sky autostop`
    would. The job calls it when it stops itself, so a cluster whose flow is gone does not idle for long: with 0,
    SkyPilot's skylet downs it at its next check once the job has ended (it checks every 60 s), not a minute later."""
    try:
        from sky.skylet import autostop_lib

        config = autostop_lib.get_autostop_config()
        if config.autostop_idle_minutes < 0 or config.autostop_idle_minutes <= idle_minutes:
            return False
        autostop_lib.set_autostop(idle_minutes, config.backend, config.wait_for, config.down)
        return True
    except Exception as exc:  # SkyPilot's runtime not importable here: the launch's own autostop still holds
        print(f"[gpuflow] could not shorten autostop on this node: {type(exc).__name__}: {exc}", flush=True)
        return False


if __name__ == "__main__":
    sys.exit(main())
