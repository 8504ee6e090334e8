"""Elastic workers: `compute.num_workers: [min, max]`. The cluster is launched at max (num_nodes × workers_per_node);
a lost node leaves the run training on the workers left, down to min, instead of a relaunch (docs/spot.md).

    compute: {num_nodes: 2, workers_per_node: 1, num_workers: [1, 2]}   # goes on with 1 worker if a node goes

Ray Train counts the workers a node can hold by its resources; gpuflow gives every node `workers_per_node` slots of
WORKER_SLOT_RESOURCE and an elastic run's workers one slot each, so that a run shrinks by whole nodes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuflow.cluster.spec.compute import ComputeSpec

WORKER_SLOT_RESOURCE = "gpuflow_worker_slot"


def split_range(compute: ComputeSpec) -> str | None:
    """Turns num_workers [min, max] into num_workers=max and min_workers=min; what is wrong with the range, if
    anything. [n, n] is a fixed size."""
    given = compute.num_workers
    if not isinstance(given, list):
        return None
    low, high = given
    if low < 1:
        return f"num_workers={given}: the minimum must be at least 1 worker; write e.g. [1, {max(high, 2)}]"
    if low > high:
        return (
            f"num_workers={given}: the minimum ({low}) is above the maximum ({high}); write [min, max], "
            f"e.g. [{high}, {low}]"
        )
    object.__setattr__(compute, "num_workers", high)
    object.__setattr__(compute, "min_workers", None if low == high else low)
    return None


def range_problem(compute: ComputeSpec) -> str | None:
    """Why the elastic range (already split, the topology resolved) cannot carry on after losing a node, if so."""
    low, nodes, per_node = compute.min_workers, compute.num_nodes, compute.workers_per_node
    if low is None:
        return None
    shown = f"num_workers=[{low}, {compute.num_workers}]"
    if low > compute.num_workers:
        return f"min_workers={low} is above num_workers={compute.num_workers}; lower it or give num_workers: [min, max]"
    if nodes == 1:
        return (
            f"{shown} on one node: a lost node is the whole cluster, nothing is left to train on; set "
            "num_nodes ≥ 2, or a fixed num_workers"
        )
    left = (nodes - 1) * per_node
    if low > left:
        return (
            f"{shown}: losing one of the {nodes} nodes ({per_node} worker(s) each) leaves {left} worker(s), "
            f"below the minimum {low}; lower the minimum to at most {left}, add nodes, or give a fixed "
            f"num_workers: {compute.num_workers}"
        )
    return None


def nodes_needed(compute: ComputeSpec) -> int:
    """The fewest nodes an elastic run trains on (all of them for a fixed size)."""
    return math.ceil((compute.min_workers or compute.num_workers) / compute.workers_per_node)


def node_losses_tolerated(compute: ComputeSpec) -> int:
    """How many nodes an elastic run may lose and train on: each is one restart of Ray Train's worker group."""
    return compute.num_nodes - nodes_needed(compute)


def node_resources(workers_per_node: int) -> dict[str, float]:
    """The custom resources every node of a cluster is started with: its worker slots."""
    return {WORKER_SLOT_RESOURCE: workers_per_node}
