"""Per-worker peak memory and throughput: every worker reading the whole Parquet table vs Ray Data streaming.

    python benchmarks/data_memory.py                      # 0.25, 0.5 and 1 GB of Parquet (a few minutes)
    python benchmarks/data_memory.py --sizes-gb 0.05 0.1  # a quick run

For each size it writes Parquet (1 KB rows: 256 float32 features and a label), starts a local Ray
cluster (2 training workers, as gpuflow's local backend does), and runs the same Ray Train job twice:
`table` — each worker reads the whole table (pyarrow, what loops did before) and iterates its half;
`stream` — each worker iterates its Ray Data shard (ray.train.get_dataset_shard, NumpyBatchCollateFn).
Prints each worker's peak private memory (USS, sampled through the loop), its growth over the loop, its peak RSS
(which also counts the shared object-store pages a zero-copy read touched) and rows/s; streaming's private memory
should stay flat.
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
        table = pa.table(
            {
                "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), FEATURES),
                "label": pa.array(generator.integers(0, 10, count)),
            }
        )
        pq.write_table(table, folder / f"part-{index:04d}.parquet", compression=None)
    return rows


def private_mb() -> float:
    """This process's own memory (USS). RSS would also count the pages of Ray's shared object store that a
    zero-copy read touched: those are the node's, bounded by the store's size, and counted once per node."""
    import psutil

    return psutil.Process().memory_full_info().uss / 1024**2


def consume(features, labels) -> float:
    """What a training step does with a batch, cheaply: touch every value."""
    return float(features.sum()) + float(labels.sum())


def table_batches(path: str, rank: int, world: int):
    """What loops did before: every worker reads the whole table, then iterates its slice."""
    import pyarrow.dataset as ds
    import torch

    table = ds.dataset(path, format="parquet").to_table()
    share = table.slice(rank * len(table) // world, len(table) // world)
    for offset in range(0, len(share), BATCH_SIZE):
        batch = share.slice(offset, BATCH_SIZE)
        features = batch.column("features").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES)
        yield torch.from_numpy(features), torch.from_numpy(batch.column("label").to_numpy())


def stream_batches():
    """gpuflow's way: this worker's Ray Data shard, read and batched as it goes."""
    import numpy as np
    import ray.train
    import torch
    from ray.data.collate_fn import NumpyBatchCollateFn

    class Collate(NumpyBatchCollateFn):
        def __call__(self, batch):
            # a fixed-size list column arrives as an array of rows: stack it, as experiments/digits.py does
            return torch.from_numpy(np.stack(batch["features"])), torch.as_tensor(batch["label"])

    yield from ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=BATCH_SIZE, collate_fn=Collate())


def worker_loop(config: dict) -> None:
    import ray.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    start_mb, started, rows = private_mb(), time.perf_counter(), 0
    peak_mb = start_mb
    batches = table_batches(config["path"], rank, world) if config["mode"] == "table" else stream_batches()
    for index, (features, labels) in enumerate(batches):
        consume(features, labels)
        rows += len(labels)
        if index % 32 == 0:
            peak_mb = max(peak_mb, private_mb())
    seconds = time.perf_counter() - started
    peak_mb = max(peak_mb, private_mb())
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(config["out"], f"{config['mode']}-{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "rows": rows,
                "seconds": seconds,
                "peak_mb": peak_mb,
                "growth_mb": peak_mb - start_mb,
                "peak_rss_mb": peak_rss_mb,
            }
        )
    )
    ray.train.report({"rows": rows})


def run(mode: str, path: Path, out: Path, storage: Path) -> list[dict]:
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        worker_loop,
        train_loop_config={"mode": mode, "path": str(path), "out": str(out)},
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

        spec = parse_spec(
            {"train": {"loop": "x:y"}, "data": {"train": "x.parquet"}, "compute": {"workers_per_node": WORKERS}}
        )
        local.LAUNCH_TIMEOUT_S = 600  # a busy shared machine can take minutes to start Ray
        import ray

        backend = LocalBackend()
        handle = backend.launch(spec, CLUSTER)
        try:
            # as gpuflow's job does: Ray Train's and Ray Data's own actors must not guess among the Ray clusters
            # on this machine
            ray.init(
                address=handle.address,
                logging_level="ERROR",
                log_to_driver=False,
                runtime_env={"env_vars": {"RAY_ADDRESS": handle.address}},
            )
            recorded = []  # rows for benchmarks/README.md, written once the cluster is down
            print(
                f"{'size':>7} {'reader':>7} {'peak private/worker':>20} {'growth/worker':>14} "
                f"{'peak RSS/worker':>16} {'rows/s/worker':>14}"
            )
            for size in args.sizes_gb:
                path = scratch / f"data-{size}"
                rows = write_parquet(path, size)
                results = {}
                for mode in ("table", "stream"):
                    workers = run(mode, path, scratch, scratch / "storage")
                    assert sum(w["rows"] for w in workers) >= rows - WORKERS, (mode, workers)
                    results[mode] = workers
                    peak, rss = (max(w[key] for w in workers) for key in ("peak_mb", "peak_rss_mb"))
                    growth = max(w["growth_mb"] for w in workers)
                    speed = min(w["rows"] / w["seconds"] for w in workers)
                    print(
                        f"{size:>5.2f}GB {mode:>7} {peak:>17.0f} MB {growth:>11.0f} MB {rss:>13.0f} MB {speed:>14,.0f}",
                        flush=True,
                    )
                    recorded.append(
                        {
                            "Parquet GB": f"{size:g}",
                            "reader": mode,
                            "peak private MB per worker": f"{peak:,.0f}",
                            "growth MB per worker": f"{growth:,.0f}",
                            "peak RSS MB per worker": f"{rss:,.0f}",
                            "rows/s per worker": f"{speed:,.0f}",
                        }
                    )
                ratio = max(w["peak_mb"] for w in results["table"]) / max(w["peak_mb"] for w in results["stream"])
                print(f"{'':>7} table/stream peak private memory: {ratio:.2f}x", flush=True)
                for part in path.iterdir():
                    part.unlink()
        finally:
            # the driver leaves before its cluster goes: a driver whose cluster vanished waits 60 s for it and
            # is then killed by Ray, taking the error it was about to print with it
            ray.shutdown()
            backend.down(CLUSTER)
    from benchmarks.record import record

    for figures in recorded:
        record("data_memory", figures)


if __name__ == "__main__":
    main()
