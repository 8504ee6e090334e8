"""The SkyPilot backend: a GPU cluster on any cloud SkyPilot supports, launched with autodown as a backstop.

One SkyPilot job does the whole run, started by the launch itself: each node runs `setup` in the synced workdir (by
default this very gpuflow, from a wheel in a file mount, then the workdir's own install), then
`python -m gpuflow.cluster.backends.skypilot.node`: one Ray cluster over the nodes, the Ray Train job on rank 0. So
the flow stages the data and opens the MLflow run before it launches. Whether a cluster is still whole is a forced
status refresh: SkyPilot's cache keeps calling a preempted cluster UP. A cancel mid-launch cancels the launch
request on SkyPilot's API server first, or the launch would bring the cluster back; a failed setup, which SkyPilot
leaves UP on purpose, is downed like any other. The spec → sky.Task mapping is plain functions (`build_task`,
`resources_for`); every SDK call goes through `self.sky`, the one boundary a test double may replace.
"""

from __future__ import annotations

import io
import logging
import os
import secrets
import time

from gpuflow.cluster.backends.base import ClusterHandle, ClusterStatus, Job, LineReader
from gpuflow.cluster.backends.skypilot.options import launched_facts, no_capacity, resources_for
from gpuflow.cluster.protocol import JobEnv, split_secrets
from gpuflow.cluster.spec import ExperimentSpec, job_secrets

log = logging.getLogger(__name__)

RUN = "python -m gpuflow.cluster.backends.skypilot.node"  # the whole job, see cluster/backends/skypilot/node.py
# gpuflow need not be on any package index: the client's own version travels as a wheel in a file mount.
WHEEL_MOUNT = "~/.gpuflow/wheel"
# The wheel first (its dependencies come from the index), then the workdir if it is a project of its own
# (this repo, or a user's project with a pyproject.toml/setup.py), else its requirements.txt if any.
DEFAULT_SETUP = (
    f"python -m pip install {WHEEL_MOUNT}/{{wheel}} && "
    "if [ -f pyproject.toml ] || [ -f setup.py ]; then python -m pip install -e .; "
    "elif [ -f requirements.txt ]; then python -m pip install -r requirements.txt; fi"
)


def default_setup() -> tuple[str, dict[str, str]]:
    """The setup that installs this machine's gpuflow on a node, and the file mount that carries its wheel."""
    from gpuflow.cluster.backends.skypilot.wheel import build_wheel
    from gpuflow.cluster.config import state_dir

    wheel = build_wheel(state_dir() / "wheel")
    return DEFAULT_SETUP.format(wheel=wheel.name), {WHEEL_MOUNT: str(wheel.parent)}


