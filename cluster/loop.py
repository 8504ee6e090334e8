"""Conveniences for a Ray Train per-worker loop: restore, mixed precision, per-epoch checkpoints, a checkpoint just in
time on a spot notice (`preempted`, `report_preempted`), the final model (logged by cluster/loop_logging.py).

None is required: gpuflow tracks every `ray.train.report` of any loop (cluster/job/tracking.py logs
the metrics to the flow's MLflow run). Rank 0 writes the checkpoints; every rank calls `report` so
that Ray Train's workers stay in step.
"""

import contextlib
import os
import tempfile
import time

import psutil
import pyarrow.dataset as ds
import ray.train
import torch

from gpuflow.cluster.loop_logging import log_profile, log_trained_model, prepare_model_logging
from gpuflow.cluster.protocol import JobEnv, resumed_line
from gpuflow.cluster.telemetry import ProfileWindow, StepTimer, model_flops_per_sample
from gpuflow.cluster.util.ray_internals import PREEMPTION_WATCHER_ENV

CHECKPOINT_FILE = "checkpoint.pt"
# when this worker's previous epoch ended (the first: when the loop started), for perf/epoch_s
_last_report_at = time.monotonic()
_noticed: set = set()  # the preemptions this worker has seen (`preempted`), each said on the log once
_resumed: dict = {}  # what a checkpoint taken mid-epoch says of its epoch (`restore`, `resumed_within`)


def read_table(uri: str):
    """A Parquet file, folder or URI (s3://, gs://, local) as one pyarrow Table."""
    return ds.dataset(uri, format="parquet").to_table()


def rank() -> int:
    return ray.train.get_context().get_world_rank()


def autocast(precision: str, device: torch.device):
    """fp32 runs as is; bf16/fp16 run the forward pass under torch autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    # fp16 underflows small gradients without loss scaling; bf16 has fp32's range and needs none.
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def restore(model, optimizer, scaler=None) -> int:
    """Loads Ray Train's latest checkpoint, if any; returns the epoch to start from: the next, or the same one when the
    checkpoint was taken mid-epoch (`report_preempted`), whose progress `resumed_within` then gives."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as folder:
        state = torch.load(os.path.join(folder, CHECKPOINT_FILE), weights_only=False)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    _resumed.clear()
    if "within_epoch" in state:
        _resumed.update(epoch=state["epoch"], **state["within_epoch"])
        if rank() == 0:
            print(resumed_line(state["epoch"], state["within_epoch"]["step"]), flush=True)
        return state["epoch"]
    if rank() == 0:
        print(resumed_line(state["epoch"] + 1), flush=True)
    return state["epoch"] + 1


def resumed_within(epoch: int) -> dict:
    """For the epoch a mid-epoch checkpoint was taken in: {"step": steps done, **what the loop saved with them};
    {} for any other epoch. Skip that many steps, and carry on from the figures."""
    return {key: value for key, value in _resumed.items() if key != "epoch"} if _resumed.get("epoch") == epoch else {}


def preempted() -> bool:
    """True while a node of this run is under a spot notice: report a checkpoint at each such step
    (`report_preempted`) and keep training, so that when the node goes at most the step in flight is lost (a run
    that ends before the deadline is simply done). Every rank gets the same answer at the same call: call it on every
    rank, every step (or every N steps, the same N everywhere), as it is a barrier (`ray.train.get_preemption_info`,
    a round trip to Ray Train's synchronization actor). Where gpuflow left Ray Train's watch of drained nodes off (no
    spot option: no notice can come) it says False at once, asking nothing."""
    if os.environ.get(PREEMPTION_WATCHER_ENV) == "0":
        return False
    info = ray.train.get_preemption_info()
    if info is None:
        return False
    key = (info.deadline_ms, tuple(info.preempted_node_ids))
    if key not in _noticed and rank() == 0:
        left = f"{info.deadline_ms / 1000 - time.time():.0f}s" if info.deadline_ms else "an unknown time"
        print(
            f"[gpuflow] preemption notice for node(s) {', '.join(n[:12] for n in info.preempted_node_ids)}, "
            f"{left} before its deadline: a checkpoint at every step until then",
            flush=True,
        )
    _noticed.add(key)
    return True


