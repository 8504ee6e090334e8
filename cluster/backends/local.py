"""The local backend: a real Ray cluster on this machine (a head plus one Ray node per extra num_nodes), on 127.0.0.1.

Every process it starts runs in a process group of its own, recorded under .gpuflow/clusters/<name>/,
so that `down(name)` from any process (a cancel hook, the reaper) can find and stop all of them.
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
from pathlib import Path
from typing import Callable

from cluster.backends import ClusterHandle, ClusterStatus
from cluster.spec import ExperimentSpec, state_dir

LAUNCH_TIMEOUT_S = 120
STOP_GRACE_S = 2.0


class LocalBackend:
    name = "local"

    def __init__(self, root: Path | None = None):
        self.root = root or state_dir() / "clusters"

    # -- launch -----------------------------------------------------------------------------------
    def launch(self, spec: ExperimentSpec, cluster_name: str) -> ClusterHandle:
        """Starts the cluster, or returns it if a cluster of that name is already up (SkyPilot's semantics)."""
        folder = self.root / cluster_name
        record = self._record(cluster_name)
        if record and group_alive(record["pgid"]) and record.get("address"):
            return ClusterHandle(cluster_name, self.name, record["address"], record)
        self.down(cluster_name)  # a half-made cluster of that name: start clean
        folder.mkdir(parents=True)
        # Unix socket paths are limited to 107 bytes: Ray's temp dir must be short.
        temp_dir = tempfile.mkdtemp(prefix=f"gf-{cluster_name[-8:]}-", dir="/tmp")
        address_file = folder / "address"
        log = open(folder / "ray.log", "wb")
        cpus = spec.compute.workers_per_node * spec.compute.cpus_per_worker
        process = subprocess.Popen(
            [sys.executable, "-m", "cluster.backends.local_ray", "--nodes", str(spec.compute.num_nodes),
             "--cpus-per-node", str(cpus), "--temp-dir", temp_dir, "--address-file", str(address_file)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ray_env(),
        )
        self._children = {**getattr(self, "_children", {}), f"cluster:{cluster_name}": process}
        record = {"pgid": process.pid, "temp_dir": temp_dir, "launched_at": time.time(), "jobs": {},
                  "num_nodes": spec.compute.num_nodes}
        self._write(cluster_name, record)
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not address_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                self.down(cluster_name)
                tail = (folder / "ray.log").read_text()[-2000:] if folder.exists() else ""
                raise RuntimeError(f"local Ray cluster {cluster_name} did not start:\n{tail}")
            time.sleep(0.05)
        record["address"] = address_file.read_text().strip()
        self._write(cluster_name, record)
        return ClusterHandle(cluster_name, self.name, record["address"], record)

    # -- run the job ------------------------------------------------------------------------------
    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str:
        """Starts cluster/job.py against the cluster as a process of its own, as on a remote head node."""
        folder = self.root / handle.name
        spec_file = folder / f"{run_name}.spec.json"
        spec_file.write_text(spec.model_dump_json())
        log = folder / f"{run_name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-u", "-m", "cluster.job", "--spec", str(spec_file),
                 "--address", handle.address, "--run-name", run_name],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=spec.workdir,
                env={**ray_env(), **env},
            )
        record = self._record(handle.name)
        record["jobs"][str(process.pid)] = {"log": str(log), "run_name": run_name}
        self._write(handle.name, record)
        self._children = getattr(self, "_children", {})
        self._children[str(process.pid)] = process
        return str(process.pid)

    def tail_logs(self, handle: ClusterHandle, job_id: str, on_line: Callable[[str], None]) -> int:
        """Follows the job's log until it exits; returns its exit code."""
        record = self._record(handle.name) or {}
        log = Path(record.get("jobs", {}).get(job_id, {}).get("log", ""))
        process = getattr(self, "_children", {}).get(job_id)
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
            up = bool(record) and group_alive(record.get("pgid", -1))
            found.append(ClusterStatus(folder.name, self.name, "UP" if up else "INIT", record.get("launched_at")))
        return found

    def down(self, cluster_name: str) -> bool:
        """Stops every process of the cluster (jobs first), removes its state. Safe to repeat."""
        folder = self.root / cluster_name
        record = self._record(cluster_name)
        if record is None:
            if folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            return False
        groups = [int(pid) for pid in record.get("jobs", {})] + [record["pgid"]]
        stop_groups(groups)
        # reap only this cluster's children: this object may also hold other clusters that stay up
        for process in getattr(self, "_children", {}).values():
            if process.pid in groups and process.poll() is None:
                process.wait(timeout=5)
        shutil.rmtree(record.get("temp_dir", ""), ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        return True

    def pids(self, cluster_name: str) -> set[int]:
        """Every live process of the cluster (for tests and the reaper's report)."""
        record = self._record(cluster_name) or {}
        groups = [int(pid) for pid in record.get("jobs", {})] + ([record["pgid"]] if record else [])
        return {pid for group in groups for pid in group_members(group)}

    def _record(self, cluster_name: str) -> dict | None:
        try:
            return json.loads((self.root / cluster_name / "cluster.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self, cluster_name: str, record: dict) -> None:
        path = self.root / cluster_name / "cluster.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        os.replace(path.with_suffix(".tmp"), path)


def ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nodes and drivers on 127.0.0.1 (see library facts)
    env.pop("RAY_ADDRESS", None)  # never attach to a cluster we did not start
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def stop_groups(groups: list[int]) -> None:
    """SIGTERM each process group, then SIGKILL what is still there after a short grace."""
    for group in groups:
        signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for group in groups:
        signal_group(group, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)


def signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(group: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def group_alive(group: int) -> bool:
    return bool(group_members(group))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
