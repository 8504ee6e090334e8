"""Warm local clusters: one started before its run has an id (`prewarm`: `gpuflow run` starts it while Prefect's API
and the flow start), or the warm stack's spare of the same shape, claimed by a rename; and the job's process started
early beside it (early_job.py), which the run takes over when it was started in the run's environment."""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

from gpuflow.cluster.backends.base import CLUSTER_PREFIX
from gpuflow.cluster.backends.local import early_job
from gpuflow.cluster.backends.local.early_job import OWNER_FILE
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.util.files import write_atomically
from gpuflow.cluster.util.processes import alive, session_alive, started_at, still_the_process, stop_sessions

# The cluster `prewarm` started for this process's next launch (the CLI prewarms, the flow in the same process
# launches): a hand-over inside one process, so a plain variable.
PREWARMED: list[str] = []
# the warm stack's clusters that no run has claimed yet (flows/local_stack/stack.py)
SPARE_PREFIX = f"{CLUSTER_PREFIX}spare-"


class WarmClusters:
    """LocalBackend's warm start (a part of the class: it uses the backend's root, record, _write, start and
    _children)."""

    def prewarm(self, spec: ExperimentSpec) -> str:
        """A cluster for a flow run that has no id yet; `launch` adopts it when the shape matches. It is the warm
        stack's spare (flows/local_stack/stack.py) when one of that shape is up, else one started now, so that it
        starts while Prefect's API starts and the flow run begins. The job's process starts now too: its imports (Ray,
        torch, MLflow: seconds) overlap the flow's start, and it waits for `exec` to hand it the run."""
        name = self.claim_spare(spec)
        if name is None:
            name = f"{CLUSTER_PREFIX}warm-{uuid.uuid4().hex[:12]}"
            self.start(spec, name)
        if not self._takes_over_early_job(name):
            self.start_early_job(name, spec.workdir)
        PREWARMED[:] = [name]
        return name

    def start_early_job(self, cluster_name: str, cwd: str) -> None:
        """The cluster's job process, started now to wait for its run (cluster/backends/local/early_job.py)."""
        record = self.record(cluster_name)
        process = early_job.start(self.root / cluster_name, record["temp_dir"], record["session"], cwd)
        record["jobs"][str(process.pid)] = {
            "log": "job.log",
            "run_name": None,
            "environment": early_job.environment_digest(),
            "started": started_at(process.pid),
        }
        self._write(cluster_name, record)
        self._children[str(process.pid)] = process

    def offer_spare(self, cluster_name: str) -> None:
        """Makes a spare the stack started claimable, once it is up and its early job started: a run that claimed it
        before would rename it under the stack's feet (`claim_spare` takes only a spare offered)."""
        self._write(cluster_name, {**self.record(cluster_name), "offered": True})

    def _takes_over_early_job(self, cluster_name: str) -> bool:
        """Whether a claimed spare's early job (the stack's) waits, started in this process's environment; one started
        in another is stopped: its environment would not be the run's."""
        record = self.record(cluster_name)
        waiting = {
            pid: job for pid, job in record["jobs"].items() if job["run_name"] is None and self._running(pid, job)
        }
        if any(job.get("environment") == early_job.environment_digest() for job in waiting.values()):
            return True
        stop_sessions([int(pid) for pid in waiting])
        record["jobs"] = {pid: job for pid, job in record["jobs"].items() if pid not in waiting}
        self._write(cluster_name, record)
        return False

    def claim_spare(self, spec: ExperimentSpec) -> str | None:
        """Takes the warm stack's spare cluster if it has the spec's shape; returns its new name, or None.

        The claim makes this process the cluster's owner first (the owner file), then renames it away from the
        spare's name: a claimer killed in between leaves a cluster owned by a dead process, which stops itself.
        The lock makes two runs that claim at once take at most one spare each. A spare started in another
        environment than this process's cold cluster would get (early_job.cluster_environment_digest, the run's
        credentials aside: they reach its workers from the run) is not claimed: its workers would see the values of
        the shell that left the stack, not the run's."""
        if not self.root.exists():
            return None
        lock = os.open(self.root, os.O_RDONLY)  # the clusters' folder itself: released on close, or with the process
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            environment = early_job.cluster_environment_digest(spec.secrets)
            for folder in sorted(self.root.glob(f"{SPARE_PREFIX}*")):
                record = self.record(folder.name)
                if (
                    record
                    and record.get("offered")
                    and record.get("shape") == shape_of(spec)
                    and record.get("environment") == environment
                    and session_alive(record["session"])
                ):
                    write_atomically(Path(record["temp_dir"]) / OWNER_FILE, str(os.getpid()))
                    self._write(folder.name, {**record, "owner": os.getpid()})
                    name = f"{CLUSTER_PREFIX}warm-{uuid.uuid4().hex[:12]}"
                    folder.rename(self.root / name)
                    return name
        finally:
            os.close(lock)
        return None

    def _adopt_warm(self, spec: ExperimentSpec, cluster_name: str) -> bool:
        warm = PREWARMED.pop() if PREWARMED else None
        record = self.record(warm) if warm else None
        if not record or record.get("shape") != shape_of(spec) or not session_alive(record["session"]):
            return False
        (self.root / warm).rename(self.root / cluster_name)  # the rename is the claim: one adopter only
        return True

    def _running(self, pid: str, job: dict) -> bool:
        """A job process of ours has not exited (a child of ours that exited is a zombie until reaped: not running);
        another process's, by its recorded start (its pid may be another process's since)."""
        if pid in self._children:
            return self._children[pid].poll() is None
        return still_the_process(int(pid), job["started"]) if job.get("started") else alive(int(pid))


def shape_of(spec: ExperimentSpec) -> dict:
    """What a local cluster for the spec is made of: its nodes and each node's logical CPUs."""
    cpus = spec.compute.workers_per_node * spec.compute.cpus_per_worker
    if spec.data is not None:  # Ray Data's read tasks need a logical CPU the training workers have not taken
        cpus += 1
    return {"num_nodes": spec.compute.num_nodes, "cpus": cpus, "worker_slots": spec.compute.workers_per_node}
