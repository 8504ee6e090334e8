"""Where Ray clusters come from: the interface (base.py), this machine (local/) and SkyPilot (skypilot/).

get_backend("local") -> LocalBackend; get_backend("skypilot") -> SkyPilotBackend
"""

from __future__ import annotations

from gpuflow.cluster.backends.base import (
    CLUSTER_PREFIX,
    HEAD_NODE_RESOURCES,
    TRIAL_DRIVER_RESOURCE,
    Backend,
    ClusterHandle,
    ClusterStatus,
    Job,
    NoCapacity,
    cluster_name_for,
    cluster_names_for,
    flow_run_id_of,
    train_run_name,
)

__all__ = [
    "CLUSTER_PREFIX",
    "HEAD_NODE_RESOURCES",
    "TRIAL_DRIVER_RESOURCE",
    "Backend",
    "NoCapacity",
    "ClusterHandle",
    "ClusterStatus",
    "Job",
    "cluster_name_for",
    "cluster_names_for",
    "flow_run_id_of",
    "get_backend",
    "train_run_name",
]


def get_backend(name: str) -> Backend:
    if name == "local":
        from gpuflow.cluster.backends.local import LocalBackend

        return LocalBackend()
    if name == "skypilot":
        from gpuflow.cluster.backends.skypilot import SkyPilotBackend

        return SkyPilotBackend()
    raise ValueError(f"compute.backend: unknown backend {name!r}; use 'local' or 'skypilot'")
