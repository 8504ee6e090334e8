"""A Ray Train driver for tests/test_ingest.py: trains tests.loops.plain:record_shards with gpuflow's ingest, its
trainer as the job builds it (no actor it does not use: no placement-group cleaner, no preemption watcher), twice: on
a table alone, then on a table and a streamed dataset.

python -m tests.support.shards_driver ADDRESS OUT_FOLDER STREAMED_PARQUET ROWS
"""

import os
import sys

import pyarrow as pa
import ray
import ray.data
import ray.train
from ray.train.torch import TorchTrainer

from gpuflow.cluster.job.ingest import SplitInMemory
from gpuflow.cluster.util.ray_internals import PREEMPTION_WATCHER_ENV
from gpuflow.cluster.util.ray_train_internals import dataset_of_table, without_unused_actors
from tests.loops.plain import record_shards
from tests.support.repo import REPO

address, out, streamed, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
os.environ[PREEMPTION_WATCHER_ENV] = "0"  # as the job sets it where no spot notice can come
ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "RAY_ADDRESS": address}})
in_memory = dataset_of_table(pa.table({"id": list(range(rows))}))  # in the store, as job.datasets_of
streamed = ray.data.read_parquet(streamed)  # lazy: Ray Data streams it
# Tables alone are split by the controller; beside a streamed dataset, by Ray Train's dataset manager.
for name, datasets in (
    ("in_store", {"in_memory": in_memory}),
    ("mixed", {"in_memory": in_memory, "streamed": streamed}),
):
    os.makedirs(f"{out}/{name}")
    without_unused_actors(TorchTrainer)(
        record_shards,
        train_loop_config={"epochs": 2, "out": f"{out}/{name}", "datasets": list(datasets)},
        datasets=datasets,
        dataset_config=SplitInMemory(),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name=f"shards-{name}", storage_path=f"{out}/storage"),
    ).fit()