def report_preempted(epoch: int, step: int, model, optimizer, scaler=None, **progress) -> None:
    """A checkpoint mid-epoch, on a preemption notice: `step` steps of `epoch` done, and `progress` (small numbers:
    the epoch's loss so far...) for the resumed run to finish the epoch's figures. No metrics: the epoch's report
    logs them once the epoch ends, here or after the resume (MLflow gets each epoch once)."""
    if rank() != 0:
        ray.train.report({"step": epoch})
        return
    with tempfile.TemporaryDirectory() as folder:
        state = {
            "epoch": epoch,
            "within_epoch": {"step": step, **progress},
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        if scaler is not None and scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        torch.save(state, os.path.join(folder, CHECKPOINT_FILE))
        # "step", not "epoch": gpuflow's tracking logs nothing of this report, the epoch is not over
        ray.train.report({"step": epoch}, checkpoint=ray.train.Checkpoint.from_directory(folder))


def report(epoch: int, metrics: dict, model, optimizer, scaler=None) -> None:
    """Ends an epoch: rank 0 checkpoints; gpuflow's tracking logs the metrics to MLflow at step = epoch
    once the checkpoint is persisted, and prints the progress line."""
    metrics = {key: float(value) for key, value in {**metrics, **epoch_figures()}.items()}
    if rank() != 0:
        ray.train.report(metrics)
        return
    run_id = JobEnv.from_env().mlflow_run_id
    if run_id:
        prepare_model_logging(run_id)
    with tempfile.TemporaryDirectory() as folder:
        state = {"epoch": epoch, "model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}
        if scaler is not None and scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        torch.save(state, os.path.join(folder, CHECKPOINT_FILE))
        # report() copies the folder to storage before it returns: the checkpoint survives a later failure.
        ray.train.report({**metrics, "epoch": epoch}, checkpoint=ray.train.Checkpoint.from_directory(folder))


def epoch_figures() -> dict[str, float]:
    """What gpuflow measures for any loop: the epoch's wall time (since the previous report) and this worker's RSS."""
    global _last_report_at
    now = time.monotonic()
    figures = {"perf/epoch_s": now - _last_report_at, "perf/worker_rss_mb": psutil.Process().memory_info().rss / 2**20}
    _last_report_at = now
    return figures


def telemetry(
    config: dict, model=None, flops_per_sample: float | None = None, tokens_per_sample: int | None = None
) -> StepTimer:
    """This worker's step timer (see cluster/telemetry.py); rank 0's also runs the spec's `profile` window.

    Wrap the batches, `for batch in timer.steps(loader):`, add `**timer.end_epoch()` to the metrics of
    `report`, and call `timer.close()` after the last epoch. MFU needs the model FLOPs per sample: give
    flops_per_sample, or the model (6 × parameters × tokens_per_sample, 1 token per sample by default).
    """
    import ray.train.torch

    device = ray.train.torch.get_device()
    if flops_per_sample is None and model is not None:
        flops_per_sample = model_flops_per_sample(model, tokens_per_sample or 1)
    profile = None
    if config.get("profile") and rank() == 0:
        window = config["profile"]
        profile = ProfileWindow(device, steps=window["steps"], after=window["after"], on_ready=log_profile)
    timer = StepTimer(
        device,
        precision=config.get("precision", "fp32"),
        flops_per_sample=flops_per_sample,
        tokens_per_sample=tokens_per_sample,
        world_size=ray.train.get_context().get_world_size(),
        profile=profile,
    )
    if rank() == 0:
        print(f"[gpuflow] telemetry: {timer.mfu_note}", flush=True)
    return timer


def log_model(model, input_example=None) -> None:
    """Rank 0 logs the trained model to the flow's MLflow run (as pt2 where torch.export traces it with the example,
    else pickled: cluster/loop_logging.py); other ranks do nothing."""
    run_id = JobEnv.from_env().mlflow_run_id
    if rank() != 0 or not run_id:
        return
    log_trained_model(unwrap(model).cpu(), input_example, run_id)


def unwrap(model):
    """The plain module inside DistributedDataParallel."""
    return getattr(model, "module", model)
