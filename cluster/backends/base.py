"""The backend interface: one for every place a Ray cluster can come from, with SkyPilot's verbs.

launch(spec, name, job=None) -> handle; exec(handle, ...) -> job id; tail_logs(handle, job id, read) -> exit code;
status() -> our clusters; lost(name) -> why a cluster is no longer whole (a node or all of it gone), else None;
down(name) tears a cluster down, idempotent and safe on a half-made one.
`down` takes a name, not a handle: Prefect's cancel and crash hooks run in another process.
A backend that `starts_job_at_launch` (SkyPilot) starts the job given to `launch` with the cluster, as one job of
setup and training; `exec` then returns that job's id instead of submitting another.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gpuflow.cluster.spec import ExperimentSpec

CLUSTER_PREFIX = "gpuflow-"
# A custom resource on every cluster's head node that a sweep's trial drivers take instead of a CPU: by default each
# holds a whole CPU, which on a small cluster leaves the trials' own workers none (the sweep hangs). The amount only
# has to exceed any sweep.max_concurrent_trials.
TRIAL_DRIVER_RESOURCE = "gpuflow_trial_driver"
HEAD_NODE_RESOURCES = {TRIAL_DRIVER_RESOURCE: 1000}


@dataclass
class ClusterHandle:
    name: str
    backend: str
    address: str = ""  # Ray GCS address the job connects to, where known
    info: dict = field(default_factory=dict)


@dataclass
class Job:
    """The training job a launch may start with its cluster: Ray Train's run name and the job's environment."""

    run_name: str
    env: dict[str, str]


@dataclass
class ClusterStatus:
    name: str
    backend: str
    status: str  # UP, INIT, STOPPED, ...; GONE: its processes are dead (local); ORPHANED: and so is its launcher
    launched_at: float | None = None


# The reader of a job's log: each line, as it comes (the flow's, which follows the job's progress markers).
LineReader = Callable[[str], object]


class Backend(Protocol):
    name: str
    loss_poll_s: float | None  # how often the flow may ask `lost` while a job runs; None: only once it failed
    starts_job_at_launch: bool  # `launch` starts the job it is given: its data and MLflow run must exist first

    def launch(self, spec: ExperimentSpec, cluster_name: str, job: Job | None = None) -> ClusterHandle:
        """Brings the cluster up (its progress in this module's logger), or returns it if one of that name is up."""

    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str: ...

    def tail_logs(self, handle: ClusterHandle, job_id: str, read: LineReader) -> int:
        """Hands each line of the job's log to `read` as it comes, until the job ends; returns its exit code."""

    def status(self) -> list[ClusterStatus]: ...

    def lost(self, cluster_name: str) -> str | None: ...

    def down(self, cluster_name: str) -> bool: ...


def cluster_name_for(flow_run_id: str, relaunch: int = 0) -> str:
    """gpuflow-<flow run id hex>: a retry of the same flow run finds its own cluster, and the reaper its owner.

    A relaunch after a loss gets a name of its own (-r1, -r2, ...): a node that comes back (Slurm's same host, a
    reused disk) may still hold the lost cluster's runtime under the old name, and SkyPilot would then skip setting
    up the new one (seen on Slurm: the relaunch found no user Python environment)."""
    name = CLUSTER_PREFIX + re.sub(r"[^0-9a-f]", "", str(flow_run_id).lower())
    return f"{name}-r{relaunch}" if relaunch else name


def cluster_names_for(flow_run_id: str, max_recoveries: int) -> list[str]:
    """Every name a flow run's cluster may have had: the first launch's and each relaunch's."""
    return [cluster_name_for(flow_run_id, relaunch) for relaunch in range(max_recoveries + 1)]


def train_run_name(spec_name: str, flow_run_id: str) -> str:
    """Ray Train's run name, the checkpoints' folder under storage: stable for the flow run, so that a relaunch
    (a retry, a recovery) finds and resumes from its checkpoints."""
    return f"{spec_name}-{re.sub(r'[^0-9a-f]', '', str(flow_run_id).lower())[:12]}"


def flow_run_id_of(cluster_name: str) -> str | None:
    """The Prefect flow-run id a gpuflow cluster name encodes; None for a cluster that is not ours."""
    match = re.fullmatch(CLUSTER_PREFIX + r"([0-9a-f]{32})(?:-r\d+)?", cluster_name)
    if not match:
        return None
    h = match.group(1)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class NoCapacity(RuntimeError):
    """No option had capacity (SkyPilot tried them all): `reasons` holds (option, why) for each, `spot` whether
    every option that failed was spot (a spot capacity error counts toward compute.spot_fallback_after)."""

    def __init__(self, message: str, reasons: list[tuple[str, str]], spot: bool = False):
        super().__init__(message)
        self.reasons, self.spot = reasons, spot

    def __reduce__(self):  # the provision task's answer may be pickled as its result: rebuilt with its reasons
        return type(self), (str(self), self.reasons, self.spot)
