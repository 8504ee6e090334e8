"""The past runs a prediction is made from (cluster/cost/predict.py): which runs are "the same loop on the same
hardware" (the tags every run gets at open), and their figures, read from MLflow.

Reads one search and one metric history per run (at most predict.HISTORY_RUNS of them); creates no store.
"""

from __future__ import annotations

import os
import statistics

from gpuflow.cluster.cost.predict import HISTORY_RUNS, Identity, PastRun, Prediction, predict
from gpuflow.cluster.protocol import HARDWARE_TAG, LOOP_DIGEST_TAG, PHASE_METRIC_PREFIX
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.options import compute_options
from gpuflow.cluster.usercode import loop_digest
from gpuflow.cluster.util.local_store import store_exists

EPOCH_METRIC = "perf/epoch_s"  # each epoch's wall time, as the loop reported it (cluster/loop.py)


def hardware_key(spec: ExperimentSpec) -> str:
    """'skypilot 2x4 H100:8' or 'local 1x2, 1 CPU/worker of 16': what the run's time depends on besides its loop."""
    compute = spec.compute
    shape = f"{compute.num_nodes}x{compute.workers_per_node}"
    if compute.backend == "local":
        return f"local {shape}, {compute.cpus_per_worker:g} CPU/worker of {os.cpu_count()}"
    accelerators = "|".join(option.accelerators or "CPU" for option in compute_options(compute))
    return f"{compute.backend} {shape} {accelerators}"


def identity_of(spec: ExperimentSpec) -> Identity:
    return Identity(loop_digest(spec.workdir, spec.train.loop), hardware_key(spec))


def identity_tags(spec: ExperimentSpec) -> dict[str, str]:
    """The tags a run opens with, that later predictions find it by."""
    identity = identity_of(spec)
    return {LOOP_DIGEST_TAG: identity.loop_digest, HARDWARE_TAG: identity.hardware}


def prediction_for(spec: ExperimentSpec) -> Prediction:
    """The spec's run predicted from its history; bound only when there is none, or it cannot be read."""
    identity = identity_of(spec)
    if spec.sweep is not None:
        return predict([], spec, identity)
    from gpuflow.cluster.run.mlflow_run import at_most_one_try

    try:
        with at_most_one_try():  # a tracking server that is down: said at once, not after minutes of retries
            runs = past_runs(spec, identity)
    except Exception as exc:  # a prediction is advice: a store that cannot be read never stops a plan or a run
        return Prediction(
            spec.train.epochs, why_bound_only=f"history unreadable: {type(exc).__name__}: {str(exc)[:160]}"
        )
    return predict(runs, spec, identity)


def past_runs(spec: ExperimentSpec, identity: Identity, limit: int = HISTORY_RUNS) -> list[PastRun]:
    """The newest `limit` FINISHED runs of the spec's experiment with this identity, with their figures."""
    if not store_exists(spec.tracking_uri):
        return []
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    if experiment is None:
        return []
    runs = client.search_runs(
        [experiment.experiment_id],
        max_results=limit,
        order_by=["attributes.start_time DESC"],
        filter_string=(
            f"attributes.status = 'FINISHED' and tags.`{LOOP_DIGEST_TAG}` = '{quoted(identity.loop_digest)}'"
            f" and tags.`{HARDWARE_TAG}` = '{quoted(identity.hardware)}'"
        ),
    )
    found = [past_run(run, identity, epoch_times(client, run.info.run_id)) for run in runs]
    return [run for run in found if run is not None]


def past_run(run, identity: Identity, epoch_times_s: list[float]) -> PastRun | None:
    """One MLflow run's figures; None for a run that recorded no wall time."""
    metrics, params = run.data.metrics, run.data.params
    wall = metrics.get(phase("wall"))
    if wall is None:
        return None
    return PastRun(
        run.info.run_id,
        run.info.run_name or run.info.run_id,
        identity,
        epochs=epochs_of(params.get("train.epochs"), epoch_times_s),
        wall_s=wall,
        provision_s=metrics.get(phase("provision")),
        first_epoch_s=metrics.get(phase("first_epoch")) or None,  # 0: the flow saw no epoch
        epoch_s=statistics.median(epoch_times_s[1:]) if len(epoch_times_s) > 1 else None,
        teardown_s=metrics.get(phase("teardown")),
        started_at=run.info.start_time / 1000,
    )


def epoch_times(client, run_id: str) -> list[float]:
    """The run's epoch times in epoch order (rank 0's reports)."""
    history = sorted(client.get_metric_history(run_id, EPOCH_METRIC), key=lambda metric: metric.step)
    return [metric.value for metric in history]


def epochs_of(param: str | None, epoch_times_s: list[float]) -> int:
    try:
        return int(param)
    except (TypeError, ValueError):
        return max(1, len(epoch_times_s))


def phase(name: str) -> str:
    return f"{PHASE_METRIC_PREFIX}{name}_seconds"


def quoted(value: str) -> str:
    return value.replace("'", "\\'")
