"""The SkyPilot backend: a GPU cluster on any cloud SkyPilot supports, launched with autodown as a backstop.

The spec → sky.Task mapping is plain functions (`build_task`, `resources_for`), unit-tested offline.
Every SDK call goes through `self.sky` (the `sky` module), the one boundary a test double may replace.
"""

from __future__ import annotations

import io
import secrets
import time
from typing import Callable

from cluster.backends import ClusterHandle, ClusterStatus
from cluster.spec import ExperimentSpec, job_secrets

RUN = "python -m cluster.node"  # the whole job, see cluster/node.py
DEFAULT_SETUP = "python -m pip install -e ."  # the synced workdir is a project that depends on gpuflow


def resources_for(spec: ExperimentSpec) -> list:
    """One sky.Resources per acceptable accelerator, in order of preference."""
    import sky

    compute = spec.compute
    accelerators = compute.accelerators if isinstance(compute.accelerators, list) else [compute.accelerators]
    return [
        sky.Resources(
            infra=compute.infra, cloud=sky.CLOUD_REGISTRY.from_str(compute.cloud) if compute.cloud else None,
            region=compute.region, accelerators=accelerator, use_spot=compute.use_spot,
            cpus=f"{compute.workers_per_node * compute.cpus_per_worker:g}+", memory=compute.memory_gb_per_node,
            disk_size=compute.disk_size_gb, max_hourly_cost=compute.max_hourly_cost_usd,
            labels={"gpuflow": "true"},
        )
        for accelerator in accelerators
    ]


