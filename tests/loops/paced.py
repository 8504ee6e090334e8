"""The digits loop at a walking pace, for fault tests that need a run still training when they strike.

Each epoch waits `pace_s` (train.params) before its report: a long run then leaves the 2-core machine's CPU to the
tests beside it instead of training flat out for minutes, and still makes real checkpoints and metrics."""

import time

from experiments import digits
from gpuflow.cluster import loop


def train_loop(config: dict) -> None:
    report = loop.report

    def paced_report(*args, **kwargs):
        time.sleep(config["pace_s"])
        return report(*args, **kwargs)

    loop.report = paced_report
    digits.train_loop(config)
