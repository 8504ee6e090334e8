"""How Ray Train hands the spec's datasets to its workers: a small table, already in memory, is split there.

Ray Data's default (`streaming_split`) starts a coordinator actor per dataset that streams blocks to the
workers: right for data larger than memory, but for a few megabytes read at once (trainer.datasets_of) its start
costs more than the whole read (seconds of CPU per dataset, on a small machine). A loop sees no difference:
`ray.train.get_dataset_shard(name)` is its share either way, the same share every epoch.
"""

import ray.train
from ray.data.dataset import MaterializedDataset


class SplitInMemory(ray.train.DataConfig):
    """Materialized datasets split into equal parts, one per worker; any other dataset streams as usual."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        shards, streamed = [{} for _ in range(world_size)], {}
        for name, dataset in datasets.items():
            if isinstance(dataset, MaterializedDataset):
                for rank, part in enumerate(dataset.split(world_size, equal=True)):
                    shards[rank][name] = part.iterator()
            else:
                streamed[name] = dataset
        if streamed:
            for rank, iterators in enumerate(
                super().configure(streamed, world_size, worker_handles, worker_node_ids, **kwargs)
            ):
                shards[rank].update(iterators)
        return shards
