"""Digits MLP: scikit-learn's bundled 8×8 digits (no download), trained with Ray Train DDP on CPU or GPU.

gpuflow run experiments/digits.yaml
"""

import itertools
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.train.torch
import torch
from ray.data.collate_fn import NumpyBatchCollateFn
from torch import nn

from gpuflow.cluster import loop


def write_parquet(train_uri: str, validation_uri: str) -> None:
    """Writes the split (split()) as Parquet; the validation split is never trained on."""
    from pathlib import Path

    halves = split()
    for uri, name in ((train_uri, "train"), (validation_uri, "validation")):
        pixels, labels = halves[name]
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        table = pa.table(
            {"pixels": pa.array(list(pixels), pa.list_(pa.float32())), "label": pa.array(labels, pa.int64())}
        )
        pq.write_table(table, uri)


def split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The 1,797 digits split 80/20 with a fixed seed: {"train" | "validation": (pixels in [0, 1], labels)}."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    cut = int(0.8 * len(order))
    pixels, labels = digits.data.astype(np.float32) / 16.0, digits.target.astype(np.int64)
    return {name: (pixels[rows], labels[rows]) for name, rows in (("train", order[:cut]), ("validation", order[cut:]))}


class PixelsAndLabels(NumpyBatchCollateFn):
    """A Ray Data batch (numpy columns) as the (pixels, labels) tensors the model takes."""

    def __call__(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.stack(batch["pixels"])), torch.from_numpy(
            np.array(batch["label"])
        )  # a copy: Arrow's buffers are read-only


def batches(name: str, batch_size: int, shuffle: bool = False):
    """This worker's share of a dataset, streamed from Parquet in batches (Ray Data splits it across workers)."""
    return ray.train.get_dataset_shard(name).iter_torch_batches(
        batch_size=batch_size,
        collate_fn=PixelsAndLabels(),
        local_shuffle_buffer_size=8 * batch_size if shuffle else None,
    )


def accuracy(model, device, precision: str) -> torch.Tensor:
    """Accuracy on the whole held-out split: each worker scores its shard, the counts are summed over workers."""
    counts = torch.zeros(2, device=device)
    with torch.no_grad(), loop.autocast(precision, device):
        for pixels, labels in batches("validation", batch_size=1024):
            counts += torch.stack(
                [(model(pixels).argmax(dim=1) == labels).sum(), torch.tensor(len(labels), device=device)]
            )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    return counts[0] / counts[1]


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def lr_at(epoch: int, config: dict) -> float:
    """Cosine decay from train.lr toward 0, so the last epochs settle rather than jump; a resumed run gets the same."""
    return config["lr"] * 0.5 * (1 + math.cos(math.pi * epoch / config["epochs"]))


def train_loop(config: dict) -> None:
    # data: data.train / data.validation arrive as Ray Data shards, streamed and split across workers
    device = ray.train.torch.get_device()

    # model, optimizer, precision
    model = ray.train.torch.prepare_model(make_model(config.get("hidden", 128)))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    scaler = loop.grad_scaler(config["precision"], device)
    start_epoch = loop.restore(model, optimizer, scaler)
    timer = loop.telemetry(config, model=model)  # an MLP does 6 FLOPs per parameter per sample

    for epoch in range(start_epoch, config["epochs"]):
        if epoch == config.get("fail_at_epoch"):  # lets tests and users rehearse a failure mid-run
            raise RuntimeError(f"fail_at_epoch={epoch}: failing on purpose")

        # forward, backward, update
        for group in optimizer.param_groups:
            group["lr"] = lr_at(epoch, config)
        model.train()
        done = loop.resumed_within(epoch)  # this epoch's steps before a preemption (their checkpoint), if any
        total_loss, steps = done.get("loss", 0.0), done.get("step", 0)
        shuffled = batches("train", config["batch_size"], shuffle=True)
        for pixels, labels in timer.steps(itertools.islice(shuffled, steps, None)):
            with loop.autocast(config["precision"], device):
                loss = nn.functional.cross_entropy(model(pixels), labels)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total_loss, steps = total_loss + loss.item(), steps + 1
            if loop.preempted():  # a node of the run has its spot notice: a checkpoint each step until it goes
                loop.report_preempted(epoch, steps, model, optimizer, scaler, loss=total_loss)

        # evaluate on the held-out split, then checkpoint (gpuflow logs the report to MLflow)
        model.eval()
        metrics = {
            "train_loss": total_loss / max(steps, 1),
            "val_accuracy": accuracy(model, device, config["precision"]),
        }
        loop.report(epoch, {**metrics, **timer.end_epoch()}, model, optimizer, scaler)

    timer.close()
    loop.log_model(model, input_example=np.zeros((2, 64), dtype=np.float32))
