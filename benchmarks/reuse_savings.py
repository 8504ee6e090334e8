"""What reuse saves: the cluster time a run trains and bills with reuse on, against the same run with --force, in the
three cases a team pays for twice: a scheduled rerun on unchanged code and data, more epochs of a finished run, and a
sweep resubmitted with new points.

    python benchmarks/reuse_savings.py [--epochs 4] [--points 4]

    unchanged   `gpuflow run` of the digits spec, again: the second reuses the first (no cluster)
    +epochs     the same with 2 × epochs: it continues the first from its last checkpoint
    sweep +2    a grid of `--points` learning rates, then the same grid with 2 more: only the 2 new points train

Each case's reusing run is measured against the same run with --force (trains everything). On this machine's CPU the
cluster's workers stand in for GPUs: worker-seconds = the run's training seconds × its workers; seconds to done = the
`gpuflow run` command's, its start-up included (a reused run: what a user waits for the answer); flow run seconds =
its flow run's own, what a scheduled run takes in a serve. Runs in a gpuflow home of its own, with no warm stack, on a
clone of the project's last commit (a work key digests the workdir's uncommitted changes: a row written into this
checkout's README would change it); records a row a case in benchmarks/README.md once every run is done.
"""

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.warm_runs import home_of_its_own  # noqa: E402

SPEC = REPO / "experiments" / "digits.yaml"
GPUFLOW = Path(sys.executable).parent / "gpuflow"
WORKERS = 2  # the digits spec's: 1 node × 2 workers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--points", type=int, default=4)
    args = parser.parse_args()
    home, env = home_of_its_own("gpuflow-reuse-", GPUFLOW_STACK="off", GPUFLOW_REUSE="finished")
    data = [
        "--set",
        f"data.train={home}/data/train.parquet",
        "--set",
        f"data.validation={home}/data/validation.parquet",
    ]
    project = home / "project"
    subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
    runs = Runs(home, env, [*data, "--set", f"workdir={project}"])

    epochs = [f"train.epochs={args.epochs}"]
    runs.run(epochs)  # the finished run the next ones find
    cases = {"unchanged": (epochs, epochs), "+epochs": ([f"train.epochs={2 * args.epochs}"],) * 2}
    lrs = [round(0.001 * 2**i, 6) for i in range(args.points + 2)]
    grid = f"sweep={{parameters: {{train.lr: {{grid: {lrs[: args.points]}}}}}, metric: val_accuracy, mode: max}}"
    more = f"sweep={{parameters: {{train.lr: {{grid: {lrs}}}}}, metric: val_accuracy, mode: max}}"
    runs.run(["train.epochs=2", grid])  # the sweep the next finds
    cases["sweep +2"] = (["train.epochs=2", more],) * 2
    rows = []
    for case, (reusing, forced) in cases.items():
        reused, baseline = runs.run(reusing), runs.run(forced, force=True)
        saved = 1 - reused["worker_s"] / baseline["worker_s"] if baseline["worker_s"] else 0.0
        print(
            f"{case:10s} reuse: {reused['worker_s']:6.1f} worker-s trained, {reused['cluster_s']:6.1f} cluster-s "
            f"billed; --force: {baseline['worker_s']:6.1f}, {baseline['cluster_s']:6.1f}; saved {saved:.0%}; trials "
            f"trained: {reused['trials']} (--force: {baseline['trials']}); done in {reused['wall_s']:.1f} s, its "
            f"flow run {reused['flow_run_s']:.1f} s (--force: {baseline['wall_s']:.1f} s, "
            f"{baseline['flow_run_s']:.1f} s)",
            flush=True,
        )
        rows.append(
            {
                "case": case,
                "worker-s with reuse": round(reused["worker_s"], 1),
                "worker-s with --force": round(baseline["worker_s"], 1),
                "cluster-s with reuse": round(reused["cluster_s"], 1),
                "cluster-s with --force": round(baseline["cluster_s"], 1),
                "saved %": round(100 * saved, 1),
                "trials trained with reuse": reused["trials"],
                "trials trained with --force": baseline["trials"],
                "s to done with reuse": round(reused["wall_s"], 1),
                "s to done with --force": round(baseline["wall_s"], 1),
                "flow run s with reuse": round(reused["flow_run_s"], 1),
                "flow run s with --force": round(baseline["flow_run_s"], 1),
            }
        )
    from benchmarks.record import record

    for row in rows:
        record("reuse_savings", row)
    return 0


class Runs:
    def __init__(self, home: Path, env: dict, data: list[str]):
        self.home, self.env, self.data, self.count = home, env, data, 0

    def run(self, settings: list[str], force: bool = False) -> dict[str, float]:
        """`gpuflow run` of the digits spec with `settings`; what its MLflow run says it trained and billed (nothing,
        where it reused a finished run and opened none)."""
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{self.home / 'mlflow.db'}")
        before = {run.info.run_id for run in self.parents(client)}
        self.count += 1
        log = self.home / f"run-{self.count}.txt"
        command = [str(GPUFLOW), "run", str(SPEC), *self.data, *(arg for item in settings for arg in ("--set", item))]
        started = time.monotonic()
        with open(log, "w") as out:
            code = subprocess.call(
                command + (["--force"] if force else []), env=self.env, cwd=REPO, stdout=out, stderr=out
            )
        wall_s = time.monotonic() - started  # the command's, start-up included: what its user waits
        if code != 0:
            raise SystemExit(f"run {self.count} failed (exit {code}): {log}")
        [new] = [run for run in self.parents(client) if run.info.run_id not in before] or [None]
        if new is None:  # reused: no MLflow run, no cluster
            return {"worker_s": 0.0, "cluster_s": 0.0, "trials": "—", "wall_s": wall_s, "flow_run_s": flow_run_s(log)}
        metrics = new.data.metrics
        trials = "—"  # a sweep's trials that trained, of all its trials (the others reused a finished trial's run)
        if "sweep/trials" in metrics:
            total = int(metrics["sweep/trials"])
            trials = f"{total - int(metrics.get('sweep/reused_trials', 0))} of {total}"
        return {
            "worker_s": metrics["gpuflow.train_seconds"] * WORKERS,
            "cluster_s": metrics["cluster_hours"] * 3600,
            "trials": trials,
            "wall_s": wall_s,
            "flow_run_s": flow_run_s(log),
        }

    def parents(self, client) -> list:
        experiment = client.get_experiment_by_name("digits-mlp") if (self.home / "mlflow.db").exists() else None
        if experiment is None:
            return []
        return [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]


def flow_run_s(log: Path) -> float:
    """The flow run's own seconds, from its first log line to its last ('Beginning flow run' to 'Finished in state'):
    what a scheduled run takes in a serve, whose process and API are up already."""
    stamps = [
        line.split(" | ", 1)[0]
        for line in log.read_text(errors="replace").splitlines()
        if re.match(r"\d\d:\d\d:\d\d\.\d+ \| \w+ +\| Flow run '", line)
    ]
    first, last = (
        sum(float(part) * 60**i for i, part in enumerate(reversed(stamp.split(":"))))
        for stamp in (stamps[0], stamps[-1])
    )
    return (last - first) % 86400


if __name__ == "__main__":
    sys.exit(main())
