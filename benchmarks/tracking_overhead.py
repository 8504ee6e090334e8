"""What tracking every report costs the training: the callback's time per report against the step time between reports.

    python benchmarks/tracking_overhead.py [--reports 200] [--metrics 10] [--tracking-uri http://127.0.0.1:5000]

Baseline, measured here in the same run: one digits-MLP epoch in plain torch (the time between two
reports of experiments/digits.py). Then, for the same number of reports, the time Ray Train's
controller spends in `after_report` (cluster/job/tracking.py: it queues, a thread logs in batches) and,
for comparison, a synchronous `log_batch` per report (what a loop that logs itself pays). Prints both
as a percentage of the step time, and checks that every value reached MLflow.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def digits_epoch_seconds(repeats: int = 5) -> float:
    """Median seconds of one epoch of the digits MLP (1,437 rows, batch 32) in plain torch on this CPU."""
    import torch
    from sklearn.datasets import load_digits

    from experiments.digits import make_model

    torch.set_num_threads(1)  # one core per worker, as on the local cluster; steadier on a shared machine
    digits = load_digits()
    pixels = torch.tensor(digits.data[:1437] / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target[:1437])
    model = make_model(128)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.002)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for start in range(0, len(labels), 32):
            loss = torch.nn.functional.cross_entropy(model(pixels[start : start + 32]), labels[start : start + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=200)
    parser.add_argument("--metrics", type=int, default=10, help="values per report")
    parser.add_argument("--tracking-uri", help="default: a fresh sqlite store in a temp folder")
    args = parser.parse_args()
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from gpuflow.cluster.job.tracking import MlflowTracker

    with tempfile.TemporaryDirectory(prefix="gf-bench-tracking-") as scratch:
        uri = args.tracking_uri or f"sqlite:///{scratch}/mlflow.db"
        client = MlflowClient(uri)
        experiment = client.create_experiment(f"tracking-overhead-{time.time_ns()}")
        step_s = digits_epoch_seconds()

        # the callback: what the controller's thread pays per report (the rest happens on the tracker's thread)
        run_id = client.create_run(experiment).info.run_id
        tracker = MlflowTracker(run_id, uri, print_progress=False)
        add_s = []
        for epoch in range(args.reports):
            metrics = {"epoch": epoch, **{f"metric_{i}": epoch * 0.001 + i for i in range(args.metrics)}}
            started = time.perf_counter()
            tracker.add(metrics, None)
            add_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        tracker.finish()
        drain_s = time.perf_counter() - started
        logged = sum(len(client.get_metric_history(run_id, f"metric_{i}")) for i in range(args.metrics))
        assert logged == args.reports * args.metrics, f"only {logged} of {args.reports * args.metrics} values logged"

        # for comparison: one synchronous log_batch per report, in the training's path
        run_id = client.create_run(experiment).info.run_id
        sync_s = []
        for epoch in range(args.reports):
            values = [
                Metric(f"metric_{i}", epoch * 0.001 + i, int(time.time() * 1000), epoch) for i in range(args.metrics)
            ]
            started = time.perf_counter()
            client.log_batch(run_id, metrics=values, synchronous=True)
            sync_s.append(time.perf_counter() - started)

    per_report = statistics.mean(add_s)
    print(f"baseline: one digits epoch (time between reports) {step_s * 1000:.1f} ms, median of 5")
    print(
        f"tracking callback: {per_report * 1e6:.0f} us per report of {args.metrics} values "
        f"= {100 * per_report / step_s:.4f} % of step time (target <= 1 %); "
        f"queue drained {drain_s:.2f} s after the last report; {logged} values in MLflow"
    )
    print(
        f"synchronous log_batch per report: {statistics.mean(sync_s) * 1000:.1f} ms "
        f"= {100 * statistics.mean(sync_s) / step_s:.1f} % of step time ({uri.split(':')[0]})"
    )
    from benchmarks.record import record

    record(
        "tracking_overhead",
        {
            "reports": args.reports,
            "values per report": args.metrics,
            "step ms": f"{step_s * 1000:.1f}",
            "callback µs per report": f"{per_report * 1e6:.0f}",
            "callback % of step": f"{100 * per_report / step_s:.4f}",
            "log_batch ms per report": f"{statistics.mean(sync_s) * 1000:.1f}",
            "log_batch % of step": f"{100 * statistics.mean(sync_s) / step_s:.1f}",
            "store": uri.split(":")[0],
            "queue drained s": f"{drain_s:.2f}",
        },
    )


if __name__ == "__main__":
    main()
