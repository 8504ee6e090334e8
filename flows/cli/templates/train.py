"""A Ray Train per-worker loop: plain Ray Train and torch, no gpuflow import. gpuflow logs every
ray.train.report to MLflow (step = "epoch"), and records each checkpoint.

    gpuflow run experiment.yaml
"""

import os
import tempfile

import ray.train
import ray.train.torch
import torch
from torch import nn


def make_data(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = 3x - 1 plus noise: replace with your own data, or set `data:` in the spec for Parquet via Ray Data."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, 1, generator=generator)
    return x, 3 * x - 1 + 0.05 * torch.randn(rows, 1, generator=generator)


def train_loop(config: dict) -> None:
    # data: a fixed seed per split, so every worker sees the same validation set
    train = torch.utils.data.TensorDataset(*make_data(2048, seed=0))
    x_val, y_val = make_data(512, seed=1)
    loader = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(train, batch_size=config["batch_size"], shuffle=True))

    # model and optimizer; resume from the last checkpoint if this run was restarted
    model = ray.train.torch.prepare_model(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        getattr(model, "module", model).load_state_dict(state["model"])
        start = state["epoch"] + 1

    for epoch in range(start, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = nn.functional.mse_loss(model(x_val), y_val).item()
        metrics = {"epoch": epoch, "train_loss": loss.item(), "val_loss": val_loss}

        # rank 0 saves the checkpoint; every rank reports, so that the workers stay in step
        if ray.train.get_context().get_world_rank() == 0:
            with tempfile.TemporaryDirectory() as folder:
                torch.save({"epoch": epoch, "model": getattr(model, "module", model).state_dict()},
                           os.path.join(folder, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)
