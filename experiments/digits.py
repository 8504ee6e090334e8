"""Digits MLP: scikit-learn's bundled 8×8 digits (no download), trained with Ray Train DDP on CPU or GPU.

    gpuflow run experiments/digits.yaml
"""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cluster import loop


def write_parquet(train_uri: str, validation_uri: str) -> None:
    """Splits the 1,797 digits 80/20 with a fixed seed; the validation split is never trained on."""
    from pathlib import Path

    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    cut = int(0.8 * len(order))
    for uri, rows in ((train_uri, order[:cut]), (validation_uri, order[cut:])):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({
            "pixels": pa.array(list(digits.data[rows].astype(np.float32) / 16.0), pa.list_(pa.float32())),
            "label": pa.array(digits.target[rows], pa.int64()),
        })
        pq.write_table(table, uri)


def load(uri: str) -> TensorDataset:
    table = loop.read_table(uri)
    pixels = np.stack(table.column("pixels").to_numpy(zero_copy_only=False))
    labels = table.column("label").to_numpy().copy()  # Arrow's buffers are read-only; torch wants to own them
    return TensorDataset(torch.from_numpy(pixels), torch.from_numpy(labels))


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train_loop(config: dict) -> None:
    # data: each worker reads the Parquet; prepare_data_loader shards it with a DistributedSampler
    train = ray.train.torch.prepare_data_loader(DataLoader(load(config["train_path"]), batch_size=config["batch_size"], shuffle=True))
    validation = load(config["validation_path"])
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
        if ray.train.get_context().get_world_size() > 1:
            train.sampler.set_epoch(epoch)

        # forward, backward, update
        model.train()
        total_loss, batches = 0.0, 0
        for pixels, labels in timer.steps(train):
            with loop.autocast(config["precision"], device):
                loss = nn.functional.cross_entropy(model(pixels), labels)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total_loss, batches = total_loss + loss.item(), batches + 1

        # evaluate on the held-out split, then checkpoint and log
        model.eval()
        with torch.no_grad(), loop.autocast(config["precision"], device):
            pixels, labels = validation.tensors
            predictions = model(pixels.to(device)).argmax(dim=1).cpu()
        metrics = {"train_loss": total_loss / batches, "val_accuracy": (predictions == labels).float().mean()}
        loop.report(epoch, {**metrics, **timer.end_epoch()}, model, optimizer, scaler)

    timer.close()
    loop.log_model(model, input_example=validation.tensors[0][:2].numpy())
