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
    node_id_of             a ray._private.node.Node's id (hex): the supervisor records it beside the raylet.
    drain_node             ray._raylet.GcsClient(address).drain_node(node_id_hex, reason, message, deadline_ms), what
                           the hidden `ray drain-node` command and autoscaler v2 call: marks a node as being taken
                           (reason DRAIN_NODE_REASON_PREEMPTION: GCS may not refuse it) by a deadline. Ray Train's
                           PreemptionWatcher polls the draining nodes and its loop reads them through
                           `ray.train.get_preemption_info()` (cluster/job/spot_watch.py drains on a cloud's notice).
                           A drained node's raylet exits as soon as nothing runs on it (an idle node at once; a busy
                           one once Ray Train stops its workers at the deadline), dead with reason
                           AUTOSCALER_DRAIN_PREEMPTED and the drain's message (`preempted_nodes`).
                           GcsClient.drain_node's docstring says "binary node ID", but Ray's own callers (the CLI,
                           Node._drain_node_before_shutdown) pass hex, and only hex drains: the node's comment says so.
    draining_nodes         ray._private.state.state.get_draining_nodes() as the GCS client gives it: {node id hex:
                           deadline ms}, what Ray Train's PreemptionWatcher polls.
    preempted_nodes        GcsClient.get_all_node_info: the nodes dead of a preemption drain, with its message.
    node_with_temp_dir     GcsClient.get_all_node_info(state_filter=ALIVE): the live node started with a temp dir
                           (`ray start --temp-dir`), as Ray's own services.get_node_to_connect_for_driver finds it: a
                           SkyPilot node's watch finds its own node id so (each node's Ray has a temp dir of its own).
    refresh_autoscaling_view  ray.data's AutoscalingCoordinator actor, which Ray Train's elastic scaling asks how many
                           workers the cluster holds: it re-reads the cluster only every 20 s, so a worker group
                           restarted after a node's loss would be sized for the lost node and wait for it (until
                           the worker group's start timeout). get_reserved_resources(recompute=True) re-reads it now
                           (cluster/job/elastic.py, once Ray has the node dead).
    SNAPSHOT_FILE          ray.train.v2's checkpoint manager snapshot, beside a run's checkpoints: the reports it
                           registered, each checkpoint's metrics (cluster/job/tracking.py logs those a lost controller
                           took with it).
    PREEMPTION_WATCHER_ENV ray.train.v2._internal.constants: the switch of Ray Train's PreemptionWatcher (default on in
                           2.60; gpuflow turns it on only where a notice can come), propagated to the workers.

Ray Train's and Ray Data's internals that a run's trainer is built with are in cluster/util/ray_train_internals.py.

Nothing of Ray is imported with this module: the callback classes load when first asked for (a module __getattr__,
so that `from ... import ControllerCallback` still works), the rest inside their functions. The local supervisor
must not load Ray Train, and the flow side, which never needs these, must not load Ray at all.
"""

from __future__ import annotations

_CALLBACK_MODULE = "ray.train.v2._internal.execution.callback"
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"  # how often that watcher polls (default 5 s)
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
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


def node_id_of(node) -> str:
    """A ray._private.node.Node's id, hex."""
    return node.node_id


def drain_node(gcs_address: str, node_id: str, message: str, deadline_ms: int, timeout_s: float = 10) -> None:
    """Marks the node as preempted by `deadline_ms` (epoch ms) in Ray's GCS; raises if GCS refuses."""
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    accepted, why = ray._raylet.GcsClient(address=gcs_address).drain_node(
        node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        message,
        deadline_ms,
        timeout=timeout_s,
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")


def draining_nodes(gcs_address: str) -> dict[str, int]:
    """The nodes being drained, {node id hex: deadline ms (0: none)}."""
    import ray._raylet

    return ray._raylet.GcsClient(address=gcs_address).get_draining_nodes()


def preempted_nodes(gcs_address: str) -> dict[str, str]:
    """The nodes that left the cluster drained for preemption: {node id hex: the drain's message}."""
    import ray._raylet
    from ray.core.generated.common_pb2 import NodeDeathInfo
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = ray._raylet.GcsClient(address=gcs_address).get_all_node_info(
        timeout=10, state_filter=GcsNodeInfo.GcsNodeState.DEAD
    )
    return {
        info.node_id.hex(): info.death_info.reason_message
        for info in infos.values()
        if info.death_info.reason == NodeDeathInfo.Reason.AUTOSCALER_DRAIN_PREEMPTED
    }


def node_with_temp_dir(gcs_address: str, temp_dir: str) -> str | None:
    """The id (hex) of the live Ray node started with `temp_dir`, or None while there is none."""
    import ray._raylet
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    infos = ray._raylet.GcsClient(address=gcs_address).get_all_node_info(
        timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE
    )
    return next((info.node_id.hex() for info in infos.values() if info.temp_dir == temp_dir), None)


def refresh_autoscaling_view(timeout_s: float = 10) -> None:
    """Makes Ray's AutoscalingCoordinator re-read the cluster's live nodes now instead of at its next tick."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.get_reserved_resources.remote("gpuflow-refresh", recompute=True), timeout=timeout_s)


def free_placement_group(group_hex: str | None) -> None:
    """Removes a trial's placement group; one that Ray Train already removed (a trial that finished) is no error."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    if not group_hex:
        return
    try:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_hex)))
    except Exception:
        pass


def reserved_placement_groups() -> int:
    """Placement groups still holding resources on the cluster: none should, once the sweep is over."""
    from ray.util import placement_group_table

    return sum(1 for group in placement_group_table().values() if group.get("state") == "CREATED")