def job_envs(spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> dict[str, str]:
    return {**spec.envs, **env, "GPUFLOW_SPEC_JSON": spec.model_dump_json(), "GPUFLOW_RUN_NAME": run_name}


def build_task(spec: ExperimentSpec, *, run_name: str | None = None, env: dict[str, str] | None = None,
               with_setup: bool = True, with_run: bool = True):
    """The sky.Task of an experiment: setup installs the project, run starts Ray and the job on rank 0."""
    import os

    import sky

    task = sky.Task(
        name=spec.name,
        workdir=os.path.abspath(spec.workdir),
        num_nodes=spec.compute.num_nodes,
        setup=(spec.setup or DEFAULT_SETUP) if with_setup else None,  # a user's setup replaces ours (own image)
        run=RUN if with_run else None,
        envs=job_envs(spec, run_name or "<flow run name>", env or {}) if with_run else dict(spec.envs),
        # Values come from this machine's environment and never appear in logs, MLflow or `gpuflow plan`.
        secrets={name: os.environ.get(name, "") for name in job_secrets(spec)} or None,
    )
    task.set_resources(resources_for(spec))
    return task


def task_yaml(spec: ExperimentSpec) -> str:
    """What `gpuflow plan` prints: the task SkyPilot would run, secrets redacted."""
    import yaml

    config = build_task(spec).to_yaml_config()
    if config.get("secrets"):
        config["secrets"] = {name: "<redacted>" for name in config["secrets"]}
    return yaml.safe_dump(config, sort_keys=False)


class LineWriter(io.TextIOBase):
    """A text stream that hands each complete line to a callback (SkyPilot streams into file objects)."""

    def __init__(self, on_line: Callable[[str], None]):
        self.on_line, self.buffer = on_line, ""

    def write(self, text: str) -> int:
        *lines, self.buffer = (self.buffer + text).split("\n")
        for line in lines:
            self.on_line(line.rstrip("\r"))
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.on_line(self.buffer)
            self.buffer = ""


def job_outcome(code: int) -> str:
    """SUCCEEDED, FAILED, CANCELLED, ... for a SkyPilot job exit code."""
    import sky.exceptions

    try:
        return sky.exceptions.JobExitCode(code).name
    except ValueError:
        return f"exit code {code}"


def load_sdk():
    """The SkyPilot SDK module: the one boundary tests replace where no cloud can be reached."""
    import sky
    import sky.exceptions  # noqa: F401  (makes sky.exceptions available)

    return sky


class SkyPilotBackend:
    name = "skypilot"

    def __init__(self, sdk=None):
        self.sky = sdk or load_sdk()

    def _wait(self, request_id, on_line: Callable[[str], None] = print):
        """Streams a request to completion; if we are interrupted, the request is cancelled on the server too."""
        stream = LineWriter(on_line)
        try:
            return self.sky.stream_and_get(request_id, output_stream=stream)
        except BaseException:
            try:
                self.sky.api_cancel(request_id, silent=True)
            except Exception:  # the request may have finished meanwhile: nothing left to cancel
                pass
            raise
        finally:
            stream.flush()

    def launch(self, spec: ExperimentSpec, cluster_name: str, on_line: Callable[[str], None] = print) -> ClusterHandle:
        """Provisions and runs setup; autostop + down=True make the cluster delete itself if we die."""
        started = time.time()
        request_id = self.sky.launch(
            build_task(spec, with_run=False), cluster_name=cluster_name,
            idle_minutes_to_autostop=spec.limits.idle_minutes_to_autostop, down=True,
        )
        setup_job_id, _ = self._wait(request_id, on_line)
        if setup_job_id is not None:
            # SkyPilot 0.14 runs setup detached, as a job of its own, and returns before it ends:
            # wait for it here so that its log is shown and a broken setup fails the launch.
            on_line(f"[gpuflow] provisioned {cluster_name} in {time.time() - started:.1f}s; setup runs as SkyPilot job {setup_job_id}")
            setup_started = time.time()
            code = self._follow(cluster_name, setup_job_id, on_line)
            if code != 0:
                raise self.sky.exceptions.CommandError(
                    code, "setup", f"setup on {cluster_name} failed ({job_outcome(code)}); its log is above",
                    f"SkyPilot job {setup_job_id} ran the task's setup")
            on_line(f"[gpuflow] setup finished in {time.time() - setup_started:.1f}s")
        return ClusterHandle(cluster_name, self.name, info={"request_id": str(request_id)})

    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str:
        task = build_task(spec, run_name=run_name, env=env, with_setup=False)
        # One token per job for our Ray cluster (Ray 2.60 wants token auth); every node gets it, no log shows it.
        task.update_secrets({"RAY_AUTH_TOKEN": secrets.token_hex(32)})
        job_id, _ = self._wait(self.sky.exec(task, cluster_name=handle.name), lambda line: None)
        return str(job_id)

    def tail_logs(self, handle: ClusterHandle, job_id: str, on_line: Callable[[str], None]) -> int:
        """Follows the job's log; returns 0 when the job SUCCEEDED, SkyPilot's non-zero job exit code otherwise."""
        code = self._follow(handle.name, int(job_id), on_line)
        on_line(f"[gpuflow] SkyPilot job {job_id} on {handle.name}: {job_outcome(code)}")
        return code

    def _follow(self, cluster_name: str, job_id: int, on_line: Callable[[str], None]) -> int:
        # tail_logs' return code is the job's outcome (sky.exceptions.JobExitCode): no job_status round trip
        stream = LineWriter(on_line)
        try:
            return self.sky.tail_logs(cluster_name, job_id, follow=True, output_stream=stream)
        finally:
            stream.flush()

    def status(self) -> list[ClusterStatus]:
        records = self.sky.get(self.sky.status())
        return [ClusterStatus(r["name"], self.name, getattr(r["status"], "value", str(r["status"])), r.get("launched_at"))
                for r in records]

    def cancel_requests(self, cluster_name: str) -> list[str]:
        """Cancels the cluster's requests still running on the API server (a launch in flight, say):
        they keep running there when their client goes away, and would bring a downed cluster back."""
        pending = [r.request_id for r in self.sky.api_status(cluster_name=cluster_name)
                   if not str(getattr(r, "name", "")).endswith("down")]
        if pending:
            self.sky.get(self.sky.api_cancel(pending, silent=True))
        return pending

    def down(self, cluster_name: str) -> bool:
        """Cancels what is in flight for the cluster, then deletes it; False when there was nothing to delete."""
        self.cancel_requests(cluster_name)
        try:
            self._wait(self.sky.down(cluster_name), lambda line: None)
            return True
        except self.sky.exceptions.ClusterDoesNotExist:
            return False
