"""The job that runs on the cluster: a Ray Train TorchTrainer built from the spec (or a sweep of them), result printed.

    python -m gpuflow.cluster.job --spec spec.json --address 127.0.0.1:6390 --run-name digits-mlp-1a2b3c4d

It imports no orchestrator. Every `ray.train.report` of the loop goes to the MLflow run named by
GPUFLOW_MLFLOW_RUN_ID on MLFLOW_TRACKING_URI (cluster/tracking.py); checkpoints go to the spec's
storage URI; data.train / data.validation reach the loop as Ray Data shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpuflow.cluster.data import ensure_data
from gpuflow.cluster.guard import JobGuard, block_owner_signal
from gpuflow.cluster.preload import import_in_background
from gpuflow.cluster.spec import ExperimentSpec, absolute_uri, on_sys_path, resolve

# Ray and Ray Train are imported where the job runs them, not here: the flow imports this module
# for RESULT_PREFIX, and loading Ray Train and torch there would cost seconds for nothing.
RESULT_PREFIX = "[gpuflow] result "

if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer


def tune_ray_train() -> None:
    """Ray Train settings for this driver, set before Ray is imported."""
    # Ray Train v2's controller polls its workers every 2 s by default, and each report waits for a
    # poll: on short epochs that is most of the wall time. The driver's value propagates to workers.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # Ray Train re-logs every print() of a worker through its logger: each line would reach us twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Starting the workers imports torch in each: on a busy small machine that can outlast the default 60 s, and
    # with controller_failure_limit=0 (the flow, not Ray, decides about lost nodes) that would fail the run.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")


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
    """The spec's Parquet locations by dataset name ('train', 'validation'), absolute."""
    if spec.data is None:
        return {}
    uris = {"train": spec.data.train, "validation": spec.data.validation}
    return {name: absolute_uri(uri) for name, uri in uris.items() if uri}


# Below this, a dataset is read here at once into Ray's object store: every epoch of a lazy dataset lists and
# reads the files anew, and even one read through Ray Data's executor starts in seconds (measured: 15 s for the
# first, 7 s for the next on 2 cores), which dwarfs reading a few megabytes with pyarrow (milliseconds).
SMALL_DATASET_BYTES = 64 * 1024**2


def datasets_of(spec: ExperimentSpec) -> dict:
    """Ray Datasets read from Parquet as streams: Ray Train splits them across the workers
    (ray.train.get_dataset_shard(name)), so no worker ever holds the whole table."""
    import pyarrow.parquet as pq
    import ray.data

    datasets = {}
    for name, uri in data_uris(spec).items():
        small = parquet_bytes(uri) <= SMALL_DATASET_BYTES
        datasets[name] = ray.data.from_arrow(pq.read_table(uri)) if small else ray.data.read_parquet(uri)
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

    from gpuflow.cluster.ingest import SplitInMemory
    from gpuflow.cluster.tracking import tracking_callbacks

    compute = spec.compute
    run_id = run_id or os.environ.get("GPUFLOW_MLFLOW_RUN_ID")
    num_workers = spec.workers_per_trial
    gpus_per_worker = 1 if compute.use_gpu else 0
    return TorchTrainer(
        resolve(spec.train.loop),
        train_loop_config=loop_config(spec),
        datasets=datasets_of(spec),
        dataset_config=SplitInMemory(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers,
            use_gpu=compute.use_gpu,
            resources_per_worker={"CPU": compute.cpus_per_worker, "GPU": gpus_per_worker},
            # one node's workers per node: multi-node placement is what the user asked for
            placement_strategy="SPREAD" if num_workers > compute.workers_per_node else "PACK",
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=spec.checkpoint_uri,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.storage.num_to_keep),
            # The flow, not Ray, decides about a lost node: left at their defaults, a missing node makes fit()
            # retry forever (the worker group's start timeout, 60 s, and preemptions have budgets of their own).
            failure_config=ray.train.FailureConfig(max_failures=compute.worker_restarts, controller_failure_limit=0,
                                                   max_preemption_failures=0),
            # every report of any loop reaches the run, from Ray Train's controller
            callbacks=[*tracking_callbacks(run_id, os.environ.get("MLFLOW_TRACKING_URI"),
                                           f"{spec.checkpoint_uri.rstrip('/')}/{run_name}"), *callbacks],
            # the loop's own MLflow logging (gpuflow.cluster.loop: the model, a profile) goes to the same run
            worker_runtime_env={"env_vars": {"GPUFLOW_MLFLOW_RUN_ID": run_id}} if run_id else None,
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


def system_metrics_monitor():
    """MLflow's own CPU/memory/disk/network (and GPU, with pynvml) sampling of this node, into the flow's run.

    It runs here, in the job on the cluster's head node, so it measures the cluster and not the flow's machine.
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL (seconds, default 10) sets how often it samples.
    """
    run_id = os.environ.get("GPUFLOW_MLFLOW_RUN_ID")
    if not run_id:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # resume_logging: after a relaunch the series goes on from its last step instead of starting over
    monitor = SystemMetricsMonitor(run_id, sampling_interval=10, samples_before_logging=1, resume_logging=True)
    monitor.start()
    return monitor


# What training needs in the job's process: torch through Ray Train, MLflow's system metrics (seconds of imports).
TRAINING_IMPORTS = ("ray.train.torch", "mlflow.system_metrics.system_metrics_monitor")


def preload(spec: ExperimentSpec) -> None:
    """What training needs (and Ray Tune for a sweep), imported while Ray connects."""
    import_in_background(*TRAINING_IMPORTS, *(["gpuflow.cluster.sweep"] if spec.sweep else []))


JOIN_TIMEOUT_S = 300


def alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])


