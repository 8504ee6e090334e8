"""Kills a process once its owner is gone: Prefect's temporary API server must not outlive `gpuflow run`.

    python -m gpuflow.flows.local_stack.outlive --owner 1234 --kill 5678 --kill-started 1796658700.12

`gpuflow run` stops that server at exit (flows/local_stack/temporary_api.py), but cannot when it is killed (kill -9,
OOM): this watcher, in a session of its own, does. It imports nothing heavy: it costs a few MB for the life of the run.
"""

import argparse
import os
import signal
import time

from gpuflow.cluster.util.processes import started_at, still_the_process
from gpuflow.cluster.util.waiting import wait_until

POLL_S = 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--kill", type=int, required=True)
    parser.add_argument("--kill-started", type=float, required=True, help="its start time (a pid alone is reused)")
    args = parser.parse_args()
    owner, target = (args.owner, started_at(args.owner)), (args.kill, args.kill_started)
    while still_the_process(*owner) and still_the_process(*target):
        time.sleep(POLL_S)
    if still_the_process(*target):
        os.kill(args.kill, signal.SIGTERM)
        wait_until(lambda: not still_the_process(*target), 5)
        if still_the_process(*target):
            os.kill(args.kill, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
