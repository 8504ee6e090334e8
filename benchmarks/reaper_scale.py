"""What a reconciler pass costs with months of old runs in MLflow: 5,000 against 50, the same (target: ratio ≤ 1.2).

    python benchmarks/reaper_scale.py [--old 5000] [--baseline 50] [--repeats 5]

Fills two SQLite MLflow stores with old runs as a team's store holds them after months (FINISHED, FAILED and KILLED
runs of flow runs, a tenth of them closed `orphaned` by their job, a tenth with their end message said, all ended 30
days ago) and the same few live records in each (two RUNNING runs whose flows are still going, one run closed
`orphaned` yesterday). Then times, alternating the stores, the pass's MLflow step, `close_stale_mlflow_runs` (the flow
runs' states as Prefect would give them): it must read only records that can still change, so the old runs cost
nothing. Prints medians and the ratio, and records them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DAY_MS = 24 * 3600 * 1000


def fill_store(uri: str, old: int) -> None:
    """`old` runs that ended 30 days ago, and the live records every store here has."""
    from mlflow import MlflowClient

    from gpuflow.cluster.protocol import FILLED_TAG, FLOW_RUN_TAG, NOTIFIED_TAG, STOPPED_BY_TAG

    client = MlflowClient(uri)
    experiment = client.create_experiment("scale")
    now = int(time.time() * 1000)
    for i in range(old):
        tags = {FLOW_RUN_TAG: str(uuid.uuid4())}
        if i % 10 == 0:
            tags.update({STOPPED_BY_TAG: "orphaned", FILLED_TAG: "0"})
        if i % 10 == 1:
            tags[NOTIFIED_TAG] = "failed"
        run = client.create_run(experiment, start_time=now - 30 * DAY_MS - 3_600_000, tags=tags)
        status = "FAILED" if i % 10 in (0, 1) else ("KILLED" if i % 10 == 2 else "FINISHED")
        client.set_terminated(run.info.run_id, status, end_time=now - 30 * DAY_MS)
    for _ in range(2):  # flows still going: the pass leaves them
        client.create_run(experiment, tags={FLOW_RUN_TAG: "live-" + str(uuid.uuid4())})
    yesterday = client.create_run(
        experiment, tags={FLOW_RUN_TAG: str(uuid.uuid4()), STOPPED_BY_TAG: "orphaned", FILLED_TAG: "3"}
    )
    client.set_terminated(yesterday.info.run_id, "FAILED", end_time=now - DAY_MS)


def states(flow_run_ids: set[str]) -> dict[str, tuple[str, bool]]:
    """Prefect's answer for the flow runs the pass asks about: the live ones Running, the rest Completed."""
    return {run: ("RUNNING", False) if run.startswith("live-") else ("COMPLETED", True) for run in flow_run_ids}


def one_pass(uri: str) -> tuple[float, int]:
    from gpuflow.flows.reconcile.records import close_stale_mlflow_runs

    started = time.perf_counter()
    closed = close_stale_mlflow_runs(uri, states_of=states, dead=set())
    return time.perf_counter() - started, len(closed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=int, default=5000)
    parser.add_argument("--baseline", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from benchmarks.record import record

    with tempfile.TemporaryDirectory() as folder:
        stores = {}
        for name, old in (("baseline", args.baseline), ("old", args.old)):
            stores[name] = f"sqlite:///{folder}/{name}.db"
            started = time.monotonic()
            fill_store(stores[name], old)
            print(f"{name}: {old} old runs written in {time.monotonic() - started:.0f} s", flush=True)
        seconds = {name: [] for name in stores}
        for repeat in range(args.repeats + 1):  # the first round opens the stores (schema checks): not counted
            for name, uri in stores.items():
                took, closed = one_pass(uri)
                assert closed == 0, f"the pass closed {closed} run(s): it must leave these records as they are"
                if repeat:
                    seconds[name].append(took)
                    print(f"round {repeat} {name:8} {took * 1000:7.1f} ms", flush=True)
    base, many = (statistics.median(seconds[name]) for name in ("baseline", "old"))
    print(
        f"\nthe pass's MLflow step: {base * 1000:.1f} ms with {args.baseline} old runs, {many * 1000:.1f} ms with "
        f"{args.old}: ratio {many / base:.2f} (target ≤ 1.2)"
    )
    record(
        "reaper_scale",
        {
            "repeats": args.repeats,
            "baseline runs": args.baseline,
            "old runs": args.old,
            "baseline ms": round(base * 1000, 1),
            "old ms": round(many * 1000, 1),
            "ratio": round(many / base, 2),
        },
    )


if __name__ == "__main__":
    main()
