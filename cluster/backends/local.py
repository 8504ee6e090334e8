"""The local backend: a real Ray cluster on this machine (a head plus one Ray node per extra num_nodes), on 127.0.0.1.

Every process it starts runs in a session of its own, recorded under .gpuflow/clusters/<name>/, so that
`down(name)` from any process (a cancel hook, the reaper) can find and stop all of them. The cluster watches
the process that launched it (the flow) and goes away within seconds of its death: see local_ray.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from gpuflow.cluster.backends import CLUSTER_PREFIX, ClusterHandle, ClusterStatus, Job
from gpuflow.cluster.guard import LOCAL_CLUSTER_ENV
from gpuflow.cluster.spec import ExperimentSpec, state_dir

LAUNCH_TIMEOUT_S = 120
NODES_FILE = "nodes.json"  # in the cluster's temp dir: each node's raylet pid, head first (what a test kills)
LOST_FILE = "lost"  # in the cluster's temp dir: written by the supervisor once a node is gone
WARM_CLUSTER_ENV = "GPUFLOW_WARM_CLUSTER"


class LocalBackend:
    name = "local"
    loss_poll_s = 1.0  # `lost` reads a file: the flow may ask every second
    starts_job_at_launch = False  # `exec` starts it: a process, at once

    def __init__(self, root: Path | None = None):
        self.root = root or state_dir() / "clusters"
        self._children: dict[str, subprocess.Popen] = {}  # ours to reap

    # -- launch -----------------------------------------------------------------------------------
    def launch(self, spec: ExperimentSpec, cluster_name: str, on_line: Callable[[str], None] = print,
               job: Job | None = None) -> ClusterHandle:
        """Starts the cluster, or returns it if a cluster of that name is already up (SkyPilot's semantics)."""
        record = self._record(cluster_name)
        if not (record and session_alive(record["session"])):
            if not self._adopt_warm(spec, cluster_name):
                self.down(cluster_name)  # a half-made cluster of that name: start clean
                self.start(spec, cluster_name)
        address = self.wait_until_up(cluster_name)
        on_line(f"local Ray cluster {cluster_name}: {spec.compute.num_nodes} node(s) at {address}")
        return ClusterHandle(cluster_name, self.name, address, self._record(cluster_name))

    def start(self, spec: ExperimentSpec, cluster_name: str) -> None:
        """Starts the cluster's processes and returns at once; `wait_until_up` waits for them."""
        folder = self.root / cluster_name
        folder.mkdir(parents=True)
        # Unix socket paths are limited to 107 bytes: Ray's temp dir must be short.
        temp_dir = tempfile.mkdtemp(prefix="gf-ray-", dir="/tmp")
        cpus = spec.compute.workers_per_node * spec.compute.cpus_per_worker
        if spec.data is not None:  # Ray Data's read tasks need a logical CPU the training workers have not taken
            cpus += 1
        with open(folder / "ray.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "gpuflow.cluster.backends.local_ray", "--nodes", str(spec.compute.num_nodes),
                 "--cpus-per-node", str(cpus), "--temp-dir", temp_dir, "--address-file", f"{temp_dir}/address",
                 "--owner-pid", str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ray_env(),
            )
        self._children[f"cluster:{process.pid}"] = process
        self._write(cluster_name, {"session": process.pid, "temp_dir": temp_dir, "launched_at": time.time(),
                                   "jobs": {}, "shape": shape_of(spec)})

    def wait_until_up(self, cluster_name: str) -> str:
        record = self._record(cluster_name)
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

    def prewarm(self, spec: ExperimentSpec) -> str:
        """Starts a cluster for a flow run that has no id yet; `launch` adopts it when the shape matches.

        `gpuflow run` starts one while Prefect's API starts, so the two start side by side."""
        name = f"{CLUSTER_PREFIX}warm-{uuid.uuid4().hex[:12]}"
        self.start(spec, name)
        os.environ[WARM_CLUSTER_ENV] = name
        return name

    def _adopt_warm(self, spec: ExperimentSpec, cluster_name: str) -> bool:
        warm = os.environ.pop(WARM_CLUSTER_ENV, None)
        record = self._record(warm) if warm else None
        if not record or record.get("shape") != shape_of(spec) or not session_alive(record["session"]):
            return False
        (self.root / warm).rename(self.root / cluster_name)  # the rename is the claim: one adopter only
        return True

    # -- run the job ------------------------------------------------------------------------------
    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str:
        """Starts cluster/job.py against the cluster as a process of its own, as on a remote head node."""
        folder = self.root / handle.name
        spec_file = folder / f"{run_name}.spec.json"
        spec_file.write_text(spec.model_dump_json())
        log = folder / f"{run_name}.log"
        record = self._record(handle.name)
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-u", "-m", "gpuflow.cluster.job", "--spec", str(spec_file),
                 "--address", handle.address, "--run-name", run_name],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=spec.workdir,
                env={**ray_env(), **env, LOCAL_CLUSTER_ENV: str(record["session"])},
            )
        record["jobs"][str(process.pid)] = {"log": str(log), "run_name": run_name}
        self._write(handle.name, record)
        self._children[str(process.pid)] = process
        return str(process.pid)

    def tail_logs(self, handle: ClusterHandle, job_id: str, on_line: Callable[[str], None]) -> int:
        """Follows the job's log until it exits; returns its exit code."""
        record = self._record(handle.name) or {}
        log = Path(record.get("jobs", {}).get(job_id, {}).get("log", ""))
        process = self._children.get(job_id)
        position = 0
        buffered = b""
        while True:
            finished = process.poll() is not None if process else not pid_alive(int(job_id))
            if log.is_file():
                with open(log, "rb") as f:
                    f.seek(position)
                    chunk = f.read()
                position += len(chunk)
                *lines, buffered = (buffered + chunk).split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace"))
            elif not finished:
                # the log vanished: the cluster was torn down under us (cancel, watchdog)
                finished = True
            if finished:
                if buffered:
                    on_line(buffered.decode(errors="replace"))
                return process.wait() if process else -signal.SIGKILL
            time.sleep(0.1)

    # -- status and teardown ----------------------------------------------------------------------
    def status(self) -> list[ClusterStatus]:
        found = []
        for folder in sorted(self.root.glob("*")) if self.root.exists() else []:
            record = self._record(folder.name) or {}
            up = bool(record) and session_alive(record.get("session", -1))
            found.append(ClusterStatus(folder.name, self.name, "UP" if up else "INIT", record.get("launched_at")))
        return found

    def lost(self, cluster_name: str) -> str | None:
        """Why the cluster is no longer whole: a node's processes died (its supervisor noticed), or it is gone."""
        record = self._record(cluster_name)
        if record is None or not session_alive(record["session"]):
            return f"local cluster {cluster_name}: its processes are gone"
        lost_file = Path(record["temp_dir"]) / LOST_FILE
        return f"local cluster {cluster_name}: {lost_file.read_text()}" if lost_file.exists() else None

    def down(self, cluster_name: str) -> bool:
        """Stops every process of the cluster (jobs first), removes its state. Safe to repeat."""
        folder = self.root / cluster_name
        record = self._record(cluster_name)
        if record is None:
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            return False
        sessions = [int(pid) for pid in record.get("jobs", {})] + [record["session"]]
        stop_sessions(sessions)
        # reap only this cluster's children: this object may also hold other clusters that stay up
        for process in self._children.values():
            if process.pid in sessions and process.poll() is None:
                process.wait(timeout=5)
        shutil.rmtree(record.get("temp_dir", ""), ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        return True

    def pids(self, cluster_name: str) -> set[int]:
        """Every live process of the cluster (for tests and the reaper's report)."""
        record = self._record(cluster_name) or {}
        sessions = [int(pid) for pid in record.get("jobs", {})] + ([record["session"]] if record else [])
        return {pid for session in sessions for pid in session_members(session)}

    def _record(self, cluster_name: str) -> dict | None:
        try:
            return json.loads((self.root / cluster_name / "cluster.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self, cluster_name: str, record: dict) -> None:
        path = self.root / cluster_name / "cluster.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        os.replace(path.with_suffix(".tmp"), path)


def shape_of(spec: ExperimentSpec) -> dict:
    return {"num_nodes": spec.compute.num_nodes, "cpus": spec.compute.workers_per_node * spec.compute.cpus_per_worker}


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nodes and drivers on 127.0.0.1 (see library facts)
    env.pop("RAY_ADDRESS", None)  # never attach to a cluster we did not start
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def stop_sessions(sessions: list[int]) -> None:
    """SIGKILLs every process of each session and waits until they are gone.

    Sessions, not process groups: Ray puts each worker in a process group of its own, but all
    stay in the session we started. Nothing in a throwaway local cluster needs a graceful stop:
    checkpoints and metrics are persisted before teardown, and Ray's own shutdown takes seconds."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        members = [pid for session in sessions for pid in session_members(session)]
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes of a session: the supervisor or job we started and all they started."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def session_alive(session: int) -> bool:
    return bool(session_members(session))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
