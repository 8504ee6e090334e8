"""Warm runs in a row: `gpuflow run` of the shipped digits spec again and again, each started the moment the last
ended, on the warm stack the first one leaves (its API, its spare cluster and the early job beside it, handed each
run while its imports may still be loading). Every run must complete.

    python benchmarks/warm_runs.py [--runs 20] [--epochs 2]

Runs in a gpuflow home and Prefect home of its own, and stops its stack at the end. Prints each run's exit code and
wall time, then the count that completed, and records a row in benchmarks/README.md.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SPEC = REPO / "experiments" / "digits.yaml"
GPUFLOW = Path(sys.executable).parent / "gpuflow"


def home_of_its_own(prefix: str, **settings: str) -> tuple[Path, dict[str, str]]:
    """A new gpuflow home, and the environment of a `gpuflow` command that uses it (Prefect's home inside, no API or
    gpuflow setting of this shell) with `settings` on top."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"gpuflow home {home}: each run's console output in run-N.txt there", flush=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "GPUFLOW_"))}
    env.update(GPUFLOW_HOME=str(home), PREFECT_HOME=str(home / "prefect"), **settings)
    return home, env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    home, env = home_of_its_own("gpuflow-warm-runs-", GPUFLOW_STACK="auto")
    overrides = ["--force", "--set", f"train.epochs={args.epochs}"]  # each run trains: none reuses the last
    overrides += ["--set", f"data.train={home}/data/train.parquet"]
    overrides += ["--set", f"data.validation={home}/data/validation.parquet"]
    walls, failed = [], []
    try:
        for index in range(args.runs):
            log = home / f"run-{index}.txt"
            started = time.monotonic()
            with open(log, "w") as out:
                code = subprocess.call(
                    [str(GPUFLOW), "run", str(SPEC), *overrides], env=env, cwd=REPO, stdout=out, stderr=out
                )
            walls.append(time.monotonic() - started)
            completed = code == 0 and "finished in" in log.read_text()
            said = "" if completed else f"  FAILED: {log}"
            print(f"run {index + 1:2d}: exit {code}, {walls[-1]:5.1f} s{said}", flush=True)
            if not completed:
                failed.append(index + 1)
    finally:
        subprocess.run([str(GPUFLOW), "down"], env=env, cwd=REPO, capture_output=True)
    completed = args.runs - len(failed)
    print(f"{completed} of {args.runs} completed; wall median {statistics.median(walls):.1f} s, max {max(walls):.1f} s")
    from benchmarks.record import record

    record(
        "warm_runs",
        {
            "runs": args.runs,
            "epochs": args.epochs,
            "completed": completed,
            "failed (run numbers)": ", ".join(map(str, failed)) or "none",
            "first (cold) s": round(walls[0], 1),
            "warm median s": round(statistics.median(walls[1:] or walls), 1),
            "warm max s": round(max(walls[1:] or walls), 1),
        },
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
