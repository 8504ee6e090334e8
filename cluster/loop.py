"""Conveniences for a Ray Train per-worker loop: restore, mixed precision, per-epoch checkpoints, a checkpoint just in
time on a spot notice (`preempted`, `report_preempted`), the final model.

None is required: gpuflow tracks every `ray.train.report` of any loop (cluster/job/tracking.py logs
the metrics to the flow's MLflow run). Rank 0 writes the checkpoints; every rank calls `report` so
that Ray Train's workers stay in step.
"""

import contextlib
import os
import shutil
import sys
import tempfile
import time

import psutil
import pyarrow.dataset as ds
import ray.train
import torch

from gpuflow.cluster.protocol import JobEnv, resumed_line
from gpuflow.cluster.telemetry import ProfileWindow, StepTimer, model_flops_per_sample
from gpuflow.cluster.util.errors import caused_by
from gpuflow.cluster.util.preload import import_in_background
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
        print(f"[gpuflow] preemption notice for node(s) {', '.join(n[:12] for n in info.preempted_node_ids)}, "
              f"{left} before its deadline: a checkpoint at every step until then", flush=True)
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
        state = {"epoch": epoch, "within_epoch": {"step": step, **progress}, "model": unwrap(model).state_dict(),
                 "optimizer": optimizer.state_dict()}
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


def telemetry(config: dict, model=None, flops_per_sample: float | None = None,
              tokens_per_sample: int | None = None) -> StepTimer:
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
    timer = StepTimer(device, precision=config.get("precision", "fp32"), flops_per_sample=flops_per_sample,
                      tokens_per_sample=tokens_per_sample, world_size=ray.train.get_context().get_world_size(),
                      profile=profile)
    if rank() == 0:
        print(f"[gpuflow] telemetry: {timer.mfu_note}", flush=True)
    return timer


def log_profile(folder) -> None:
    """Rank 0's profiler trace and operator table into the flow's MLflow run, under profile/."""
    run_id = JobEnv.from_env().mlflow_run_id
    if not run_id:
        print(f"[gpuflow] profile written to {folder} (no MLflow run to log it to)", flush=True)
        return
    from mlflow import MlflowClient

    when_mlflow_answers(lambda: MlflowClient().log_artifacts(run_id, str(folder), artifact_path="profile"), "profile")
    shutil.rmtree(folder, ignore_errors=True)
    print("[gpuflow] profile logged to MLflow: profile/trace.json (open in https://ui.perfetto.dev), "
          "profile/top_operators.txt", flush=True)


# run id -> (experiment id, params) of the flow's run, read once by rank 0 while it trains (prepare_model_logging)
_runs: dict[str, tuple[str, dict[str, str]]] = {}


def run_facts(run_id: str) -> tuple[str, dict[str, str]]:
    """The run's experiment and params: what the logged model records (read once per process)."""
    if run_id not in _runs:
        from mlflow import MlflowClient

        run = MlflowClient().get_run(run_id)
        _runs[run_id] = (run.info.experiment_id, dict(run.data.params))
    return _runs[run_id]


def prepare_model_logging(run_id: str) -> None:
    """Does once, while training goes on, what `log_model` would otherwise make the end of the run wait for (seconds on
    a small machine): import MLflow's PyTorch flavour and torch.export, and open the tracking store (SQLite: SQLAlchemy and
    MLflow's table models imported, the schema checked), reading what the logged model records of the run. Not the pt2
    save itself: torch.export patches torch process-wide while it traces, and a trace beside the training loop broke its
    next step."""
    import_in_background("mlflow.pytorch", "torch.export._trace", then=lambda: run_facts(run_id))


def log_model(model, input_example=None) -> None:
    """Rank 0 logs the trained model to the flow's MLflow run; other ranks do nothing.

    The logged model is created here, in the run's experiment, from the run (its params, as MLflow's log_model records
    them), and linked to the run as its output; then MLflow's log_model saves it under that id. Left to create it
    itself, MLflow's log_model also links the run's metrics of step 0 to the model: one call per metric, each a
    password check on a server behind basic auth, for figures the run already holds."""
    run_id = JobEnv.from_env().mlflow_run_id
    if rank() != 0 or not run_id:
        return
    import mlflow.pytorch
    from mlflow.entities import LoggedModelOutput

    model = unwrap(model).cpu()
    # Stating the requirement skips MLflow's inference of them, which re-imports the loop (seconds).
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    logged = {}  # what a retry (the server was down) need not do again

    def log():
        if "model_id" not in logged:
            experiment, params = run_facts(run_id)
            user = os.environ.get("MLFLOW_TRACKING_USERNAME")  # who ran it, like the run (else MLflow's default)
            logged["model_id"] = mlflow.initialize_logged_model(name="model", source_run_id=run_id, params=params,
                                                                experiment_id=experiment,
                                                                tags={"mlflow.user": user} if user else None).model_id
        if "saved" not in logged:
            save_model(model, input_example, logged["model_id"], requirements)
            logged["saved"] = True
        mlflow.MlflowClient().log_outputs(run_id, [LoggedModelOutput(logged["model_id"], step=0)])

    when_mlflow_answers(log, "model")
    print("[gpuflow] model logged to MLflow", file=sys.stderr, flush=True)


def save_model(model, input_example, model_id: str, requirements: list[str]) -> None:
    """As pt2 where an example lets torch.export trace the model (a graph: loading it runs no pickled code), else
    pickled, saying why: a model without an example, or with branches on its data, is logged all the same."""
    import mlflow.pytorch

    why = "log_model got no input_example to export it with"
    if input_example is not None:
        try:
            return mlflow.pytorch.log_model(model, name="model", input_example=input_example, model_id=model_id,
                                            pip_requirements=requirements, serialization_format="pt2")
        except Exception as exc:
            if unreachable(exc):
                raise
            why = f"torch.export could not trace it ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]})"
    print(f"[gpuflow] the model is logged pickled: {why}", file=sys.stderr, flush=True)
    mlflow.pytorch.log_model(model, name="model", input_example=input_example, model_id=model_id,
                             pip_requirements=requirements, serialization_format="pickle")


MLFLOW_WAIT_S = 300.0  # how long the end of a run waits for a tracking server that is down


def when_mlflow_answers(log, what: str, wait_s: float = MLFLOW_WAIT_S):
    """Calls `log`, again every few seconds while the tracking server does not answer: a server restarted as the
    training ends must not fail a run that trained. Gives up (raises) after `wait_s`; the checkpoints are kept."""
    from mlflow.exceptions import MlflowException

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return log()
        except (MlflowException, OSError) as exc:
            if time.monotonic() > deadline or not unreachable(exc):
                raise
            print(f"[gpuflow] MLflow does not answer: the {what} is logged once it is back ({exc.__class__.__name__})",
                  file=sys.stderr, flush=True)
            time.sleep(5)


def unreachable(exc: BaseException | None) -> bool:
    """A connection that failed (refused, reset, timed out) anywhere in the exception's chain, as opposed to MLflow
    refusing the request (an error response, an HTTP 4xx): MLflow's client wraps the first in an MlflowException."""
    import requests

    return caused_by(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))


def unwrap(model):
    """The plain module inside DistributedDataParallel."""
    return getattr(model, "module", model)
