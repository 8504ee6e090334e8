"""Ray Train's and Ray Data's private APIs that a run's trainer is built with (cluster/job/trainer.py), all here: read
against ray 2.60, like cluster/util/ray_internals.py (the rest of Ray's internals gpuflow uses). On a Ray upgrade,
check these first.

    without_unused_actors  DataParallelTrainer._create_default_callbacks (the callbacks Ray Train's controller starts
                           with) and _initialize_and_run_controller (its scaling policy). Two callbacks start an actor
                           a gpuflow run does not use, each a worker process of its own (about
                           2 CPU-seconds apiece to start): the PlacementGroupCleaner (a detached actor that frees the
                           run's placement group if the controller dies; gpuflow downs the whole cluster instead, and
                           the cleaner needs the dashboard, which is off) and the DatasetsCallback's DatasetManager:
                           none in a run without datasets, and where every dataset is `held_in_store`, the controller
                           splits them itself (DatasetsInStore; a provider per worker: SharesOf, what
                           ray.train.get_dataset_shard asks). And in a fixed-size run whose datasets (if any) are
                           all `held_in_store`, the scaling policy starts Ray Data's AutoscalingCoordinator actor
                           (another worker process: about 1.4 CPU-seconds) only to ask an autoscaler for its workers'
                           resources: our clusters have a fixed set of nodes and no autoscaler, so the request is not
                           sent (FixedScalingPolicy's _send/_maybe_send/_cancel_resource_request). With a streamed
                           dataset it is: Ray Data's ingest starts that actor anyway and reads Train's request to know
                           what is left for itself. An elastic run's policy reads the coordinator to size its worker
                           group, and keeps it.
    dataset_of_table,      ray.data's FromArrow logical operator, RefBundle and BlockEntry, and DataIterator's one
    held_in_store,         hook (_to_ref_bundle_iterator): ray.data.from_arrow reads a table's metadata in a task
    table_in_store,        (a Ray worker process started for it: about 1.5 CPU-seconds) and every pass over a dataset
    bundle_of_table        starts Ray Data's executor, which starts its _StatsActor (another worker process); a small
                           table gpuflow reads whole (cluster/job/trainer.py) is put in Ray's object store as one block
                           here, and its workers' shares are iterated straight from the store (cluster/job/ingest.py).
    abort_training         TrainController.abort, what Ray Train's own Ctrl-C handler calls, with the controller's
                           handle as DataParallelTrainer._register_sigint_handler receives it: the run's workers stop
                           and its callbacks' before_controller_abort runs (the tracker logs what it holds) before the
                           job's guard closes the run (cluster/job/guard.py).
    starting_from          the worker's TrainContext.checkpoint, what ray.train.get_checkpoint() returns: Ray Train v2
                           refuses resume_from_checkpoint, so a run that continues another (cluster/rerun/reuse.py)
                           gives its loop the earlier run's last checkpoint there, as a restore would; any loop
                           that resumes from ray.train.get_checkpoint() then goes on from it.

Nothing of Ray is imported with this module: only inside its functions (the job's guard imports it, Ray or not).
"""

from __future__ import annotations

import functools
import inspect
import time

_controllers: list = []  # the handles of the Ray Train controllers this process started (`abort_training`)


def without_unused_actors(trainer_class: type) -> type:
    """`trainer_class` (Ray Train's TorchTrainer) less the callbacks that would start actors the run does not use."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

    class FixedWithoutAutoscaler(FixedScalingPolicy):
        def _send_resource_request(self):
            pass

        def _maybe_send_resource_request(self):
            pass

        def _cancel_resource_request(self):
            pass

    class DatasetsInStore(DatasetsCallback):
        """Each worker's shares of tables held in the store, split by the controller as the worker group starts."""

        def before_init_train_context(self, workers):
            datasets = {name: dataset() if callable(dataset) else dataset for name, dataset in self._datasets.items()}
            if not all(held_in_store(dataset) for dataset in datasets.values()):
                return super().before_init_train_context(workers)
            shares = self._data_config.configure(
                datasets,
                world_size=len(workers),
                worker_handles=None,
                worker_node_ids=[w.metadata.node_id for w in workers],
            )
            return {"dataset_shard_provider": [SharesOf(share) for share in shares]}

    class Trainer(trainer_class):
        def _create_default_callbacks(self):
            unused = (
                (PlacementGroupCleanerCallback,) if self.datasets else (PlacementGroupCleanerCallback, DatasetsCallback)
            )
            return [
                DatasetsInStore(self.train_run_context, self.datasets)
                if type(callback) is DatasetsCallback
                else callback
                for callback in super()._create_default_callbacks()
                if not isinstance(callback, unused)
            ]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            policy = controller_init_kwargs["scaling_policy"]
            if type(policy) is FixedScalingPolicy and not streams(self.datasets):  # Ray Data's ingest reads Train's
                controller_init_kwargs["scaling_policy"] = FixedWithoutAutoscaler(policy.scaling_config)
            try:
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            finally:
                _controllers.clear()  # a handle kept would keep the ended run's controller alive

        def _register_sigint_handler(self, controller):
            _controllers.append(controller)  # what `abort_training` stops
            super()._register_sigint_handler(controller)

    Trainer.__name__ = Trainer.__qualname__ = trainer_class.__name__
    return Trainer


