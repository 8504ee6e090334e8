"""An elastic run on the cluster (compute.num_workers: [min, max]): Ray Train trains on the workers the live nodes
hold, and the flow is told how many nodes are left, to bill those.

    ScalingConfig(num_workers=elastic_workers(spec.compute), resources_per_worker={..., **worker_slot(spec.compute)})
    FailureConfig(**failure_budget(spec.compute))
    RunConfig(callbacks=[..., ElasticRestarts()])     # a restart after a node's loss is sized without that node
    NodeCount(spec.compute.num_nodes).start()          # prints `[gpuflow] nodes alive: 1 of 2` as it changes

Ray Train v2 tells a node's loss from the loop's crash only when the node was drained for a preemption (a notice):
both are a worker group's failure, charged to FailureConfig.max_failures. So an elastic run's budget of worker group
restarts grows by one per node it may lose, and a loop that crashes is retried that many more times.
"""

from __future__ import annotations

import threading

from gpuflow.cluster.protocol import nodes_line
from gpuflow.cluster.spec.elastic import WORKER_SLOT_RESOURCE, node_losses_tolerated
from gpuflow.cluster.util.ray_internals import ControllerCallback, refresh_autoscaling_view
from gpuflow.cluster.util.waiting import wait_until

NODE_POLL_S = 2.0
# Ray marks a lost node dead once its health checks fail: seconds for a killed process, up to a minute for a machine
# that stopped answering. A restart sized before then would wait for the lost node.
NODE_DEATH_SETTLE_S = 60.0


def alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node["Alive"])


def elastic_workers(compute) -> int | tuple[int, int]:
    """ScalingConfig's num_workers: the range of an elastic run, else the fixed count."""
    return (compute.min_workers, compute.num_workers) if compute.min_workers else compute.num_workers


def worker_slot(compute) -> dict[str, float]:
    """An elastic run's workers take a node's worker slot each: Ray Train then sizes it by whole nodes, not by
    whatever CPUs are free (a local node's extra CPU for Ray Data would hold a second worker)."""
    return {WORKER_SLOT_RESOURCE: 1} if compute.min_workers else {}


def failure_budget(compute) -> dict[str, int]:
    """FailureConfig's limits. A fixed-size run: the flow, not Ray, decides about a lost node (no preemption retry,
    no controller retry). An elastic run: one more worker group restart per node it may lose, with or without a
    notice, and one controller retry each for a restart sized on a stale view of the cluster."""
    losses = node_losses_tolerated(compute) if compute.min_workers else 0
    return {
        "max_failures": compute.worker_restarts + losses,
        "max_preemption_failures": losses,
        "controller_failure_limit": losses,
    }


class ElasticRestarts(ControllerCallback):
    """Before a worker group is restarted, waits (up to NODE_DEATH_SETTLE_S) for Ray to have a lost node dead, then
    has the autoscaling view re-read: the restart is sized for the nodes left. A failure with no node lost (the
    loop's own) waits the whole settle time before its retry."""

    def __init__(self):
        self.alive: int | None = None

    def after_controller_start(self, train_run_context) -> None:
        self.alive = alive_nodes()

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        if failure_decision.value != "RETRY" or self.alive is None:
            return
        before = self.alive
        try:
            wait_until(lambda: alive_nodes() < before, NODE_DEATH_SETTLE_S, interval_s=0.5)
            self.alive = alive_nodes()
            refresh_autoscaling_view()
        except Exception as exc:  # an error here would fail the run: the view's own tick re-reads within 20 s
            print(
                f"[gpuflow] warning: could not refresh Ray's view of the cluster: {type(exc).__name__}: {exc}",
                flush=True,
            )


class NodeCount(threading.Thread):
    """The cluster's live Ray nodes, printed when they change: what the flow bills an elastic run for."""

    def __init__(self, of: int):
        super().__init__(daemon=True, name="gpuflow-nodes")
        self.of, self.alive = of, of
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(NODE_POLL_S):
            try:
                alive = alive_nodes()
            except Exception:  # Ray's GCS busy or going: ask again
                continue
            if alive != self.alive:
                self.alive = alive
                print(nodes_line(alive, self.of), flush=True)

    def stop(self) -> None:
        self._stopped.set()


def count_nodes(compute) -> NodeCount | None:
    """An elastic run's NodeCount, started (needs `ray.init`); None for a fixed size."""
    if not compute.min_workers:
        return None
    count = NodeCount(compute.num_nodes)
    count.start()
    return count
