"""gpuflow's SkyPilot path against bare SkyPilot: the same digits job on the local Slurm cluster, alternating.

    python benchmarks/skypilot_overhead.py [--repeats 3] [--epochs 3] [--logs DIR]

Starts what it needs as tests/test_slurm.py has it (the one-node Slurm cluster of tests/infra/slurm, an MLflow
server, a temporary Prefect API) and stops all of it at the end, also on Ctrl-C or a failure. Then, per repeat:
  bare     this file as a plain SkyPilot client (--bare-client): one sky.Task with the tests' setup (uv installs
           torch +cpu and this repo on the node) and a run a user would write by hand (--bare-node: ray.init and the
           same Ray Train digits loop, data, epochs and worker); sky.launch, sky.tail_logs, sky.down.
  gpuflow  `gpuflow run experiments/digits.yaml --set compute.backend=skypilot ...` with the overrides of the tests.
Prints, per run, each phase's time since the command started (launch requested, provisioned, setup done, first
and last epoch line, cluster down, exit), then the medians of both, the overhead in seconds and gpuflow / bare.
Every run's output, timestamped, is kept in --logs (with gpuflow's full log file and the SkyPilot API server's).
"""

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
SPEC = "experiments/digits.yaml"
# the node installs what it runs, as in tests/test_slurm.py: uv, its per-user cache, the local CPU torch wheel
NODE_SETUP = 'export PATH=$HOME/.local/bin:$PATH; uv pip install -q --python "$(which python)" "torch==2.13.0+cpu" -e .'
NODE_ENVS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # one node on this machine: Ray stays on 127.0.0.1
RUN_TIMEOUT_S = 900
EPOCH = re.compile(r"\[(?:gpuflow|bench)\] epoch \d+:")
CLUSTER_LINE = re.compile(r"provisioning skypilot cluster (gpuflow-[0-9a-f]{32})")
# the line that marks each phase's end, per kind of run (gpuflow's are those of tests/test_slurm.py's Run.phases)
MARKS = {
    "bare": {
        "launch": "[bench] launching",
        "provisioned": "[bench] provisioned",
        "setup_done": "[bench] setup finished",
        "down": "[bench] cluster is down",
    },
    "gpuflow": {
        "launch": "provisioning skypilot cluster",
        "provisioned": "[gpuflow] provisioned",
        "setup_done": "[gpuflow] setup finished",
        "down": " is down (",
    },
}
PHASES = ("launch", "provisioned", "setup_done", "first_step", "last_step", "down", "wall")
SPANS = {
    "provision": ("launch", "provisioned"),
    "setup": ("provisioned", "setup_done"),
    "setup→first step": ("setup_done", "first_step"),
    "training": ("first_step", "last_step"),
    "last step→down": ("last_step", "down"),
}
# Ray Train settings of gpuflow's job (cluster/job/__main__.py tune_ray_train): the bare run trains the same way
RAY_TRAIN_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
}


def spec_overrides(shared: Path, epochs: int) -> list[str]:
    """What both runs train: the tests' digits job (1 worker, `epochs` epochs, data on the shared disk)."""
    return [
        "compute.workers_per_node=1",
        f"train.epochs={epochs}",
        f"data.train={shared}/data/train.parquet",
        f"data.validation={shared}/data/validation.parquet",
    ]


# -- A: bare SkyPilot ------------------------------------------------------------------------------------------
def bare_client(cluster: str, shared: Path, epochs: int, infra: str) -> int:
    """A plain SkyPilot 0.14 client: launch the task (setup + run), follow its log, down the cluster."""
    import sky

    run = (
        f"echo '[bench] setup finished'; python benchmarks/skypilot_overhead.py --bare-node "
        f"--shared {shared} --epochs {epochs}"
    )
    task = sky.Task(name="digits-bare", workdir=str(REPO), setup=NODE_SETUP, run=run, envs=NODE_ENVS)
    task.set_resources(sky.Resources(infra=infra, cpus="1+"))  # gpuflow asks for workers × cpus_per_worker = 1+
    print(f"[bench] launching {cluster}", flush=True)
    try:
        job_id, _ = sky.stream_and_get(sky.launch(task, cluster_name=cluster, idle_minutes_to_autostop=10, down=True))
        print(f"[bench] provisioned {cluster}; job {job_id}", flush=True)
        code = sky.tail_logs(cluster, job_id, follow=True)
        print(f"[bench] job {job_id} exit code {code}", flush=True)
    finally:
        print(f"[bench] tearing down {cluster}", flush=True)
        sky.stream_and_get(sky.down(cluster))
        print(f"[bench] cluster is down: {cluster}", flush=True)
    return code


