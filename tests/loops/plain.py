"""Training loops written against Ray Train alone (no gpuflow import), as a user would; the tracking tests run them."""

import json
import os
import tempfile
import time

import ray.train


def epochs_with_checkpoints(config: dict) -> None:
    """Reports `loss` = offset + epoch at step = epoch, rank 0 with a checkpoint; starts at config['first_epoch'];
    waits config['pace_s'] before each report, if given."""
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(config.get("first_epoch", 0), config["epochs"]):
        time.sleep(config.get("pace_s", 0))
        metrics = {
            "epoch": epoch,
            "loss": config["offset"] + epoch,
            "eval": {"accuracy": 0.5},
            "note": "text is skipped",
        }
        if rank == 0:
            with tempfile.TemporaryDirectory() as folder:
                with open(os.path.join(folder, "state.json"), "w") as f:
                    json.dump({"epoch": epoch}, f)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)


def no_step_given(config: dict) -> None:
    """Reports without an epoch or step: the report's index is the step."""
    for value in (3.0, 2.0, 1.0):
        ray.train.report({"loss": value})


def record_shards(config: dict) -> None:
    """Writes the ids each worker reads of each dataset, per epoch, to config['out']/<rank>-<epoch>.json."""
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(config["epochs"]):
        seen = {
            name: sorted(
                int(i) for batch in ray.train.get_dataset_shard(name).iter_batches(batch_size=16) for i in batch["id"]
            )
            for name in config["datasets"]
        }
        with open(os.path.join(config["out"], f"{rank}-{epoch}.json"), "w") as f:
            json.dump(seen, f)
        ray.train.report({"epoch": epoch})


def report_shell(config: dict) -> None:
    """Reports, as `shell_value`, the number in the variable config['variable'] that the workers' environment has
    (-1: none): what the shell that started the run gave them, cold or warm."""
    value = float(os.environ.get(config["variable"], -1))
    ray.train.report({"epoch": 0, "shell_value": value})
