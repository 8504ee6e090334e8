"""A loop that reports `hang_after` epochs, then waits forever for data that never comes (a stuck reader)."""

import threading

import ray.train


def train_loop(config: dict) -> None:
    for epoch in range(config["hang_after"]):
        ray.train.report({"epoch": epoch, "train_loss": 1.0 / (epoch + 1)})
    never = threading.Event()
    never.wait()  # HANGS HERE: the line the stack artifact must name
