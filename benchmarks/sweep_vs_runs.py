"""An N-trial sweep on one cluster against N `gpuflow run`s of the same trials: the wall time of each, and the ratio.

    python benchmarks/sweep_vs_runs.py [--trials 4] [--epochs 3] [--concurrency 2]

Both sides train the digits MLP on the same cluster shape (1 node, 2 workers) with the same learning rates. The
sweep provisions once and runs `--concurrency` trials at a time (the cluster's workers shared between them);
each separate run provisions its own cluster, trains on all its workers, and tears it down. No early stopping, so
that both sides do the same epochs. Each side runs in a fresh GPUFLOW_HOME with Prefect's temporary API, as a user
without a Prefect server would.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def learning_rates(trials: int) -> list[float]:
    """`trials` learning rates spread on a log scale around the digits spec's 0.002."""
    return [round(0.0005 * 2**i, 6) for i in range(trials)]


def gpuflow_run(spec: str, overrides: list[str], home: Path) -> float:
    """Seconds of one `gpuflow run`, from start to exit; fails loudly if the run does not succeed."""
    env = {
        **os.environ,
        "GPUFLOW_HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    (home / "prefect").mkdir(parents=True, exist_ok=True)
    args = [arg for item in overrides for arg in ("--set", item)]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpuflow.flows.cli", "run", str(REPO / "experiments" / spec), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"gpuflow run {spec} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2, help="sweep trials at once (1 or 2 on 2 workers)")
    args = parser.parse_args()
    rates = learning_rates(args.trials)
    root = Path(tempfile.mkdtemp(prefix="gf-sweep-bench-"))
    common = [
        f"train.epochs={args.epochs}",
        f"data.train={root}/data/train.parquet",
        f"data.validation={root}/data/validation.parquet",
        "tracking.register_model=false",
    ]
    try:
        sweep_s = gpuflow_run(
            "digits-sweep.yaml",
            [
                *common,
                f"sweep.parameters={json.dumps({'train.lr': {'grid': rates}})}",
                "sweep.early_stopping=null",
                f"sweep.max_concurrent_trials={args.concurrency}",
                "sweep.max_trial_minutes=null",
            ],
            root / "sweep",
        )
        print(f"sweep of {args.trials} trials, {args.concurrency} at a time: {sweep_s:.1f}s", flush=True)
        runs_s = []
        for index, lr in enumerate(rates):
            runs_s.append(gpuflow_run("digits.yaml", [*common, f"train.lr={lr}"], root / f"run-{index}"))
            print(f"  separate run {index + 1} (lr={lr:g}): {runs_s[-1]:.1f}s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.trials} separate runs: {sum(runs_s):.1f}s in all")
    print(f"sweep ÷ separate runs: {sweep_s / sum(runs_s):.2f} (below 1: the sweep is faster)")
    sys.path.insert(0, str(REPO))
    from benchmarks.record import record

    record(
        "sweep_vs_runs",
        {
            "trials": args.trials,
            "epochs": args.epochs,
            "concurrency": args.concurrency,
            "sweep s": f"{sweep_s:.1f}",
            "separate runs s": f"{sum(runs_s):.1f}",
            "sweep ÷ runs": f"{sweep_s / sum(runs_s):.2f}",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
