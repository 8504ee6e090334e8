"""Per-worker peak memory and throughput: every worker reading the whole Parquet table vs Ray Data streaming.

    python benchmarks/data_memory.py                      # 0.25, 0.5 and 1 GB of Parquet (a few minutes)
    python benchmarks/data_memory.py --sizes-gb 0.05 0.1  # a quick run

For each size it writes Parquet (1 KB rows: 256 float32 features and a label), starts a local Ray
cluster (2 training workers, as gpuflow's local backend does), and runs the same Ray Train job twice:
`table` — each worker reads the whole table (pyarrow, what loops did before) and iterates its half;
`stream` — each worker iterates its Ray Data shard (ray.train.get_dataset_shard, NumpyBatchCollateFn).
Prints each worker's peak RSS, its growth over the loop, and rows/s; streaming's memory should stay flat.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuflow.cluster.backends import local  # noqa: E402
from gpuflow.cluster.backends.local import LocalBackend, ray_env  # noqa: E402

os.environ.update(ray_env())  # before Ray is imported: nodes and driver on 127.0.0.1

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

FEATURES = 256
ROWS_PER_FILE = 32 * 1024  # ~32 MB files: a folder, as real data sets come
BATCH_SIZE = 1024
WORKERS = 2
CLUSTER = "gpuflow-bench0000000000000000000000000000"[:40]


def write_parquet(folder: Path, size_gb: float) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    rows = int(size_gb * 1024**3 / (FEATURES * 4 + 8))
    generator = np.random.default_rng(0)
    for index, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        count = min(ROWS_PER_FILE, rows - start)
        features = generator.random((count, FEATURES), dtype=np.float32)
        table = pa.table({"features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), FEATURES),
                          "label": pa.array(generator.integers(0, 10, count))})
        pq.write_table(table, folder / f"part-{index:04d}.parquet", compression=None)
    return rows


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1024**2


def consume(features, labels) -> float:
    """What a training step does with a batch, cheaply: touch every value."""
    return float(features.sum()) + float(labels.sum())


def worker_loop(config: dict) -> None:
    import ray.train
    import torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    start_rss, started, rows = rss_mb(), time.perf_counter(), 0
    if config["mode"] == "table":
        import pyarrow.dataset as ds

        table = ds.dataset(config["path"], format="parquet").to_table()  # the whole table, in every worker
        share = table.slice(rank * len(table) // world, len(table) // world)
        for offset in range(0, len(share), BATCH_SIZE):
            batch = share.slice(offset, BATCH_SIZE)
            features = torch.from_numpy(batch.column("features").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES))
            consume(features, torch.from_numpy(batch.column("label").to_numpy()))
            rows += len(batch)
    else:
        from ray.data.collate_fn import NumpyBatchCollateFn

        class Collate(NumpyBatchCollateFn):
            def __call__(self, batch):
                return torch.as_tensor(batch["features"]), torch.as_tensor(batch["label"])

        for features, labels in ray.train.get_dataset_shard("train").iter_torch_batches(
                batch_size=BATCH_SIZE, collate_fn=Collate()):
            consume(features, labels)
            rows += len(labels)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(config["out"], f"{config['mode']}-{rank}.json").write_text(json.dumps(
        {"rank": rank, "rows": rows, "seconds": seconds, "peak_rss_mb": peak, "growth_mb": peak - start_rss}))
    ray.train.report({"rows": rows})


def run(mode: str, path: Path, out: Path, storage: Path) -> list[dict]:
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        worker_loop, train_loop_config={"mode": mode, "path": str(path), "out": str(out)},
        datasets={"train": ray.data.read_parquet(str(path))} if mode == "stream" else None,
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=f"{mode}-{time.time_ns()}", storage_path=str(storage)),
    )
    trainer.fit()
    return [json.loads((out / f"{mode}-{rank}.json").read_text()) for rank in range(WORKERS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    with tempfile.TemporaryDirectory(prefix="gf-bench-data-") as scratch:
        scratch = Path(scratch)
        os.environ["GPUFLOW_HOME"] = str(scratch / "home")
        from gpuflow.cluster.spec import parse_spec

        spec = parse_spec({"train": {"loop": "x:y"}, "data": {"train": "x.parquet"},
                           "compute": {"workers_per_node": WORKERS}})
        local.LAUNCH_TIMEOUT_S = 600  # a busy shared machine can take minutes to start Ray
        backend = LocalBackend()
        handle = backend.launch(spec, CLUSTER, on_line=lambda line: None)
        try:
            import ray

            ray.init(address=handle.address, logging_level="ERROR", log_to_driver=False)
            print(f"{'size':>7} {'reader':>7} {'peak RSS/worker':>16} {'growth/worker':>14} {'rows/s/worker':>14}")
            for size in args.sizes_gb:
                path = scratch / f"data-{size}"
                rows = write_parquet(path, size)
                results = {}
                for mode in ("table", "stream"):
                    workers = run(mode, path, scratch, scratch / "storage")
                    assert sum(w["rows"] for w in workers) >= rows - WORKERS, (mode, workers)
                    results[mode] = workers
                    peak = max(w["peak_rss_mb"] for w in workers)
                    growth = max(w["growth_mb"] for w in workers)
                    speed = min(w["rows"] / w["seconds"] for w in workers)
                    print(f"{size:>5.2f}GB {mode:>7} {peak:>13.0f} MB {growth:>11.0f} MB {speed:>14,.0f}", flush=True)
                ratio = max(w["peak_rss_mb"] for w in results["table"]) / max(w["peak_rss_mb"] for w in results["stream"])
                print(f"{'':>7} table/stream peak memory: {ratio:.2f}x", flush=True)
                for part in path.iterdir():
                    part.unlink()
            ray.shutdown()
        finally:
            backend.down(CLUSTER)


if __name__ == "__main__":
    main()