def job_envs(spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> dict[str, str]:
    return {**spec.envs, **env, **JobEnv(spec_json=spec.model_dump_json(), run_name=run_name).to_env()}


def build_task(
    spec: ExperimentSpec,
    *,
    run_name: str | None = None,
    env: dict[str, str] | None = None,
    with_setup: bool = True,
    with_run: bool = True,
):
    """The sky.Task of an experiment: setup installs the project, run starts Ray and the job on rank 0."""
    import sky

    setup, file_mounts = None, None
    public, hidden = split_secrets(env or {})
    if with_setup:
        setup, file_mounts = (spec.setup, None) if spec.setup else default_setup()  # a user's setup replaces ours
    task = sky.Task(
        name=spec.name,
        workdir=os.path.abspath(spec.workdir),
        num_nodes=spec.compute.num_nodes,
        setup=setup,
        file_mounts=file_mounts,
        run=RUN if with_run else None,
        envs=job_envs(spec, run_name or "<flow run name>", public) if with_run else dict(spec.envs),
        # Values come from this machine's environment and never appear in logs, MLflow or `gpuflow plan`.
        secrets={**{name: os.environ.get(name, "") for name in job_secrets(spec)}, **hidden} or None,
    )
    task.set_resources(resources_for(spec))
    return task


def with_ray_token(task):
    """One token per job for our Ray cluster (Ray 2.60 wants token auth); every node gets it, no log shows it."""
    task.update_secrets({"RAY_AUTH_TOKEN": secrets.token_hex(32)})
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

    def __init__(self, read: LineReader):
        self.read, self.buffer = read, ""

    def write(self, text: str) -> int:
        *lines, self.buffer = (self.buffer + text).split("\n")
        for line in lines:
            self.read(line.rstrip("\r"))
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.read(self.buffer)
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


def launched_hourly_usd(handle) -> float | None:
    """What the launched cluster costs per hour (all nodes), from the handle `sky.launch` returns; None if unknown."""
    try:
        return handle.launched_resources.get_cost(3600) * handle.launched_nodes
    except Exception:  # no handle (a cluster that was already up), or a cloud without prices (Slurm, Kubernetes)
        return None


def local_api_server_up(sdk) -> bool | None:
    """Whether SkyPilot's local API server is running; None when the SDK talks to a remote one (not ours to stop)."""
    try:
        from sky.server import common
    except ImportError:  # a double of the SDK: nothing to start or stop
        return None
    if getattr(sdk, "api_stop", None) is None or not common.is_api_server_local():
        return None
    return common.get_api_server_status().status == common.ApiServerStatus.HEALTHY


class SkyPilotBackend:
    name = "skypilot"
    loss_poll_s = None  # `lost` asks the cloud; a lost node ends the SkyPilot job anyway, so ask only then
    starts_job_at_launch = True

    def __init__(self, sdk=None):
        self.sky = sdk or load_sdk()
        self._api_was_up: bool | None = None  # the local API server, before our first call started it

    def close(self) -> None:
        """Stops the local SkyPilot API server if our calls started it (the reaper leaves nothing running)."""
        if self._api_was_up is False:
            self.sky.api_stop()

    def _wait(self, request_id, shown: bool = True):
        """Streams a request to completion (its lines to the log, where `shown`); if we are interrupted, the request
        is cancelled on the server too."""
        stream = LineWriter(log.info if shown else lambda line: None)
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

    def launch(self, spec: ExperimentSpec, cluster_name: str, job: Job | None = None) -> ClusterHandle:
        """Provisions, then runs setup and the job as one SkyPilot job; autostop + down=True make the cluster
        delete itself if we die. Without a job, runs setup alone and waits for it."""
        started = time.time()
        task = (
            with_ray_token(build_task(spec, run_name=job.run_name, env=job.env))
            if job
            else build_task(spec, with_run=False)
        )
        request_id = self.sky.launch(
            task, cluster_name=cluster_name, idle_minutes_to_autostop=spec.limits.idle_minutes_to_autostop, down=True
        )
        try:
            job_id, launched = self._wait(request_id)
        except self.sky.exceptions.ResourcesUnavailableError as exc:  # SkyPilot tried every option
            raise no_capacity(spec, exc) from exc
        info = {
            "request_id": str(request_id),
            "hourly_cost_usd": launched_hourly_usd(launched),
            **launched_facts(spec, getattr(launched, "launched_resources", None)),
        }
        if job is not None:
            # One job, not a setup job then a training job: `exec` would add a request and a job start (~18 s).
            log.info(
                f"[gpuflow] provisioned {cluster_name} in {time.time() - started:.1f}s; "
                f"setup and training run as SkyPilot job {job_id}"
            )
            info["job_id"] = str(job_id)
        elif job_id is not None:
            # SkyPilot 0.14 runs setup detached, as a job of its own, and returns before it ends:
            # wait for it here so that its log is shown and a broken setup fails the launch.
            log.info(
                f"[gpuflow] provisioned {cluster_name} in {time.time() - started:.1f}s; "
                f"setup runs as SkyPilot job {job_id}"
            )
            setup_started = time.time()
            code = self._follow(cluster_name, job_id, log.info)
            if code != 0:
                raise self.sky.exceptions.CommandError(
                    code,
                    "setup",
                    f"setup on {cluster_name} failed ({job_outcome(code)}); its log is above",
                    f"SkyPilot job {job_id} ran the task's setup",
                )
            log.info(f"[gpuflow] setup finished in {time.time() - setup_started:.1f}s")
        return ClusterHandle(cluster_name, self.name, info=info)

    def exec(self, handle: ClusterHandle, spec: ExperimentSpec, run_name: str, env: dict[str, str]) -> str:
        """The job the launch started, else a new one on the cluster."""
        if handle.info.get("job_id"):
            return handle.info.pop("job_id")
        task = with_ray_token(build_task(spec, run_name=run_name, env=env, with_setup=False))
        job_id, _ = self._wait(self.sky.exec(task, cluster_name=handle.name), shown=False)
        return str(job_id)

    def tail_logs(self, handle: ClusterHandle, job_id: str, read: LineReader) -> int:
        """Follows the job's log; returns 0 when the job SUCCEEDED, SkyPilot's non-zero job exit code otherwise."""
        code = self._follow(handle.name, int(job_id), read)
        outcome = job_outcome(code)
        if code == self.sky.exceptions.JobExitCode.FAILED and self._setup_failed(handle.name, int(job_id)):
            outcome = f"setup on {handle.name} failed (FAILED_SETUP); its log is above"
        read(f"[gpuflow] SkyPilot job {job_id} on {handle.name}: {outcome}")
        return code

    def _setup_failed(self, cluster_name: str, job_id: int) -> bool:
        """Whether a failed job failed in its setup: tail_logs' exit code says FAILED either way."""
        try:
            status = self.sky.get(self.sky.job_status(cluster_name, [job_id])).get(job_id)
        except Exception:  # the cluster is gone: the job did not fail in its setup alone
            return False
        return getattr(status, "value", str(status)) == "FAILED_SETUP"

    def _follow(self, cluster_name: str, job_id: int, read: LineReader) -> int:
        # tail_logs' return code is the job's outcome (sky.exceptions.JobExitCode): no job_status round trip
        stream = LineWriter(read)
        try:
            return self.sky.tail_logs(cluster_name, job_id, follow=True, output_stream=stream)
        finally:
            stream.flush()

    def status(self) -> list[ClusterStatus]:
        if self._api_was_up is None:
            self._api_was_up = local_api_server_up(self.sky)
        records = self.sky.get(self.sky.status())
        return [
            ClusterStatus(r["name"], self.name, getattr(r["status"], "value", str(r["status"])), r.get("launched_at"))
            for r in records
        ]

    def lost(self, cluster_name: str) -> str | None:
        """Asks the cloud, not SkyPilot's cache: without a forced refresh a preempted cluster still reads UP."""
        records = self.sky.get(self.sky.status(cluster_names=[cluster_name], refresh=self.sky.StatusRefreshMode.FORCE))
        if not records:
            return f"cluster {cluster_name} is gone (preempted or its allocation lost)"
        status = getattr(records[0]["status"], "value", str(records[0]["status"]))
        return None if status == "UP" else f"cluster {cluster_name} is {status}: some of its nodes are gone"

    def cancel_requests(self, cluster_name: str) -> list[str]:
        """Cancels the cluster's requests still running on the API server (a launch in flight, say):
        they keep running there when their client goes away, and would bring a downed cluster back."""
        pending = [
            r.request_id
            for r in self.sky.api_status(cluster_name=cluster_name)
            if not str(getattr(r, "name", "")).endswith("down")
        ]
        if pending:
            self.sky.get(self.sky.api_cancel(pending, silent=True))
        return pending

    def down(self, cluster_name: str) -> bool:
        """Cancels what is in flight for the cluster, then deletes it; False when there was nothing to delete."""
        self.cancel_requests(cluster_name)
        try:
            self._wait(self.sky.down(cluster_name), shown=False)
            return True
        except self.sky.exceptions.ClusterDoesNotExist:
            return False
