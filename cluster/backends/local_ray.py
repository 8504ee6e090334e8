"""Starts a real multi-node Ray cluster on 127.0.0.1 and holds it until SIGTERM (the local backend's supervisor).

    python -m cluster.backends.local_ray --nodes 2 --cpus-per-node 2 --temp-dir /tmp/gpuflow-ray/x --address-file a.txt
"""

import argparse
import os
import signal
import sys
import time

# Ray binds the host's primary address unless told this: every node on loopback, traffic stays local.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray._private.utils  # noqa: E402

# Cluster() records its address in /tmp/ray for `ray.init()` to find: no driver but ours may attach.
ray._private.utils.write_ray_address = lambda *args, **kwargs: None

from ray.cluster_utils import Cluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cpus-per-node", type=float, default=2)
    parser.add_argument("--temp-dir", required=True)
    parser.add_argument("--address-file", required=True)
    args = parser.parse_args()

    node_args = {"num_cpus": args.cpus_per_node, "object_store_memory": 200 * 1024**2}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "temp_dir": args.temp_dir, "include_dashboard": False},
    )
    for _ in range(args.nodes - 1):
        cluster.add_node(**node_args)
    cluster.wait_for_nodes()

    def stop(*_):
        cluster.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with open(args.address_file + ".tmp", "w") as f:
        f.write(cluster.address)
    os.replace(args.address_file + ".tmp", args.address_file)
    print(f"ray cluster up at {cluster.address} with {args.nodes} node(s)", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