class SharesOf:
    """A worker's dataset shard provider (what `ray.train.get_dataset_shard` asks) holding its shares as they are."""

    def __init__(self, shares: dict):
        self.shares = shares

    def get_dataset_shard(self, dataset_info):
        if dataset_info.dataset_name not in self.shares:
            raise KeyError(f"no dataset {dataset_info.dataset_name!r}: pass it in the trainer's `datasets`")
        return self.shares[dataset_info.dataset_name]


def streams(datasets: dict | None) -> bool:
    """True when a trainer's datasets include one Ray Data executes (not `held_in_store`)."""
    return any(not held_in_store(dataset) for dataset in (datasets or {}).values())


def dataset_of_table(table):
    """`ray.data.from_arrow(table)`, the table's metadata read here rather than in a Ray task."""
    import ray
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.from_operators import FromArrow
    from ray.data._internal.stats import DatasetStats
    from ray.data.block import BlockMetadataWithSchema
    from ray.data.context import DataContext
    from ray.data.dataset import MaterializedDataset

    metadata = [BlockMetadataWithSchema.from_block(table)]
    context = DataContext.get_current().copy()
    plan = LogicalPlan(FromArrow([ray.put(table)], metadata), context)
    return MaterializedDataset(plan, context, DatasetStats(metadata={"FromArrow": metadata}, parent=None))


def held_in_store(dataset) -> bool:
    """True for a dataset made by `dataset_of_table` (or ray.data.from_arrow): its table is in Ray's object store as
    it is, with nothing to execute; False for any other (a lazy read, a transformed one)."""
    from ray.data._internal.logical.operators.from_operators import FromArrow

    return isinstance(getattr(getattr(dataset, "_logical_plan", None), "dag", None), FromArrow)


def table_in_store(dataset):
    """The whole table of a dataset `held_in_store`, read from the store; None for any other dataset."""
    import pyarrow as pa
    import ray

    if not held_in_store(dataset):
        return None
    bundles = dataset._logical_plan.dag.output_data()
    return pa.concat_tables(ray.get([entry.ref for bundle in bundles for entry in bundle.blocks]))


def bundle_of_table(block_ref, table):
    """The RefBundle of one table already in Ray's object store (`block_ref`), as Ray Data's iterators take it."""
    from ray.data._internal.execution.interfaces.ref_bundle import BlockEntry, RefBundle
    from ray.data.block import BlockMetadataWithSchema

    metadata = BlockMetadataWithSchema.from_block(table)
    return RefBundle([BlockEntry(block_ref, metadata)], owns_blocks=False, schema=metadata.schema)


def abort_training(timeout_s: float) -> None:
    """Stops this process's Ray Train runs as Ctrl-C does (their workers stopped, what their callbacks hold logged),
    waiting up to `timeout_s` in all; a controller that does not answer (its cluster is gone) is left."""
    if not _controllers:
        return  # none yet (stopped before training), or a sweep's trials (Tune runs them off the main thread)
    import ray

    deadline = time.monotonic() + timeout_s
    for controller in list(_controllers):
        try:
            ray.get(controller.abort.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            continue


def starting_from(loop, checkpoint_uri: str | None):
    """The loop (a function of its config), its first ray.train.get_checkpoint() on each worker being the checkpoint at
    `checkpoint_uri` when the run has none of its own (a relaunch resumes from the run's own latest)."""
    if not checkpoint_uri:
        return loop
    takes_config = bool(inspect.signature(loop).parameters)

    @functools.wraps(loop)
    def train_loop(config):
        from ray.train import Checkpoint
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context()
        with context.report_order_condition:
            if context.checkpoint is None:
                context.checkpoint = Checkpoint(checkpoint_uri)
        return loop(config) if takes_config else loop()

    return train_loop