def wait_for_nodes(count: int) -> int:
    """Waits until `count` Ray nodes have joined (a multi-node SkyPilot cluster's other nodes start alongside);
    returns how many are alive."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while (joined := alive_nodes()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of {count} nodes joined the Ray cluster within {JOIN_TIMEOUT_S}s")
        print(f"[gpuflow] {joined}/{count} Ray nodes joined", flush=True)
        time.sleep(2)
    return joined


def wait_for_file(path: str, what: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        time.sleep(0.05)


def wait_for_handoff(args: argparse.Namespace) -> None:
    """An early job (the local backend starts it before the run exists): imports what training needs meanwhile, then
    takes its spec, address, run name and environment from the hand-off file. Exits if the process that started it
    dies first: nobody would ever hand it a run."""
    import_in_background(*TRAINING_IMPORTS, "mlflow.store.tracking.sqlalchemy_store")
    starter = os.getppid()
    while not os.path.exists(args.handoff):
        if os.getppid() != starter:
            sys.exit(f"[gpuflow] the process that started this job ({starter}) is gone: no run to train")
        time.sleep(0.02)
    handoff = json.loads(Path(args.handoff).read_text())
    os.environ.update(handoff["env"])
    args.spec, args.address, args.run_name = handoff["spec"], handoff["address"], handoff["run_name"]


def main(argv=None) -> int:
    block_owner_signal()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="spec as JSON (ExperimentSpec.model_dump_json)")
    parser.add_argument("--address", help="GCS address of the Ray cluster to run on")
    parser.add_argument("--run-name", help="Ray Train run name: the checkpoint folder under storage")
    parser.add_argument("--handoff", help="instead of the three above: wait for this JSON file to give them, and the "
                                          "job's environment")
    parser.add_argument("--nodes", type=int, default=1, help="wait for this many Ray nodes before training")
    parser.add_argument("--after", default=None, help="connect to Ray once this file exists (the node starts Ray)")
    args = parser.parse_args(argv)
    if not args.handoff and not (args.spec and args.address and args.run_name):
        parser.error("give --spec, --address and --run-name, or --handoff")
    tune_ray_train()
    if args.handoff:
        wait_for_handoff(args)
    spec = ExperimentSpec.model_validate_json(Path(args.spec).read_text(), context={"on_cluster": True}).anchored()
    JobGuard(spec).start()  # limits and the flow's lease, enforced here too: the flow may die
    preload(spec)
    import ray

    workdir = str(Path(spec.workdir).absolute())
    env_vars = {
        "PYTHONPATH": os.pathsep.join(filter(None, [workdir, os.environ.get("PYTHONPATH")])),
        # Ray Train's own actors find "their" cluster by looking for one on the machine; with two Ray clusters on a
        # host (two runs, or a run beside a Slurm node) they fail with "multiple active Ray instances".
        "RAY_ADDRESS": args.address,
        **{key: os.environ[key] for key in ("MLFLOW_TRACKING_URI", "GPUFLOW_MLFLOW_RUN_ID") if key in os.environ},
        **spec.envs,
        **{name: os.environ[name] for name in spec.secrets if name in os.environ},
    }
    started = time.time()
    ensure_data(spec)  # a cloud node makes the data itself when data.generate is set
    if args.after:
        wait_for_file(args.after, "Ray to start on this node")
    ray.init(address=args.address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
    print(f"[gpuflow] connected to Ray at {args.address}: {wait_for_nodes(args.nodes)} node(s)", flush=True)
    monitor = system_metrics_monitor()  # also what the flow's idle-GPU check reads
    try:
        with on_sys_path(workdir):
            if spec.sweep:
                from gpuflow.cluster.sweep import run_sweep  # Ray Tune: loaded only for a sweep, on the cluster

                summary = run_sweep(spec, args.run_name)
            else:
                summary = run_training(spec, args.run_name)
    finally:
        if monitor:
            monitor.finish()
    summary["fit_seconds"] = round(time.time() - started, 2)
    print(RESULT_PREFIX + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