def bare_node(shared: Path, epochs: int) -> int:
    """On the node: what a user writes by hand, ray.init and a TorchTrainer of the same loop on the same data."""
    for key, value in RAY_TRAIN_ENV.items():
        os.environ.setdefault(key, value)
    sys.path.insert(0, os.getcwd())
    import pyarrow.parquet as pq
    import ray
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from gpuflow.cluster.job.ingest import SplitInMemory
    from gpuflow.cluster.job.trainer import loop_config
    from gpuflow.cluster.spec import load_spec
    from gpuflow.cluster.usercode import resolve

    class PrintEpochs(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            first = metrics[0]  # rank 0's
            print(f"[bench] epoch {int(first['epoch'])}: val_accuracy={first['val_accuracy']:.4g}", flush=True)

    spec = load_spec(REPO / SPEC, spec_overrides(shared, epochs))
    # a fresh temp dir: ray.init must start its own Ray, not find another one on this machine
    ray.init(
        address="local",
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="sko-bare-", dir="/tmp"),
        runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
    )
    print("[bench] Ray started", flush=True)
    config = loop_config(spec)
    trainer = TorchTrainer(
        resolve(spec.train.loop),
        train_loop_config=config,
        datasets={name: ray.data.from_arrow(pq.read_table(config[f"{name}_path"])) for name in ("train", "validation")},
        dataset_config=SplitInMemory(),  # the ingest gpuflow's job uses: the benchmark compares orchestration alone
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "GPU": 0}),
        run_config=ray.train.RunConfig(
            name=f"bare-{uuid.uuid4().hex[:8]}", storage_path=f"{shared}/checkpoints-bare", callbacks=[PrintEpochs()]
        ),
    )
    result = trainer.fit()
    print(f"[bench] result val_accuracy {result.metrics['val_accuracy']:.4f}", flush=True)
    ray.shutdown()
    return 0


# -- the benchmark ---------------------------------------------------------------------------------------------
def measure(kind: str, command: list[str], env: dict, log: Path, cluster: str | None, infra) -> dict:
    """Runs one command, each output line timestamped (seconds since start) into `log` as it comes; downs the
    run's cluster if it is still there afterwards (a failed or interrupted run)."""
    lines: list[tuple[float, str]] = []
    with open(log, "w") as out:
        out.write(f"# {kind}: {' '.join(command)}\n# started at {time.time():.3f}\n")
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

        def read():
            for line in process.stdout:
                lines.append((time.monotonic() - started, line.rstrip("\n")))
                out.write(f"{lines[-1][0]:8.2f} {lines[-1][1]}\n")
                out.flush()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=RUN_TIMEOUT_S)
            wall = time.monotonic() - started
            reader.join(timeout=30)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            output = "\n".join(line for _, line in lines)
            named = CLUSTER_LINE.search(output)
            cluster = cluster or (named.group(1) if named else None)
            if cluster:
                down_if_listed(infra, cluster)
    if code != 0:
        sys.exit(output[-4000:] + f"\n{kind} run failed (exit {code}); its log: {log}")
    marks = {name: next((at for at, line in lines if text in line), float("nan")) for name, text in MARKS[kind].items()}
    steps = [at for at, line in lines if EPOCH.search(line)]
    marks.update(
        first_step=steps[0] if steps else float("nan"), last_step=steps[-1] if steps else float("nan"), wall=wall
    )
    return {name: marks[name] for name in PHASES}


