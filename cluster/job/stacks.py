"""Where a hung job hangs: each Ray Train worker's Python stacks, on demand.

Each worker registers faulthandler on STACK_SIGNAL as the loop starts (`with_stack_dumps`, around the user's loop):
faulthandler writes every thread's stack from C, even while the loop holds the GIL or waits forever. The guard then
runs a task on every node (`worker_stacks`) that signals the run's workers there and reads what they wrote."""

from __future__ import annotations

import faulthandler
import functools
import inspect
import os
import signal
import tempfile
import time
from pathlib import Path

from gpuflow.cluster.util.processes import started_at, still_the_process

STACK_SIGNAL = signal.SIGUSR2
_dump_files: list = []  # open for the worker's life: faulthandler writes to the file descriptor


def stacks_folder(run_id: str) -> Path:
    """This user's folder for a run's stack files (a Slurm job's user is not whoever made /tmp's other folders)."""
    return Path(tempfile.gettempdir()) / f"gpuflow-stacks-{os.getuid()}" / run_id


def with_stack_dumps(loop, run_id: str | None):
    """The user's loop, with this worker's stacks dumpable on STACK_SIGNAL for run `run_id` (None: the loop as is)."""
    if not run_id:
        return loop
    takes_config = bool(inspect.signature(loop).parameters)

    @functools.wraps(loop)
    def train_loop(config):
        path = registered_for_dumps(run_id)
        try:
            return loop(config) if takes_config else loop()
        finally:
            if path:
                faulthandler.unregister(STACK_SIGNAL)
                path.unlink(missing_ok=True)

    return train_loop


def registered_for_dumps(run_id: str) -> Path | None:
    """Registers this worker's stack dump; None when it cannot (the loop trains anyway, only undumpable)."""
    try:
        folder = stacks_folder(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{os.getpid()}-{started_at()}.txt"  # with its start: a pid alone is reused once it is gone
        dump = open(path, "w")
    except OSError as exc:
        print(f"[gpuflow] this worker's stacks cannot be dumped if it hangs: {exc}", flush=True)
        return None
    _dump_files.append(dump)
    faulthandler.register(STACK_SIGNAL, file=dump, all_threads=True)
    return path


def dump_stacks_here(run_id: str, wait_s: float = 3.0) -> dict[str, str]:
    """On one node: signals each worker of the run that registered here, and returns what each wrote, by pid."""
    files = list(stacks_folder(run_id).glob("*.txt")) if stacks_folder(run_id).is_dir() else []
    signalled = []
    for path in files:
        pid, _, started = path.stem.partition("-")
        try:
            if still_the_process(int(pid), float(started)):  # a worker killed hard left its file, its pid reusable
                os.kill(int(pid), STACK_SIGNAL)
                signalled.append(path)
        except (ProcessLookupError, ValueError, PermissionError):
            continue
    deadline = time.time() + wait_s
    while time.time() < deadline and not all(path.stat().st_size for path in signalled):
        time.sleep(0.1)
    stacks = {path.stem.partition("-")[0]: path.read_text() for path in signalled}
    for path in files:
        path.unlink(missing_ok=True)
    return stacks


def worker_stacks(run_id: str, timeout_s: float = 30.0) -> str:
    """Every worker's stacks on every live node of the connected Ray cluster, as one text (empty if none answered)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    dump = ray.remote(num_cpus=0)(dump_stacks_here)
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    pending = {
        dump.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            run_id
        ): node.get("NodeManagerAddress", "?")
        for node in nodes
    }
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    sections = []
    for ref in ready:
        for pid, text in ray.get(ref).items():
            sections.append(f"== worker pid {pid} on node {pending[ref]} ==\n{text}")
    return "\n".join(sections)
