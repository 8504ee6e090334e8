"""The digits loop at one step every `step_pace_s` (train.params): an epoch then outlasts a spot notice's lead time.

The pace goes where the shipped loop asks for a notice at each step (gpuflow.cluster.loop.preempted), so the steps
stay real (training, the notice's barrier, checkpoints) and the 2-core machine is left to the tests beside it.
With `step_log` (a file path) rank 0 appends a line per step done, `<epoch seconds> <pid>`: a test or a benchmark
counts the steps each cluster trained, and when, from it (a cluster's job is one process per rank)."""

import os
import time
from pathlib import Path

from experiments import digits
from gpuflow.cluster import loop


def train_loop(config: dict) -> None:
    asks = loop.preempted
    step_log = config.get("step_log")

    def paced_asks() -> bool:
        if step_log and loop.rank() == 0:  # asked once a step, after its update
            with open(step_log, "a") as out:
                out.write(f"{time.time():.3f} {os.getpid()}\n")
        time.sleep(config["step_pace_s"])
        return asks()

    loop.preempted = paced_asks
    digits.train_loop(config)


def steps_done(step_log) -> list[tuple[float, int]]:
    """The steps the log records: (when done, by which process), in order."""
    if not os.path.exists(step_log):
        return []
    lines = [line.split() for line in Path(step_log).read_text().splitlines()]
    return [(float(line[0]), int(line[1])) for line in lines if len(line) == 2]  # not a line half written
