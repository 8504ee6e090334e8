"""The local backend: a real Ray cluster on this machine (a head plus one Ray node per extra num_nodes), on 127.0.0.1.

Every process it starts runs in a session of its own, recorded under .gpuflow/clusters/<name>/, so that
`down(name)` from any process (a cancel hook, the reaper) can find and stop all of them. The cluster watches
the process that launched it (the flow) and goes away within seconds of its death: see supervisor.py. A cluster
started before its run (or the warm stack's spare) is warm.py's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpuflow.cluster.backends.base import ClusterHandle, ClusterStatus, Job, LineReader
from gpuflow.cluster.backends.local import early_job
from gpuflow.cluster.backends.local.early_job import cluster_environment_digest, ray_env
from gpuflow.cluster.backends.local.warm import PREWARMED, WarmClusters, shape_of
from gpuflow.cluster.config import state_dir
from gpuflow.cluster.protocol import JobEnv
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.util.files import write_atomically
from gpuflow.cluster.util.processes import alive, ours, session_alive, session_members, started_at, stop_sessions

log = logging.getLogger(__name__)

LAUNCH_TIMEOUT_S = 120
RECORD_S = 30.0  # a cluster's folder gets its record at once: one without it for longer lost its launcher
NODES_FILE = "nodes.json"  # in the cluster's temp dir: each node's raylet pid and Ray node id, head first (for tests)
LOST_FILE = "lost"  # in the cluster's temp dir: written by the supervisor once a node is gone
CHILDREN: dict[str, subprocess.Popen] = {}  # this process's children, ours to reap (the CLI starts some, the flow more)


class LocalBackend(WarmClusters):
    name = "local"
    loss_poll_s = 1.0  # `lost` reads a file: the flow may ask every second
    starts_job_at_launch = False  # `exec` starts it: a process, at once

    def __init__(self, root: Path | None = None):
        self.root = root or state_dir() / "clusters"
        self._children = CHILDREN

    # -- launch -----------------------------------------------------------------------------------
    def launch(self, spec: ExperimentSpec, cluster_name: str, job: Job | None = None) -> ClusterHandle:
        """Starts the cluster, or returns it if a cluster of that name is already up (SkyPilot's semantics)."""
        record = self.record(cluster_name)
        if not (record and session_alive(record["session"])):
            if not self._adopt_warm(spec, cluster_name):
                self.down(cluster_name)  # a half-made cluster of that name: start clean
                self.start(spec, cluster_name)
        address = self.wait_until_up(cluster_name)
        log.info(f"local Ray cluster {cluster_name}: {spec.compute.num_nodes} node(s) at {address}")
        return ClusterHandle(cluster_name, self.name, address, self.record(cluster_name))

    def start(self, spec: ExperimentSpec, cluster_name: str) -> None:
        """Starts the cluster's processes and returns at once; `wait_until_up` waits for them."""
        self.start_shaped(shape_of(spec), cluster_name, os.getpid())

    def start_shaped(self, shape: dict, cluster_name: str, owner_pid: int) -> None:
        """Starts a cluster of `shape` (shape_of) that stops itself once `owner_pid` is gone."""
        folder = self.root / cluster_name
        folder.mkdir(parents=True)
        # Unix socket paths are limited to 107 bytes: Ray's temp dir must be short.
        temp_dir = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")
        with open(folder / "ray.log", "wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuflow.cluster.backends.local.supervisor",
                    "--nodes",
                    str(shape["num_nodes"]),
                    "--cpus-per-node",
                    str(shape["cpus"]),
                    "--temp-dir",
                    temp_dir,
                    "--address-file",
                    f"{temp_dir}/address",
                    "--owner-pid",
                    str(owner_pid),
                    "--worker-slots",
                    str(shape.get("worker_slots", 0)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=ray_env(),
            )
        self._children[f"cluster:{process.pid}"] = process
        self._write(
            cluster_name,
            {
                "session": process.pid,
                "session_started": started_at(process.pid),  # a pid alone is reused once its process is gone
                "temp_dir": temp_dir,
                "launched_at": time.time(),
                "jobs": {},
                "shape": shape,
                "owner": owner_pid,
                "environment": cluster_environment_digest(),  # what its Ray processes, and workers, run with
            },
        )

    def wait_until_up(self, cluster_name: str) -> str:
        record = self.record(cluster_name)
        address_file = Path(record["temp_dir"]) / "address"
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not address_file.exists():
            if not session_alive(record["session"]) or time.monotonic() > deadline:
                log = self.root / cluster_name / "ray.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                self.down(cluster_name)
                raise RuntimeError(f"local Ray cluster {cluster_name} did not start:\n{tail}")
            time.sleep(0.05)
        record["address"] = address_file.read_text().strip()
        self._write(cluster_name, record)
        return record["address"]

    # -- run the job ------------------------------------------------------------------------------
    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str:
        """Starts cluster/job/__main__.py against the cluster as a process of its own, as on a remote head node; or
        hands the run to the job process already waiting there (`prewarm`)."""
        folder = self.root / handle.name
        spec_file = folder / f"{run_name}.spec.json"
        spec_file.write_text(spec.anchored().model_dump_json())  # the job's folder is not the flow's
        record = self.record(handle.name)
        waiting = [pid for pid, job in record["jobs"].items() if job["run_name"] is None and self._running(pid, job)]
        if waiting:
            [pid] = waiting
            record["jobs"][pid] = {**record["jobs"][pid], "log": str(folder / "job.log"), "run_name": run_name}
            self._write(handle.name, record)
            early_job.hand_over(
                record["temp_dir"],
                {
                    "spec": str(spec_file),
                    "address": handle.address,
                    "run_name": run_name,
                    "cwd": str(Path(spec.workdir).absolute()),
                    "env": {**env, **JobEnv(local_cluster_session=record["session"]).to_env()},
                },
            )
            return pid
        log = folder / f"{run_name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    "-m",
                    "gpuflow.cluster.job",
                    "--spec",
                    str(spec_file),
                    "--address",
                    handle.address,
                    "--run-name",
                    run_name,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=spec.workdir,
                env={**ray_env(), **env, **JobEnv(local_cluster_session=record["session"]).to_env()},
            )
        record["jobs"][str(process.pid)] = {"log": str(log), "run_name": run_name, "started": started_at(process.pid)}
        self._write(handle.name, record)
        self._children[str(process.pid)] = process
        return str(process.pid)

    def tail_logs(self, handle: ClusterHandle, job_id: str, read: LineReader) -> int:
        """Follows the job's log until it exits; returns its exit code."""
        record = self.record(handle.name) or {}
        log = Path(record.get("jobs", {}).get(job_id, {}).get("log", ""))
        process = self._children.get(job_id)
        position = 0
        buffered = b""
        while True:
            finished = process.poll() is not None if process else not alive(int(job_id))
            if log.is_file():
                with open(log, "rb") as f:
                    f.seek(position)
                    chunk = f.read()
                position += len(chunk)
                *lines, buffered = (buffered + chunk).split(b"\n")
                for line in lines:
                    read(line.decode(errors="replace"))
            elif not finished:
                # the log vanished: the cluster was torn down under us (cancel, watchdog)
                finished = True
            if finished:
                if buffered:
                    read(buffered.decode(errors="replace"))
                return process.wait() if process else early_job.exit_code(record.get("temp_dir", ""), job_id)
            time.sleep(0.1)

    # -- status and teardown ----------------------------------------------------------------------
    def status(self) -> list[ClusterStatus]:
        """Every cluster's state: INIT (starting), UP, GONE (its processes are dead: downed, or killed, its folder
        left), ORPHANED (gone, and so is the process that launched it: a flow that died, the reconciler's to end)."""
        found = []
        for folder in sorted(self.root.glob("*")) if self.root.exists() else []:
            record = self.record(folder.name) or {}
            if not record:  # its launcher writes the record right after the folder: an old folder without one is
                try:  # a launcher killed in between
                    starting = time.time() - folder.stat().st_mtime < RECORD_S
                except FileNotFoundError:  # renamed (a spare claimed) or removed (downed) since the listing
                    continue
                found.append(ClusterStatus(folder.name, self.name, "INIT" if starting else "ORPHANED"))
                continue
            state = "UP" if session_alive(record.get("session", -1)) else "GONE"
            if state == "GONE" and "owner" in record and not alive(record["owner"]):
                state = "ORPHANED"
            found.append(ClusterStatus(folder.name, self.name, state, record.get("launched_at")))
        return found

    def lost(self, cluster_name: str) -> str | None:
        """Why the cluster is no longer whole: a node's processes died (its supervisor noticed), or it is gone."""
        record = self.record(cluster_name)
        if record is None or not session_alive(record["session"]):
            return f"local cluster {cluster_name}: its processes are gone"
        lost_file = Path(record["temp_dir"]) / LOST_FILE
        return f"local cluster {cluster_name}: {lost_file.read_text()}" if lost_file.exists() else None

    def down(self, cluster_name: str) -> bool:
        """Stops every process of the cluster (jobs first), removes its state. Safe to repeat. Raises OSError while
        a process survives or the folder stays: a cluster is down only once nothing of it is left."""
        folder = self.root / cluster_name
        record = self.record(cluster_name)
        if record is not None:
            recorded = [(int(pid), job.get("started")) for pid, job in record.get("jobs", {}).items()]
            recorded.append((record["session"], record.get("session_started")))
            sessions = [session for session, started in recorded if ours(session, started)]
            if survivors := stop_sessions(sessions):
                raise OSError(f"local cluster {cluster_name}: processes {survivors} survive SIGKILL")
            # reap only this cluster's children: this object may also hold other clusters that stay up
            for process in self._children.values():
                if process.pid in sessions and process.poll() is None:
                    process.wait(timeout=5)
            shutil.rmtree(record.get("temp_dir", ""), ignore_errors=True)
        try:
            remove_record_last(folder)
        except OSError as exc:
            raise OSError(f"local cluster {cluster_name}: its folder {folder} could not be removed: {exc}") from exc
        return record is not None

    def pids(self, cluster_name: str) -> set[int]:
        """Every live process of the cluster (for tests and the reaper's report)."""
        record = self.record(cluster_name) or {}
        sessions = [int(pid) for pid in record.get("jobs", {})] + ([record["session"]] if record else [])
        return {pid for session in sessions for pid in session_members(session)}

    def record(self, cluster_name: str) -> dict | None:
        """What this backend keeps of a cluster: its session, temp dir, address, shape and jobs; None if unknown."""
        try:
            return json.loads((self.root / cluster_name / "cluster.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self, cluster_name: str, record: dict) -> None:
        write_atomically(self.root / cluster_name / "cluster.json", json.dumps(record))


def remove_record_last(folder: Path) -> None:
    """Removes a cluster's folder, its record last: a folder that cannot be removed keeps the record that says whose
    cluster it is, to be downed again. Another down of it racing this one (its supervisor, the reaper) is no error."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir(), key=lambda entry: entry.name == "cluster.json"):
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        except FileNotFoundError:
            pass
    try:
        folder.rmdir()
    except FileNotFoundError:
        pass


def drop_prewarmed() -> None:
    """Downs the cluster `prewarm` started for this process's next launch, if any: a run that must wait (for the GPU
    quota) holds nothing meanwhile, and its launch starts a cluster once its turn comes."""
    while PREWARMED:
        LocalBackend().down(PREWARMED.pop())
