"""The job that runs on the cluster: a Ray Train TorchTrainer built from the spec (or a sweep of them), result printed.

    python -m gpuflow.cluster.job --spec spec.json --address 127.0.0.1:6390 --run-name digits-mlp-1a2b3c4d

It imports no orchestrator. Every `ray.train.report` of the loop goes to the MLflow run named by
GPUFLOW_MLFLOW_RUN_ID on MLFLOW_TRACKING_URI (cluster/job/tracking.py); checkpoints go to the spec's
storage URI; data.train / data.validation reach the loop as Ray Data shards.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

from gpuflow.cluster.data import ensure_data
from gpuflow.cluster.job.guard import JobGuard, block_owner_signal
from gpuflow.cluster.job.spot_watch import expect_notices, is_preemption, start_local_watches, stop_watches
from gpuflow.cluster.job.trainer import run_training
from gpuflow.cluster.protocol import PREEMPTED_EXIT_CODE, SPEC_LOADED, JobEnv, result_line
from gpuflow.cluster.spec import ExperimentSpec, job_spec
from gpuflow.cluster.usercode import on_sys_path
from gpuflow.cluster.util.preload import after_background_imports, finish_background_imports, import_in_background
from gpuflow.cluster.util.processes import alive
from gpuflow.cluster.util.waiting import wait_until

ENVIRONMENT_AT_START = dict(os.environ)  # as its starter gave it: what this process sets itself is not the starter's


def tune_ray_train() -> None:
    """Ray Train settings for this driver, set before Ray is imported."""
    # Ray Train v2's controller polls its workers every 2 s by default, and each report waits for a
    # poll: on short epochs that is most of the wall time. The driver's value propagates to workers.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    # Ray Train re-logs every print() of a worker through its logger: each line would reach us twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Starting the workers imports torch in each: on a busy small machine that can outlast the default 60 s, and
    # with controller_failure_limit=0 (the flow, not Ray, decides about lost nodes) that would fail the run.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")


def system_metrics_monitor():
    """MLflow's own CPU/memory/disk/network (and GPU, with pynvml) sampling of this node, into the flow's run.

    It runs here, in the job on the cluster's head node, so it measures the cluster and not the flow's machine.
    MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL (seconds, default 10) sets how often it samples.
    """
    run_id = JobEnv.from_env().mlflow_run_id
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
    import_in_background(*TRAINING_IMPORTS, *(["gpuflow.cluster.job.sweep"] if spec.sweep else []))


JOIN_TIMEOUT_S = 300
LINEAGE_TIMEOUT_S = 60


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
    if not wait_until(lambda: os.path.exists(path), timeout_s, interval_s=0.05):
        raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")


def wait_for_handoff(args: argparse.Namespace) -> Path:
    """An early job (the local backend starts it before the run exists): imports what training needs meanwhile, then
    takes its spec, address, run name and environment from the hand-off file. Exits if the process that started it dies
    first: nobody would ever hand it a run. Returns where to write its exit code (its run may not be its parent)."""
    from gpuflow.cluster.backends.local.early_job import exit_code_file, handoff_environment, owner_of

    import_in_background(*TRAINING_IMPORTS, "mlflow.store.tracking.sqlalchemy_store")
    starter, started_in = args.starter or os.getppid(), os.getcwd()
    for polls in itertools.count():
        if os.path.exists(args.handoff):
            break
        if polls % 25 == 0 and not alive(owner := owner_of(Path(args.handoff), starter)):
            sys.exit(f"[gpuflow] the process this job waits for a run from ({owner}) is gone: no run to train")
        time.sleep(0.02)
    handoff = json.loads(Path(args.handoff).read_text())
    Path(args.handoff).unlink()  # read once; it may hold secrets (the run's webhook)
    handoff_environment(ENVIRONMENT_AT_START, handoff["env"])  # the run's, whoever started this job
    tune_ray_train()  # this job's own settings stand, unless the run's environment sets them
    if handoff.get("cwd"):  # the stack started this job where it was started: the run's folder may be another
        os.chdir(handoff["cwd"])
        sys.path[:] = [handoff["cwd"] if entry == started_in else entry for entry in sys.path]
    args.spec, args.address, args.run_name = handoff["spec"], handoff["address"], handoff["run_name"]
    return exit_code_file(str(Path(args.handoff).parent), os.getpid())


def log_lineage_meanwhile(job: JobEnv, uris: dict[str, str | None]) -> threading.Thread:
    """The run's datasets and this environment's packages (cluster/lineage.py), logged while Ray connects."""

    @after_background_imports  # MLflow's, beside the preload's
    def log():
        from gpuflow.cluster.lineage import log_job_lineage

        log_job_lineage(job, uris)

    thread = threading.Thread(target=log, name="gpuflow-lineage", daemon=True)
    thread.start()
    return thread


def release_for(job: JobEnv):
    """How this job frees its cluster if it stops the run itself: a local cluster's session is stopped at once, a
    SkyPilot node's autostop is cut to nothing (autodown once the job ends)."""
    if job.local_cluster_session:
        from gpuflow.cluster.util.processes import stop_sessions

        return lambda: stop_sessions([job.local_cluster_session])
    if os.environ.get("SKYPILOT_NODE_RANK") is not None:
        from gpuflow.cluster.backends.skypilot.node import shorten_autostop_on_node

        return shorten_autostop_on_node
    return lambda: None


