"""The digits loop at one step every `step_pace_s` (train.params): an epoch then outlasts a spot notice's lead time.

The pace goes where the shipped loop asks for a notice at each step (gpuflow.cluster.loop.preempted), so the steps
stay real (training, the notice's barrier, checkpoints) and the 2-core machine is left to the tests beside it."""

import time

from gpuflow.cluster import loop
from experiments import digits


def train_loop(config: dict) -> None:
    asks = loop.preempted

    def paced_asks() -> bool:
        time.sleep(config["step_pace_s"])
        return asks()

    loop.preempted = paced_asks
    digits.train_loop(config)
