"""The digits loop at a walking pace, for fault tests that need a run still training when they strike.

Each epoch waits `pace_s` (train.params) before its report: a long run then leaves the 2-core machine's CPU to the
tests beside it instead of training flat out for minutes, and still makes real checkpoints and metrics.

`train_loop` streams each worker's shards with Ray Data in its first epoch and keeps them: a fault test's hundreds of
epochs would otherwise each pay Ray Data's streaming start (about a CPU-second a worker) to read 1,400 rows again.
`without_ray_data` is for a run with no `data` section: each worker takes its share of scikit-learn's digits in
memory, the split the shipped loop's Parquet files hold, so the run reads and splits nothing with Ray Data (about
7 CPU-s a run here). Ray Data's ingest is tested where it is the point (tests/test_ingest.py, the quickstart)."""

import time

from experiments import digits
from gpuflow.cluster import loop


def train_loop(config: dict) -> None:
    kept = {}
    stream = digits.batches

    def read_once(name: str, batch_size: int, shuffle: bool = False):
        if (name, batch_size) not in kept:
            kept[name, batch_size] = list(stream(name, batch_size, shuffle))
        return iter(kept[name, batch_size])

    paced(config, read_once)


def without_ray_data(config: dict) -> None:
    shares = in_memory_shares()

    def from_memory(name: str, batch_size: int, shuffle: bool = False):
        pixels, labels = shares[name]
        return ((pixels[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(labels), batch_size))

    paced(config, from_memory)


def paced(config: dict, batches) -> None:
    report = loop.report

    def paced_report(*args, **kwargs):
        time.sleep(config["pace_s"])
        return report(*args, **kwargs)

    loop.report, digits.batches = paced_report, batches
    digits.train_loop(config)


def in_memory_shares() -> dict:
    """{"train" | "validation": (pixels, labels)}: this worker's rows of the split the shipped loop's files hold."""
    import ray.train
    import torch

    context = ray.train.get_context()
    rank, workers = context.get_world_rank(), context.get_world_size()
    return {
        name: (torch.from_numpy(pixels[rank::workers].copy()), torch.from_numpy(labels[rank::workers].copy()))
        for name, (pixels, labels) in digits.split().items()
    }