def down_if_listed(infra, cluster: str) -> None:
    """The cluster gone for good: SkyPilot no longer lists it (a failed run's is downed here)."""
    from tests.infra.slurm import harness

    if cluster in harness.sky_clusters(infra):
        print(f"cluster {cluster} still listed: downing it", flush=True)
        subprocess.run(
            [str(Path(sys.executable).parent / "sky"), "down", "-y", cluster],
            env=infra.subprocess_env(),
            capture_output=True,
            timeout=300,
        )
        if cluster in harness.sky_clusters(infra):
            sys.exit(f"cluster {cluster} is still listed after `sky down`")


def down_new_clusters(infra, before: set[str]) -> None:
    from tests.infra.slurm import harness

    for cluster in set(harness.sky_clusters(infra)) - before:
        down_if_listed(infra, cluster)


def spans(marks: dict) -> dict:
    return {name: marks[b] - marks[a] for name, (a, b) in SPANS.items()}


@contextlib.contextmanager
def slurm_cluster():
    """The tests' local Slurm cluster (tests/infra/slurm), stopped on the way out whatever happens."""
    from tests.infra.slurm import harness

    ok, why = harness.available()
    if not ok:
        sys.exit(f"local Slurm harness unavailable: {why}")
    try:
        yield harness.start()
    finally:
        harness.stop()


def keep_side_logs(infra, logs: Path) -> None:
    """The SkyPilot API server's log and the node's Ray logs (skyci's /tmp/gf-ray-*, sko-bare-*), before teardown
    removes them."""
    server_log = infra.base / "clienthome" / ".sky" / "api_server" / "server.log"
    if server_log.exists():
        shutil.copy(server_log, logs / "sky-api-server.log")
    for folder in [*Path("/tmp").glob("gf-ray-*"), *Path("/tmp").glob("sko-bare-*")]:
        try:
            if folder.owner() != infra.ssh_user:
                continue
            for session in folder.glob("session_2*/logs"):
                shutil.copytree(
                    session,
                    logs / "node-ray" / folder.name,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.sock", "events"),
                )
        except (OSError, KeyError):
            continue


def benchmark(args) -> None:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from tests.infra.slurm import harness
    from tests.support.servers import mlflow_server

    logs = Path(args.logs or tempfile.mkdtemp(prefix="skypilot-overhead-"))
    logs.mkdir(parents=True, exist_ok=True)
    results = {"bare": [], "gpuflow": []}
    with contextlib.ExitStack() as stack:
        infra = stack.enter_context(slurm_cluster())
        shared = infra.base / "shared" / f"bench-{uuid.uuid4().hex[:8]}"  # the tests' stand-in for a bucket
        shared.mkdir(parents=True)
        for path in (shared.parent, shared):
            path.chmod(0o1777)
        stack.callback(shutil.rmtree, shared, True)
        stack.callback(keep_side_logs, infra, logs)
        stack.callback(down_new_clusters, infra, set(harness.sky_clusters(infra)))  # one a killed run left
        mlflow_home = Path(tempfile.mkdtemp(prefix="skypilot-overhead-mlflow-"))
        stack.callback(shutil.rmtree, mlflow_home, True)
        mlflow_url = stack.enter_context(mlflow_server(mlflow_home))
        stack.enter_context(prefect_test_harness(server_startup_timeout=120))
        env = infra.subprocess_env(
            {  # as tests/test_slurm.py's gpuflow_on_slurm has it
                "PREFECT_API_URL": PREFECT_API_URL.value(),
                "GPUFLOW_SHARED_PATH": str(shared),
                "GPUFLOW_HOME": str(shared / "home"),
                "PYTHONUNBUFFERED": "1",
                "NO_PROXY": "127.0.0.1,localhost",
            }
        )
        # the data, once, before any run: neither run pays for making it
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from experiments.digits import write_parquet; write_parquet(*sys.argv[1:])",
                f"{shared}/data/train.parquet",
                f"{shared}/data/validation.parquet",
            ],
            cwd=REPO,
            env=env,
            check=True,
        )
        gpuflow = [
            str(Path(sys.executable).parent / "gpuflow"),
            "run",
            SPEC,
            "--set",
            "compute.backend=skypilot",
            "--set",
            f"compute.infra={infra.infra}",
            "--set",
            f"tracking.uri={mlflow_url}",
            "--set",
            f"storage.checkpoints={shared}/checkpoints",
            "--set",
            'envs={RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: "0"}',
            "--set",
            f"setup={NODE_SETUP}",
        ]
        for item in spec_overrides(shared, args.epochs):
            gpuflow += ["--set", item]

        def one(kind: str, label: str) -> dict:
            cluster = f"bench-bare-{uuid.uuid4().hex[:8]}" if kind == "bare" else None
            command = (
                gpuflow
                if kind == "gpuflow"
                else [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--bare-client",
                    cluster,
                    "--shared",
                    str(shared),
                    "--epochs",
                    str(args.epochs),
                    "--infra",
                    infra.infra,
                ]
            )
            known = set((shared / "home" / "logs").glob("*.log"))
            marks = measure(kind, command, env, logs / f"{label}-{kind}.log", cluster, infra)
            for new in set((shared / "home" / "logs").glob("*.log")) - known:  # gpuflow's own log, every line
                shutil.copy(new, logs / f"{label}-{kind}.gpuflow-log")
            print(f"{label} {kind:8s} " + "  ".join(f"{k} {v:6.1f}s" for k, v in marks.items()), flush=True)
            return marks

        # warm-up (not counted): the SkyPilot API server, the node's runtime and uv cache, the MLflow experiment
        if args.warmup:
            one("gpuflow", "warmup")
        for i in range(args.repeats):
            for kind in ("bare", "gpuflow"):
                results[kind].append(one(kind, f"run{i + 1}"))
    report(results, args.repeats)
    print(f"\nlogs: {logs}")


