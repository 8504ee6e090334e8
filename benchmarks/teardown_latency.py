"""Seconds a cluster sits idle after its job: last training step → teardown request, on the local backend (goal ≤ 5 s).

    python benchmarks/teardown_latency.py [--repeats 2] [--epochs 2]

Runs the shipped digits spec through the real flow (Ray, MLflow, Prefect's ephemeral API) in a temporary
GPUFLOW_HOME and times, from the flow's own log records: the job's last epoch line, its last log line, the
teardown request and the end of teardown. Also prints the run's `idle_seconds_before_teardown` from MLflow.
"""

import argparse
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

EPOCH = re.compile(r"\[gpuflow\] epoch \d+:")


class Times(logging.Handler):
    """Keeps when each flow/task log line was emitted."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[float, str]] = []

    def emit(self, record):
        self.records.append((record.created, record.getMessage()))

    def last(self, predicate) -> float:
        return max(at for at, message in self.records if predicate(message))


def one_run(epochs: int) -> dict:
    home = tempfile.mkdtemp(prefix="gpuflow-bench-")
    os.environ["GPUFLOW_HOME"] = home
    from mlflow import MlflowClient

    from gpuflow.cluster.spec import load_spec
    from gpuflow.flows.experiment import run_experiment

    spec = load_spec(
        REPO / "experiments" / "digits.yaml",
        [
            f"workdir={REPO}",
            f"train.epochs={epochs}",
            "tracking.register_model=false",
            f"data.train={home}/data/train.parquet",
            f"data.validation={home}/data/validation.parquet",
        ],
    )
    times = Times()
    logging.getLogger("prefect").addHandler(times)
    try:
        summary = run_experiment(spec)
    finally:
        logging.getLogger("prefect").removeHandler(times)
    last_step = times.last(lambda m: bool(EPOCH.search(m)))
    finished = max(i for i, (_, message) in enumerate(times.records) if message.startswith("training finished"))
    last_line = times.records[finished - 1][0]  # the job's last line, logged just before the task's own summary
    requested = times.last(lambda m: m.startswith("tearing down cluster"))
    down = times.last(lambda m: m.startswith("cluster ") and ("is down" in m or "already gone" in m))
    metrics = MlflowClient(tracking_uri=spec.tracking_uri).get_run(summary["run_id"]).data.metrics
    shutil.rmtree(home, ignore_errors=True)
    return {
        "last_step_to_teardown_s": requested - last_step,
        "last_line_to_teardown_s": requested - last_line,
        "teardown_s": down - requested,
        "idle_seconds_before_teardown": metrics["idle_seconds_before_teardown"],
        "cost_usd": metrics["cost_usd"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        runs.append(one_run(args.epochs))
        print(f"[bench] run {repeat + 1}: " + "  ".join(f"{k}={v:.2f}" for k, v in runs[-1].items()), flush=True)
    for key in runs[0]:
        values = [run[key] for run in runs]
        print(f"[bench] median {key}: {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f})")
    print(
        f"[bench] goal: last step → teardown request ≤ 5 s: "
        f"{'met' if statistics.median(r['last_step_to_teardown_s'] for r in runs) <= 5 else 'NOT met'}"
    )
    from benchmarks.record import record

    columns = {
        "last_step_to_teardown_s": "last step → teardown request s",
        "last_line_to_teardown_s": "last line → teardown request s",
        "teardown_s": "teardown s",
        "idle_seconds_before_teardown": "idle_seconds_before_teardown",
    }  # medians; cost_usd is 0 here
    record(
        "teardown_latency",
        {
            "repeats": args.repeats,
            "epochs": args.epochs,
            **{column: f"{statistics.median(run[key] for run in runs):.2f}" for key, column in columns.items()},
        },
    )


if __name__ == "__main__":
    main()
