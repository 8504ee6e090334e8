"""How Ray Train hands the spec's datasets to its workers: a small table, already in memory, is split there.

Ray Data's default (`streaming_split`) starts a coordinator actor per dataset that streams blocks to the
workers: right for data larger than memory, but for a few megabytes read at once (trainer.datasets_of) its start
costs more than the whole read (seconds of CPU per dataset, on a small machine). Such a table is split into equal
parts instead, each put in Ray's object store once and read from there by its worker every epoch (`TableShard`): no
coordinator, and no Ray Data executor per pass (nor the stats actor the first one starts). A loop sees no
difference: `ray.train.get_dataset_shard(name)` is its share either way, the same share every epoch.
"""

import ray
import ray.train
from ray.data import DataIterator
from ray.data.dataset import Schema

from gpuflow.cluster.util.ray_train_internals import bundle_of_table, table_in_store


class SplitInMemory(ray.train.DataConfig):
    """Tables in memory split into equal parts, one per worker; any other dataset streams as usual."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        shards, streamed = [{} for _ in range(world_size)], {}
        for name, dataset in datasets.items():
            table = table_in_store(dataset)
            if table is None:
                streamed[name] = dataset
                continue
            rows = table.num_rows // world_size  # equal parts, as Ray Data's split(equal=True): the rest is left out
            for rank in range(world_size):
                shards[rank][name] = TableShard(table.slice(rank * rows, rows), dataset.context)
        if streamed:
            for rank, iterators in enumerate(
                super().configure(streamed, world_size, worker_handles, worker_node_ids, **kwargs)
            ):
                shards[rank].update(iterators)
        return shards


class TableShard(DataIterator):
    """One worker's part of a table, one block in Ray's object store, batched as Ray Data batches any block."""

    def __init__(self, part, context):
        self._bundle = bundle_of_table(ray.put(part.combine_chunks()), part)
        self._schema = Schema(part.schema)
        self._context = context

    def _to_ref_bundle_iterator(self):
        return iter([self._bundle]), None, None  # no stats: they are the executor's, and there is none

    def stats(self) -> str:
        return f"{self._bundle.num_rows()} rows held in Ray's object store: no Ray Data execution"

    def schema(self) -> Schema:
        return self._schema

    def get_context(self):
        return self._context