def main(argv=None) -> int:
    block_owner_signal()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", help="spec as JSON (ExperimentSpec.model_dump_json)")
    parser.add_argument("--address", help="GCS address of the Ray cluster to run on")
    parser.add_argument("--run-name", help="Ray Train run name: the checkpoint folder under storage")
    parser.add_argument(
        "--handoff", help="instead of the three above: wait for this JSON file to give them, and the job's environment"
    )
    parser.add_argument(
        "--starter",
        type=int,
        help="with --handoff: the pid of the process that started this job (its parent may be gone already)",
    )
    parser.add_argument("--nodes", type=int, default=1, help="wait for this many Ray nodes before training")
    parser.add_argument("--after", default=None, help="connect to Ray once this file exists (the node starts Ray)")
    args = parser.parse_args(argv)
    if not args.handoff and not (args.spec and args.address and args.run_name):
        parser.error("give --spec, --address and --run-name, or --handoff")
    tune_ray_train()
    if args.handoff:
        EXIT_CODE_FILE[:] = [wait_for_handoff(args)]
    spec = job_spec(Path(args.spec).read_text()).anchored()
    # The run's envs are this driver's environment too, as on a SkyPilot node (its task's envs): Ray Train reads its
    # settings (RAY_TRAIN_*) here and hands them on to its controller and workers, over this job's own defaults.
    os.environ.update(spec.envs)
    job = JobEnv.from_env()
    preemption_settings = expect_notices(spec)  # Ray Train's watch of drained nodes: on where a notice can come
    guard = JobGuard(spec, job, release_for(job)).start()  # limits and the flow's lease, enforced here too
    print(f"{SPEC_LOADED}: {spec.name}, {spec.train.epochs} epoch(s); limits and lease watched here too", flush=True)
    preload(spec)
    import ray

    workdir = str(Path(spec.workdir).absolute())
    env_vars = {
        "PYTHONPATH": os.pathsep.join(filter(None, [workdir, os.environ.get("PYTHONPATH")])),
        # Ray Train's own actors find "their" cluster by looking for one on the machine; with two Ray clusters on a
        # host (two runs, or a run beside a Slurm node) they fail with "multiple active Ray instances".
        "RAY_ADDRESS": args.address,
        **JobEnv(tracking_uri=job.tracking_uri, mlflow_run_id=job.mlflow_run_id).to_env(),
        **preemption_settings,
        **spec.envs,
        **{name: os.environ[name] for name in spec.secrets if name in os.environ},
    }
    started = time.time()
    uris = ensure_data(spec)  # a cloud node makes the data itself when data.generate is set
    lineage = log_lineage_meanwhile(job, uris)
    if args.after:
        wait_for_file(args.after, "Ray to start on this node")
    ray.init(address=args.address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
    print(
        f"[gpuflow] connected to Ray at {args.address}: {wait_for_nodes(args.nodes)} node(s) (job pid {os.getpid()})",
        flush=True,
    )
    finish_background_imports()  # Ray Train and Tune, loaded while Ray connected: from here on this thread imports
    from gpuflow.cluster.job.elastic import count_nodes

    monitor = system_metrics_monitor()  # also what the flow's idle-GPU check reads
    # the local backend's simulated nodes: each watches its own notices (a cloud node's watch starts with its Ray)
    watches = start_local_watches(args.address) if job.local_cluster_session else []
    node_count = count_nodes(spec.compute)  # an elastic run: the flow bills the nodes left
    try:
        with on_sys_path(workdir):
            if spec.sweep:
                from gpuflow.cluster.job.sweep import run_sweep  # Ray Tune: loaded only for a sweep

                summary = run_sweep(spec, args.run_name)
            else:
                summary = run_training(spec, args.run_name)
    except Exception as exc:
        if not is_preemption(exc):
            raise
        print(f"[gpuflow] training ended: a node was preempted ({exc})", flush=True)
        return PREEMPTED_EXIT_CODE
    finally:
        guard.settle()  # a guard that stopped the training ends the job itself, once the run is closed
        stop_watches(watches)
        if node_count:
            node_count.stop()
        if monitor:
            monitor.finish()
    summary["fit_seconds"] = round(time.time() - started, 2)
    lineage.join(LINEAGE_TIMEOUT_S)
    print(result_line(summary), flush=True)
    return 0


EXIT_CODE_FILE: list[Path] = []  # an early job's: written as it exits, whatever ends it but a kill


def main_leaving_exit_code(argv=None) -> int:
    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    finally:
        if EXIT_CODE_FILE:
            EXIT_CODE_FILE[0].write_text(str(code))
    return code


if __name__ == "__main__":
    sys.exit(main_leaving_exit_code())
