"""Starts a real multi-node Ray cluster on 127.0.0.1 and holds it until SIGTERM or its owner's death (the supervisor).

    python -m gpuflow.cluster.backends.local.supervisor --nodes 2 --cpus-per-node 2 --temp-dir /tmp/gf-ray-x \
        --address-file a.txt --owner-pid 123

The owner is the process that launched the cluster (the flow). When it dies (kill -9, OOM, a runner that
SIGKILLs its flow), nothing else would ever stop this cluster: the supervisor tells the jobs on it
(which end their MLflow run as orphaned), then stops every process of the cluster, itself last.
A spare cluster of the warm stack (flows/local_stack/stack.py) changes hands: the run that claims it writes its own
pid to the `owner` file in the temp dir, and from then on that process is the owner.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

# Ray binds the host's primary address unless told this: every node on loopback, traffic stays local.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from gpuflow.cluster.util.ray_internals import dead_processes, no_ray_address_file, node_id_of, raylet_pid  # noqa: E402

# Cluster() records its address in /tmp/ray for `ray.init()` to find: no driver but ours may attach.
no_ray_address_file()

from ray.cluster_utils import Cluster  # noqa: E402

from gpuflow.cluster.backends.base import HEAD_NODE_RESOURCES  # noqa: E402
from gpuflow.cluster.backends.local import LOST_FILE, NODES_FILE  # noqa: E402
from gpuflow.cluster.backends.local.early_job import OWNER_FILE  # noqa: E402
from gpuflow.cluster.config import local_ray_mode  # noqa: E402
from gpuflow.cluster.spec.elastic import node_resources  # noqa: E402
from gpuflow.cluster.util.files import write_atomically  # noqa: E402
from gpuflow.cluster.util.processes import alive, session_members, stop_sessions  # noqa: E402
from gpuflow.cluster.util.waiting import wait_until  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cpus-per-node", type=float, default=2)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--owner-pid", type=int, default=None, help="stop the cluster when this process is gone")
    parser.add_argument("--worker-slots", type=int, default=0, help="Ray Train workers a node holds (elastic runs)")
    args = parser.parse_args()

    if args.owner_pid is not None:  # from the start: an owner killed while Ray starts must not leave it behind
        threading.Thread(
            target=watch_owner, args=(args.owner_pid, Path(args.temp_dir) / OWNER_FILE), daemon=True, name="owner-watch"
        ).start()
    slots = node_resources(args.worker_slots) if args.worker_slots else {}
    node_args = {"num_cpus": args.cpus_per_node, "object_store_memory": 200 * 1024**2, "resources": slots}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node_args,
            "temp_dir": args.temp_dir,
            "include_dashboard": False,
            # the autoscaler's monitor: a local cluster's nodes are fixed (GPUFLOW_LOCAL_RAY=full keeps it)
            "no_monitor": local_ray_mode() == "lean",
            "resources": {**HEAD_NODE_RESOURCES, **slots},
            # a lost node is dead to Ray within ~3 s (default ~15 s): an elastic run restarts without it
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        },
    )
    for _ in range(args.nodes - 1):
        cluster.add_node(**node_args)
    cluster.wait_for_nodes()

    def stop(*_):
        cluster.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    folder = Path(args.temp_dir)
    write_atomically(
        folder / NODES_FILE,
        json.dumps(
            [
                {"head": node is cluster.head_node, "raylet": raylet_pid(node), "node_id": node_id_of(node)}
                for node in cluster.list_all_nodes()
            ]
        ),
    )
    write_atomically(Path(args.address_file), cluster.address)
    print(f"ray cluster up at {cluster.address} with {args.nodes} node(s)", flush=True)
    lost = None
    while True:
        if lost is None and (lost := lost_nodes(cluster)):  # e.g. a node's raylet killed: the cluster is not whole
            write_atomically(folder / LOST_FILE, lost)
            print(f"cluster lost a node: {lost}", flush=True)
        time.sleep(OWNER_POLL_S)


def watch_owner(owner_pid: int, owner_file: Path) -> None:
    while alive(owner_pid := current_owner(owner_pid, owner_file)):
        time.sleep(OWNER_POLL_S)
    print(f"owner process {owner_pid} is gone: stopping the cluster", flush=True)
    release_orphan()


def current_owner(first_owner: int, owner_file: Path) -> int:
    """The pid in the owner file once a claim wrote one, else the process that launched the cluster."""
    try:
        return int(owner_file.read_text())
    except (FileNotFoundError, ValueError):
        return first_owner


OWNER_POLL_S = 1.0


def lost_nodes(cluster) -> str | None:
    """Says which node processes died (a lost node), or None while every node is whole."""
    dead = [
        f"{'head' if node is cluster.head_node else 'worker'} node's {kind} (pid {process.pid})"
        for node in cluster.list_all_nodes()
        for kind, process in dead_processes(node)
    ]
    return ", ".join(dead) or None


# Time for a job to end its MLflow run before it is killed with the cluster. A busy tracking server with basic auth
# (a password hash per request) can hold the job's few calls behind the loop's last reports for tens of seconds.
JOB_CLOSE_S = 60.0


def release_orphan() -> None:
    """Tells this cluster's jobs their owner died, gives them a moment to close their runs, then stops everything."""
    import psutil

    from gpuflow.cluster.protocol import OWNER_DIED, JobEnv

    jobs = [
        process.pid
        for process in psutil.process_iter(["environ"])
        if JobEnv.from_env(process.info["environ"] or {}).local_cluster_session == os.getpid()
    ]
    for pid in jobs:
        try:
            os.kill(pid, OWNER_DIED)
        except ProcessLookupError:
            pass
    wait_until(lambda: not any(alive(pid) for pid in jobs), JOB_CLOSE_S)
    # each job runs in a session of its own (the job's pid): stop those that did not exit, then our own, then exit
    stop_sessions([pid for pid in jobs if session_members(pid)] + [os.getsid(0)])
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
