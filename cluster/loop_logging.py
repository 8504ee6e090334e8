"""The loop's writes to the flow's MLflow run, from rank 0 (cluster/loop.py): the trained model, as pt2 where
torch.export traces it, else pickled; the profiler trace; each retried while the tracking server does not answer."""

import os
import shutil
import sys
import time

import torch

from gpuflow.cluster.protocol import JobEnv
from gpuflow.cluster.util.errors import caused_by
from gpuflow.cluster.util.preload import import_in_background

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
    """Does once, while training goes on, what `log_model` would otherwise make the end of the run wait for (seconds
    on a small machine): import MLflow's PyTorch flavour and torch.export, and open the tracking store (SQLite:
    SQLAlchemy and MLflow's table models imported, the schema checked), reading what the logged model records of the
    run. Not the pt2 save itself: torch.export patches torch process-wide while it traces, and a trace beside the
    training loop broke its next step."""
    import_in_background("mlflow.pytorch", "torch.export._trace", then=lambda: run_facts(run_id))


def log_trained_model(model, input_example, run_id: str) -> None:
    """Logs `model` (a plain module, on the CPU) to the run: loop.log_model on rank 0.

    The logged model is created here, in the run's experiment, from the run (its params, as MLflow's log_model records
    them), and linked to the run as its output; then MLflow's log_model saves it under that id. Left to create it
    itself, MLflow's log_model also links the run's metrics of step 0 to the model: one call per metric, each a
    password check on a server behind basic auth, for figures the run already holds."""
    import mlflow.pytorch
    from mlflow.entities import LoggedModelOutput

    # Stating the requirement skips MLflow's inference of them, which re-imports the loop (seconds).
    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    logged = {}  # what a retry (the server was down) need not do again

    def log():
        if "model_id" not in logged:
            experiment, params = run_facts(run_id)
            user = os.environ.get("MLFLOW_TRACKING_USERNAME")  # who ran it, like the run (else MLflow's default)
            logged["model_id"] = mlflow.initialize_logged_model(
                name="model",
                source_run_id=run_id,
                params=params,
                experiment_id=experiment,
                tags={"mlflow.user": user} if user else None,
            ).model_id
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
            return mlflow.pytorch.log_model(
                model,
                name="model",
                input_example=input_example,
                model_id=model_id,
                pip_requirements=requirements,
                serialization_format="pt2",
            )
        except Exception as exc:
            if unreachable(exc):
                raise
            why = f"torch.export could not trace it ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]})"
    print(f"[gpuflow] the model is logged pickled: {why}", file=sys.stderr, flush=True)
    mlflow.pytorch.log_model(
        model,
        name="model",
        input_example=input_example,
        model_id=model_id,
        pip_requirements=requirements,
        serialization_format="pickle",
    )


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
            print(
                f"[gpuflow] MLflow does not answer: the {what} is logged once it is back ({exc.__class__.__name__})",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(5)


def unreachable(exc: BaseException | None) -> bool:
    """A connection that failed (refused, reset, timed out) anywhere in the exception's chain, as opposed to MLflow
    refusing the request (an error response, an HTTP 4xx): MLflow's client wraps the first in an MlflowException."""
    import requests

    return caused_by(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError))


def log_profile(folder) -> None:
    """Rank 0's profiler trace and operator table into the flow's MLflow run, under profile/."""
    run_id = JobEnv.from_env().mlflow_run_id
    if not run_id:
        print(f"[gpuflow] profile written to {folder} (no MLflow run to log it to)", flush=True)
        return
    from mlflow import MlflowClient

    when_mlflow_answers(lambda: MlflowClient().log_artifacts(run_id, str(folder), artifact_path="profile"), "profile")
    shutil.rmtree(folder, ignore_errors=True)
    print(
        "[gpuflow] profile logged to MLflow: profile/trace.json (open in https://ui.perfetto.dev), "
        "profile/top_operators.txt",
        flush=True,
    )
