"""Ray's private and internal APIs that gpuflow uses, all here: read against ray 2.60 (pyproject pins >=2.60,<2.61).

None of them is covered by Ray's compatibility promises; each is here because that Ray has no public way to do it.
On a Ray upgrade, check these first.

    ControllerCallback     ray.train.v2._internal.execution.callback: Ray Train's controller hooks. The end of a run
                           (after_controller_finish, before_controller_abort), whatever its outcome, is the only moment
                           every report is in; UserCallback has no end-of-run hook. cluster/job/tracking.py flushes its
                           MLflow queue there.
    WorkerGroupCallback    the same module: after_worker_group_start hands over a trial's worker group, whose
                           placement group the sweep's driver frees when Tune stops the trial (cluster/job/sweep.py):
                           Ray's own cleaner needs the dashboard, which is off.
    placement_group_of     that worker group's placement group, through its internal state object.
    no_ray_address_file    ray._private.utils.write_ray_address: ray.cluster_utils.Cluster records its address in
                           /tmp/ray for `ray.init()` to find; the local supervisor turns that off, so that no driver
                           but ours attaches to a local cluster (cluster/backends/local/supervisor.py).
    raylet_pid,            the nodes of ray.cluster_utils.Cluster are ray._private.node.Node objects: their processes
    dead_processes         by kind (ray._private.ray_constants), and those that died. The supervisor records each
                           node's raylet and tells a lost node by them.

Nothing of Ray is imported with this module: the callback classes load when first asked for (a module __getattr__,
so that `from ... import ControllerCallback` still works), the rest inside their functions. The local supervisor
must not load Ray Train, and the flow side, which never needs these, must not load Ray at all.
"""

from __future__ import annotations

_CALLBACK_MODULE = "ray.train.v2._internal.execution.callback"
_CALLBACKS = {"ControllerCallback", "WorkerGroupCallback"}


def __getattr__(name: str):
    if name in _CALLBACKS:
        import importlib

        return getattr(importlib.import_module(_CALLBACK_MODULE), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def placement_group_of(worker_group):
    """The placement group (ray.util.placement_group.PlacementGroup) a Ray Train worker group runs in."""
    return worker_group.get_worker_group_state().placement_group_handle.placement_group


def no_ray_address_file() -> None:
    """Stops ray.cluster_utils.Cluster (and anything else in this process) recording its address in /tmp/ray."""
    import ray._private.utils

    ray._private.utils.write_ray_address = lambda *args, **kwargs: None


def raylet_pid(node) -> int:
    """The pid of a ray._private.node.Node's raylet."""
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid


def dead_processes(node) -> list:
    """A ray._private.node.Node's processes that died, as (kind, process) pairs."""
    return node.dead_processes()
