"""Many runs against a small GPU quota on the team stack: how fast they go through, and that the quota holds.

    python benchmarks/quota_load.py [--runs 20] [--quota 3] [--baseline-runs 5]

Starts the team stack of the tests (PostgreSQL, Prefect and MLflow servers behind their passwords: root and Debian's
postgresql package), sets `gpuflow quota set local QUOTA`, serves run-experiment with room for every run at once
(`gpuflow serve --limit RUNS`), submits RUNS tiny runs (two epochs of a loop that reads no data, one worker each) and
samples the quota's holders every half second until all are over. The baseline, in the same run: such runs one at a time
(`--limit 1`, no quota; BASELINE_RUNS of them), the throughput of a single runner. Prints and records runs per minute
for both, the most holders seen at once, and how many runs Completed with a FINISHED MLflow run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_pass(stack, home: Path, runs: int, limit: int, quota: int | None) -> dict:
    from tests.support.servers import BIN, base_env
    from tests.support.team_stack import MLFLOW_ADMIN, wait_until_final
    from tests.test_team_stack import TINY_EPOCHS, as_user, mlflow_runs, serving, submit

    env = base_env(**stack.client_env(), GPUFLOW_HOME=str(home))
    if quota:
        subprocess.run([str(BIN / "gpuflow"), "quota", "set", "local", str(quota)], env=env, check=True)
    most, started = 0, time.monotonic()
    with as_user(MLFLOW_ADMIN, stack.mlflow_password), serving(stack, home, limit=limit):
        ids = submit(stack, runs, train=TINY_EPOCHS, data=None)
        with stack.prefect_client() as client:
            while True:
                states = [client.read_flow_run(run_id).state for run_id in ids]
                if quota:
                    most = max(most, client.read_global_concurrency_limit_by_name("gpuflow-quota-local").active_slots)
                if all(state and state.is_final() for state in states):
                    break
                time.sleep(0.5)
        wall_s = time.monotonic() - started
        final = wait_until_final(stack, ids)
        finished = [run.info.status for run in mlflow_runs(stack, ids).values()].count("FINISHED")
    if quota:
        subprocess.run([str(BIN / "gpuflow"), "quota", "remove", "local"], env=env, check=True)
    return {
        "wall_s": wall_s,
        "per_min": runs / wall_s * 60,
        "most": most,
        "completed": sum(run.state.is_completed() for run in final),
        "finished": finished,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--quota", type=int, default=3)
    parser.add_argument("--baseline-runs", type=int, default=5)
    args = parser.parse_args()

    from benchmarks.record import record
    from tests.support.team_stack import team_stack

    with team_stack() as stack:
        alone = one_pass(stack, stack.home / "one-at-a-time", args.baseline_runs, limit=1, quota=None)
        queued = one_pass(stack, stack.home / "quota", args.runs, limit=args.runs, quota=args.quota)
    print(
        f"{args.baseline_runs} runs one at a time: {alone['per_min']:.2f} runs/min; {args.runs} against a quota of "
        f"{args.quota}: "
        f"{queued['per_min']:.2f} runs/min, at most {queued['most']} holding, {queued['completed']} Completed, "
        f"{queued['finished']} MLflow runs FINISHED"
    )
    record(
        "quota_load",
        {
            "runs": args.runs,
            "quota": args.quota,
            "one at a time runs/min": round(alone["per_min"], 2),
            "quota runs/min": round(queued["per_min"], 2),
            "quota ÷ one at a time": round(queued["per_min"] / alone["per_min"], 2),
            "most holding": queued["most"],
            "Completed": f"{queued['completed']}/{args.runs}",
            "MLflow FINISHED": f"{queued['finished']}/{args.runs}",
        },
    )


if __name__ == "__main__":
    main()
