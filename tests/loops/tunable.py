"""A loop for sweep tests: its score is a known function of lr and hidden, so a test knows which trial wins and
which trail (ASHA stops those). It still does what a real loop does: a checkpoint per epoch, a model at the end;
train.params.pace_s makes each epoch last that long."""

import time

import numpy as np
import torch
from torch import nn

from gpuflow.cluster import loop

BEST_LR = 0.1


def score(lr: float, hidden: int, epoch: int, epochs: int) -> float:
    """Higher the nearer lr is to BEST_LR (on a log scale) and the wider the model; grows with the epochs."""
    closeness = 1 / (1 + abs(np.log10(lr / BEST_LR)))
    return float(closeness * (1 + hidden / 1000) * (epoch + 1) / epochs)


def train_loop(config: dict) -> None:
    model = nn.Sequential(nn.Linear(4, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for epoch in range(loop.restore(model, optimizer), config["epochs"]):
        loss = model(torch.ones(8, 4)).pow(2).mean()  # a real step, so that the checkpoint holds a trained model
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config.get("pace_s", 0))  # an epoch that takes a while, as real ones do: time for ASHA to act
        loop.report(epoch, {"score": score(config["lr"], config["hidden"], epoch, config["epochs"])}, model, optimizer)
    loop.log_model(model, input_example=np.zeros((1, 4), dtype=np.float32))