def report(results: dict, repeats: int) -> None:
    medians = {kind: {key: statistics.median(r[key] for r in runs) for key in PHASES} for kind, runs in results.items()}
    spans_of = {
        kind: {key: statistics.median(spans(r)[key] for r in runs) for key in SPANS} for kind, runs in results.items()
    }
    print(f"\nmedians over {repeats} runs each (seconds since the command started)")
    print(f"{'':20s}{'bare':>9s}{'gpuflow':>9s}{'overhead':>10s}{'ratio':>8s}")
    for table in (medians, spans_of):
        for key in table["bare"]:
            bare, ours = table["bare"][key], table["gpuflow"][key]
            print(f"{key:20s}{bare:9.1f}{ours:9.1f}{ours - bare:+10.1f}{ours / bare if bare else float('nan'):8.2f}")
        if table is medians:
            print("\nmedian spans (seconds)")
    wall = medians["gpuflow"]["wall"] - medians["bare"]["wall"]
    print(f"\ngpuflow overhead: {wall:.1f} s of wall time")
    print(f"ratio gpuflow / bare: {medians['gpuflow']['wall'] / medians['bare']['wall']:.3f} (target ≤ 1.10)")
    from benchmarks.record import record

    record(
        "skypilot_overhead",
        {
            "repeats": repeats,
            "bare s": f"{medians['bare']['wall']:.1f}",
            "gpuflow s": f"{medians['gpuflow']['wall']:.1f}",
            "overhead s": f"{wall:.1f}",
            "ratio": f"{medians['gpuflow']['wall'] / medians['bare']['wall']:.3f}",
            **{f"{key} +s": f"{spans_of['gpuflow'][key] - spans_of['bare'][key]:+.1f}" for key in SPANS},
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--logs", help="folder for every run's timestamped output (default: a new temp folder)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the uncounted first gpuflow run")
    parser.add_argument("--bare-client", metavar="CLUSTER", help=argparse.SUPPRESS)  # run A's client (a subprocess)
    parser.add_argument("--bare-node", action="store_true", help=argparse.SUPPRESS)  # run A's job, on the node
    parser.add_argument("--shared", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--infra", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_node:
        sys.exit(bare_node(args.shared, args.epochs))
    if args.bare_client:
        sys.exit(bare_client(args.bare_client, args.shared, args.epochs, args.infra))
    benchmark(args)


if __name__ == "__main__":
    main()
