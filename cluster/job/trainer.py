"""The library half of the job: a Ray Train TorchTrainer built from the spec, with its data, config and tracking.

Used by the job's entry point (cluster/job/__main__.py) and by each trial of a sweep (cluster/job/sweep.py). Ray, Ray
Train and torch are imported where a trainer is built: importing this module loads none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuflow.cluster.protocol import JobEnv
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.usercode import resolve

if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer


def loop_config(spec: ExperimentSpec) -> dict:
    """What the per-worker loop receives: the hyper-parameters, the data locations and the precision."""
    data = data_uris(spec)
    return {
        **spec.train.params,
        "epochs": spec.train.epochs,
        "batch_size": spec.train.batch_size,
        "lr": spec.train.lr,
        "precision": spec.precision,
        "profile": spec.profile.model_dump() if spec.profile else None,
        "train_path": data.get("train"),
        "validation_path": data.get("validation"),
    }


def data_uris(spec: ExperimentSpec) -> dict[str, str]:
    """The spec's Parquet locations by dataset name ('train', 'validation'): absolute, as the job anchors its spec."""
    if spec.data is None:
        return {}
    uris = {"train": spec.data.train, "validation": spec.data.validation}
    return {name: uri for name, uri in uris.items() if uri}


# Below this, a dataset is read here at once into Ray's object store: every epoch of a lazy dataset lists and
# reads the files anew, and even one read through Ray Data's executor takes seconds to start, which dwarfs reading a
# few megabytes with pyarrow (milliseconds).
SMALL_DATASET_BYTES = 64 * 1024**2


def datasets_of(spec: ExperimentSpec) -> dict:
    """Ray Datasets read from Parquet as streams: Ray Train splits them across the workers
    (ray.train.get_dataset_shard(name)), so no worker ever holds the whole table."""
    import pyarrow.parquet as pq
    import ray.data

    from gpuflow.cluster.util.ray_train_internals import dataset_of_table

    # Outside a terminal each bar update is a log line (~120 a digits run in a served run's log); epochs show progress.
    ray.data.DataContext.get_current().enable_progress_bars = False
    datasets = {}
    for name, uri in data_uris(spec).items():
        small = parquet_bytes(uri) <= SMALL_DATASET_BYTES
        datasets[name] = dataset_of_table(pq.read_table(uri)) if small else ray.data.read_parquet(uri)
    return datasets


def parquet_bytes(uri: str) -> int:
    """Size on storage of a Parquet file or folder (any pyarrow filesystem)."""
    import pyarrow.dataset as ds

    dataset = ds.dataset(uri, format="parquet")
    return sum(info.size or 0 for info in dataset.filesystem.get_file_info(dataset.files))


def build_trainer(spec: ExperimentSpec, run_name: str, run_id: str | None = None, callbacks: list = ()) -> TorchTrainer:
    """The TorchTrainer of one training run (the whole job, or one trial of a sweep) that reports to MLflow run
    `run_id` (default: the flow's, GPUFLOW_MLFLOW_RUN_ID); `callbacks` go beside gpuflow's own."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from gpuflow.cluster.job.elastic import ElasticRestarts, elastic_workers, failure_budget, worker_slot
    from gpuflow.cluster.job.ingest import SplitInMemory
    from gpuflow.cluster.job.stacks import with_stack_dumps
    from gpuflow.cluster.job.tracking import tracking_callbacks
    from gpuflow.cluster.util.ray_train_internals import starting_from, without_unused_actors

    compute = spec.compute
    job = JobEnv.from_env()
    run_id = run_id or job.mlflow_run_id
    num_workers = spec.workers_per_trial
    gpus_per_worker = 1 if compute.use_gpu else 0
    return without_unused_actors(TorchTrainer)(
        # a hung loop's stacks can be read (job/stacks.py); a continuation starts from the earlier run's checkpoint
        starting_from(with_stack_dumps(resolve(spec.train.loop), run_id), job.continue_from),
        train_loop_config=loop_config(spec),
        datasets=datasets_of(spec),
        dataset_config=SplitInMemory(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers if spec.sweep else elastic_workers(compute),
            use_gpu=compute.use_gpu,
            resources_per_worker={"CPU": compute.cpus_per_worker, "GPU": gpus_per_worker, **worker_slot(compute)},
            # one node's workers per node: multi-node placement is what the user asked for
            placement_strategy="SPREAD" if num_workers > compute.workers_per_node else "PACK",
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=spec.checkpoint_uri,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.storage.num_to_keep),
            # Left at their defaults, a missing node makes fit() retry forever (the worker group's start timeout and
            # preemptions have budgets of their own): the flow decides about a lost node, unless the run is elastic.
            failure_config=ray.train.FailureConfig(**failure_budget(compute)),
            # every report of any loop reaches the run, from Ray Train's controller
            callbacks=[
                *tracking_callbacks(
                    run_id,
                    job.tracking_uri,
                    f"{spec.checkpoint_uri.rstrip('/')}/{run_name}",
                    count_workers=bool(compute.min_workers),
                ),
                *([ElasticRestarts()] if compute.min_workers else []),
                *callbacks,
            ],
            # the loop's own MLflow logging (gpuflow.cluster.loop: the model, a profile) goes to the same run. The
            # job's runtime_env names the job's run already; a runtime_env of the workers' own would make Ray start
            # new worker processes (seconds of CPU each) instead of the idle ones it started for the job.
            worker_runtime_env={"env_vars": JobEnv(mlflow_run_id=run_id).to_env()}
            if run_id and run_id != job.mlflow_run_id
            else None,
        ),
    )


def run_training(spec: ExperimentSpec, run_name: str) -> dict:
    """One Ray Train run: the summary of its result."""
    result = build_trainer(spec, run_name).fit()
    return {
        "metrics": {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))},
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "storage": result.path,
    }
