"""How close `gpuflow plan`'s prediction comes: the digits spec run again and again, each predicted from the earlier.

    python benchmarks/predict_accuracy.py [--runs 4] [--epochs 3]

Runs the shipped digits spec (local backend) `--runs` times through `gpuflow run`, in a fresh GPUFLOW_HOME and
MLflow store (its data written first, so the first run does not pay for it). Each run is predicted at its open from
the runs before it (the validate task's prediction, logged as predicted_wall_seconds); the script reads the store
and prints, run by run, the prediction (median and range, from how many runs), the actual gpuflow.wall_seconds and
the error. The row recorded is the last run's: predicted from all the runs before it (target: within 25 % after
three).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "experiments" / "digits.yaml"
TARGET_PCT = 25.0


def run_once(overrides: list[str], env: dict) -> None:
    command = [
        sys.executable,
        "-m",
        "gpuflow.flows.cli",
        "run",
        str(SPEC),
        *[a for o in overrides for a in ("--set", o)],
    ]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\nbenchmark run failed: {' '.join(command)}")


def rows(spec) -> list[dict]:
    """Each run of the store, oldest first: its actual wall time, the prediction logged at its open, and the
    prediction recomputed from the runs before it (for its range and the runs it names)."""
    from mlflow import MlflowClient

    from gpuflow.cluster.cost.history import identity_of, past_runs
    from gpuflow.cluster.cost.predict import predict
    from gpuflow.cluster.protocol import PREDICTED_WALL_METRIC

    identity = identity_of(spec)
    runs = sorted(past_runs(spec, identity, limit=1000), key=lambda run: run.started_at)
    client = MlflowClient(spec.tracking_uri)
    table = []
    for i, run in enumerate(runs):
        prediction = predict(runs[:i], spec, identity)
        logged = client.get_run(run.run_id).data.metrics.get(PREDICTED_WALL_METRIC)
        table.append(
            {
                "run": i + 1,
                "history": len(prediction.based_on),
                "actual": run.wall_s,
                "logged": logged,
                "prediction": prediction,
                "phases": phases_of(run),
            }
        )
    return table


def phases_of(run) -> str:
    """Where the run's wall time went: what a miss is made of."""
    parts = {
        "provision": run.provision_s,
        "1st epoch": run.first_epoch_s,
        "epoch": run.epoch_s,
        "teardown": run.teardown_s,
    }
    return "  ".join(f"{name} {value:.1f}" for name, value in parts.items() if value is not None)


def error_pct(predicted: float, actual: float) -> float:
    return (predicted - actual) / actual * 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs in all; each is predicted from those before it")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpuflow-bench-predict-"))
    env = {
        **os.environ,
        "GPUFLOW_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(home / "prefect"),
        "GPUFLOW_STACK": "off",
    }
    env.pop("PREFECT_API_URL", None)
    os.environ.update({"GPUFLOW_HOME": str(home)})
    overrides = [
        f"workdir={REPO}",
        f"train.epochs={args.epochs}",
        f"data.train={home}/data/train.parquet",
        f"data.validation={home}/data/validation.parquet",
    ]
    sys.path.insert(0, str(REPO))
    from gpuflow.cluster.data import ensure_data
    from gpuflow.cluster.spec import load_spec

    spec = load_spec(SPEC, overrides)
    ensure_data(spec)
    for i in range(args.runs):
        run_once(overrides, env)
        print(f"run {i + 1} of {args.runs} done", flush=True)
    table = rows(spec)
    print(
        f"\n{'run':>4} {'history':>8} {'predicted s (range)':>24} {'logged at open':>15} {'actual s':>9} {'error':>8}"
    )
    for row in table:
        prediction = row["prediction"]
        if prediction.known:
            wall = prediction.wall
            shown = f"{wall.median:.1f} ({wall.low:.1f}–{wall.high:.1f})"
            error = f"{error_pct(wall.median, row['actual']):+.1f} %"
        else:
            shown, error = "bound only", "—"
        logged = "—" if row["logged"] is None else f"{row['logged']:.1f}"
        print(
            f"{row['run']:>4} {row['history']:>8} {shown:>24} {logged:>15} {row['actual']:>9.1f} {error:>8}   "
            f"{row['phases']}"
        )
    last = table[-1]
    figures = {"runs": len(table), "epochs": args.epochs, "history runs": last["history"]}
    if last["prediction"].known:
        predicted = last["prediction"].wall.median
        errors = [abs(error_pct(r["prediction"].wall.median, r["actual"])) for r in table if r["history"] >= 3]
        figures.update(
            {
                "predicted wall s": f"{predicted:.1f}",
                "range s": f"{last['prediction'].wall.low:.1f}–{last['prediction'].wall.high:.1f}",
                "actual wall s": f"{last['actual']:.1f}",
                "error %": f"{error_pct(predicted, last['actual']):+.1f}",
                "mean abs error % (≥3 history)": f"{statistics.mean(errors):.1f}" if errors else "—",
                "logged at open s": "—" if last["logged"] is None else f"{last['logged']:.1f}",
            }
        )
        verdict = "within" if abs(error_pct(predicted, last["actual"])) <= TARGET_PCT else "OUTSIDE"
        print(
            f"\nlast run: predicted {predicted:.1f} s from {last['history']} runs, actual {last['actual']:.1f} s: "
            f"{verdict} the {TARGET_PCT:g} % target"
        )
    shutil.rmtree(home, ignore_errors=True)
    from benchmarks.record import record

    record("predict_accuracy", figures)


if __name__ == "__main__":
    main()
