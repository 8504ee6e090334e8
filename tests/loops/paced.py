"""The digits loop at a walking pace, for fault tests that need a run still training when they strike.

Each epoch waits `pace_s` (train.params) before its report: a long run then leaves the 2-core machine's CPU to the
tests beside it instead of training flat out for minutes, and still makes real checkpoints and metrics. Each worker
streams its shards with Ray Data in its first epoch and keeps them: a fault test's hundreds of epochs would otherwise
each pay Ray Data's streaming start (about a CPU-second a worker) to read 1,400 rows again. Ray Data's per-epoch
streaming is tested where it is the point (tests/test_ingest.py, the quickstart)."""

import time

from experiments import digits
from gpuflow.cluster import loop


def train_loop(config: dict) -> None:
    report, stream = loop.report, digits.batches
    kept = {}

    def paced_report(*args, **kwargs):
        time.sleep(config["pace_s"])
        return report(*args, **kwargs)

    def read_once(name: str, batch_size: int, shuffle: bool = False):
        if (name, batch_size) not in kept:
            kept[name, batch_size] = list(stream(name, batch_size, shuffle))
        return iter(kept[name, batch_size])

    loop.report, digits.batches = paced_report, read_once
    digits.train_loop(config)
