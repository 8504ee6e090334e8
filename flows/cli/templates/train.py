"""A Ray Train per-worker loop: plain Ray Train and torch, no gpuflow import. gpuflow logs every
ray.train.report to MLflow (step = "epoch"), and records each checkpoint; a spot notice gets one mid-epoch.

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
        torch.utils.data.DataLoader(train, batch_size=config["batch_size"], shuffle=True)
    )

    # model and optimizer; resume from the last checkpoint if this run was restarted (mid-epoch after a spot notice)
    model = ray.train.torch.prepare_model(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start, skip = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        getattr(model, "module", model).load_state_dict(state["model"])
        start, skip = (state["epoch"], state["step"]) if "step" in state else (state["epoch"] + 1, 0)

    for epoch in range(start, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        model.train()
        loss = torch.zeros(())
        for step, (x, y) in enumerate(loader):
            if epoch == start and step < skip:  # done before the restart
                continue
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # a spot notice for a node of this run: a checkpoint each step until it goes (every rank asks every step)
            if ray.train.get_preemption_info() is not None:
                report({}, {"epoch": epoch, "step": step + 1}, model)
        model.eval()
        with torch.no_grad():
            val_loss = nn.functional.mse_loss(model(x_val), y_val).item()
        report({"epoch": epoch, "train_loss": loss.item(), "val_loss": val_loss}, {"epoch": epoch}, model)


def report(metrics: dict, state: dict, model) -> None:
    """Rank 0 saves the checkpoint; every rank reports, so that the workers stay in step."""
    if ray.train.get_context().get_world_rank() == 0:
        with tempfile.TemporaryDirectory() as folder:
            torch.save(
                {**state, "model": getattr(model, "module", model).state_dict()}, os.path.join(folder, "state.pt")
            )
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
    else:
        ray.train.report(metrics)
