"""A stand-in for SkyPilot's SDK where no cloud can be reached: it behaves as SkyPilot 0.14 does.

Calls return request ids; results and errors come out of `stream_and_get`/`get`; a request takes
time and can be cancelled (`api_cancel`) while in flight; `launch` submits setup (and run) as one job and
returns its id at once; a failed setup ends that job FAILED_SETUP and leaves the cluster UP (SkyPilot does
this on purpose, even with down=True); `down` of an unknown cluster raises
ClusterDoesNotExist. Scenarios choose the failure: capacity, setup, job; `down_failures` makes deletions fail,
`down_s` makes them slow.

Capacity as SkyPilot fails over: the task's resources are tried in order (a list; a set cheapest first, here in
its own order), each one `no_capacity` names (an accelerator, an infra's cloud, or "spot") is skipped, and the
first that remains launches (the handle's `launched_resources` says which); when none remains, SkyPilot's
ResourcesUnavailableError, one block per resource tried and its failover_history. `preempt_spot` spot clusters
are preempted mid-job: the cluster vanishes, as a forced status refresh then says. `spot_schedule` scripts spot
capacity over time: each launch that tries spot takes the next entry (True: there is some), the last one holds.
`streamed` spreads the job's log over its time, as a training job prints it (a preempted job's ends at the loss);
otherwise the log comes whole at the job's end. A launch with no job to run sets up for `setup_s` (default: job_s).

The node's side, where it decides: the job first loads the spec it was handed with the job's own loader, and a spec
the node refuses fails the job (FAILED, its traceback in the log) after the launch, as on a real cluster.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

import sky.exceptions
from sky.skylet.job_lib import JobStatus

from gpuflow.cluster.backends.skypilot.options import NO_SPOT
from gpuflow.cluster.protocol import JobEnv
from gpuflow.cluster.spec import job_spec


@dataclass
class Request:
    request_id: str
    name: str
    cluster_name: str
    run: object  # callable(request) -> result, may raise
    duration_s: float
    status: str = "RUNNING"
    result: object = None
    error: BaseException | None = None
    lines: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class FakeSky:
    exceptions = sky.exceptions
    StatusRefreshMode = sky.StatusRefreshMode

    def __init__(
        self,
        scenario: str = "ok",
        launch_s: float = 0.5,
        job_s: float = 0.5,
        job_log: list[str] = (),
        down_failures: int = 0,
        no_capacity=(),
        preempt_spot: int = 0,
        down_s: float = 0.05,
        spot_schedule: list[bool] = (),
        streamed: bool = False,
        setup_s: float | None = None,
    ):
        self.scenario, self.launch_s, self.job_s, self.down_s = scenario, launch_s, job_s, down_s
        self.down_failures = down_failures  # a cloud API that refuses the next N deletions, as in an outage
        self.job_log = list(job_log) or ["[gpuflow] epoch 0: train_loss=1.0 val_accuracy=0.9"]
        self.no_capacity = no_capacity  # words: a resource naming any of them has none (until changed)
        self.preempt_spot = preempt_spot
        self.spot_schedule, self.streamed = list(spot_schedule), streamed
        self.setup_s = job_s if setup_s is None else setup_s  # a launch with no job to run: its setup alone
        self.clusters: dict[str, dict] = {}
        self.requests: dict[str, Request] = {}
        self.calls: list[tuple] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- requests -------------------------------------------------------------------------------
    def _submit(self, name, cluster_name, run, duration_s=0.05) -> str:
        request = Request(f"req-{next(self._ids)}", name, cluster_name, run, duration_s)
        self.requests[request.request_id] = request
        threading.Thread(target=self._execute, args=(request,), daemon=True).start()
        return request.request_id

    def _execute(self, request: Request) -> None:
        deadline = time.monotonic() + request.duration_s
        while time.monotonic() < deadline and request.status == "RUNNING":
            time.sleep(0.01)
        if request.status == "RUNNING":
            try:
                request.result = request.run(request)
                request.status = "SUCCEEDED"
            except BaseException as exc:  # noqa: BLE001  the request carries the error to the client
                request.error, request.status = exc, "FAILED"
        request.done.set()

    def stream_and_get(self, request_id, output_stream=None, **_):
        request = self.requests[request_id]
        request.done.wait()
        for line in request.lines:
            if output_stream is not None:
                output_stream.write(line + "\n")
        return self.get(request_id)

    def get(self, request_id):
        request = self.requests[request_id]
        request.done.wait()
        if request.status == "CANCELLED":
            raise sky.exceptions.RequestCancelled(f"Request {request_id} cancelled")
        if request.error is not None:
            raise request.error
        return request.result

    def api_cancel(self, request_ids, silent=False, **_):
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        cancelled = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request and request.status == "RUNNING":
                request.status = "CANCELLED"
                cancelled.append(request_id)
        self.calls.append(("api_cancel", tuple(cancelled)))
        return self._submit("api_cancel", "", lambda r: cancelled, 0)

    def api_status(self, cluster_name=None, **_):
        return [
            SimpleNamespace(request_id=r.request_id, name=f"sky.{r.name}", status=r.status)
            for r in self.requests.values()
            if r.status == "RUNNING" and r.cluster_name == cluster_name
        ]

    # -- verbs ------------------------------------------------------------------------------------
    def launch(self, task, cluster_name=None, idle_minutes_to_autostop=None, down=False, **_):
        """As SkyPilot 0.14: provisions, then submits setup (and run, if the task has one) as one job and returns its
        id without waiting for it. A failed setup ends that job FAILED_SETUP and leaves the cluster UP."""
        self.calls.append(("launch", cluster_name, idle_minutes_to_autostop, down, task.to_yaml_config()))

        def run(request):
            if self.scenario == "capacity":
                request.lines.append("Failed to acquire resources in all zones")
                raise sky.exceptions.ResourcesUnavailableError(
                    "Failed to provision all possible launchable resources. Relax the task's resource requirements: "
                    f"{task.num_nodes}x {list(task.resources)}"
                )
            launched = self._first_with_capacity(task, request)
            with self._lock:
                self.clusters[cluster_name] = {
                    "name": cluster_name,
                    "status": sky.ClusterStatus.UP,
                    "launched_at": int(time.time()),
                    "autostop": idle_minutes_to_autostop,
                    "to_down": down,
                    "jobs": {},
                    "spot": bool(launched.use_spot),
                }
            request.lines.append(f"Cluster {cluster_name} is up")
            job_id = self._add_job(cluster_name, setup=task.setup is not None, run=task.run and task)
            request.lines.append(f"Job submitted, ID: {job_id}")
            return job_id, SimpleNamespace(
                cluster_name=cluster_name, launched_resources=launched, launched_nodes=task.num_nodes
            )

        return self._submit("launch", cluster_name, run, self.launch_s)

    def _first_with_capacity(self, task, request):
        tried, history = {}, []
        for resources in task.resources:
            if resources.use_spot and str(resources.cloud).lower() in NO_SPOT:
                continue  # the optimizer drops it: never tried, no block
            words = {
                str(resources.cloud).lower(),
                *(k.lower() for k in resources.accelerators or {}),
                *(["spot"] if resources.use_spot else []),
            }
            if not words & {word.lower() for word in self.no_capacity} and self._spot_now(resources):
                return resources
            error = sky.exceptions.ResourcesUnavailableError(
                f"Failed to acquire resources in all zones in {resources.region or 'every region'} for "
                f"{resources.accelerators}. Try changing resource requirements or use another region."
            )
            tried[resources], history = error, [*history, error]
            request.lines.append(f"Failed to provision {resources}: trying other potential resources.")
        blocks = "".join(  # SkyPilot's own layout (cloud_vm_ray_backend._format_provision_failure_blocks): the
            # header names the place and GPUs, never spot; the SDK puts its summary (coloured) in front
            f"\u2717 {r.infra.formatted_str()} \u2014 ("
            f"{''.join(f'gpus={k}:{v}, ' for k, v in (r.accelerators or {}).items())}...)\n  {e}\n\n"
            for r, e in tried.items()
        )
        raise sky.exceptions.ResourcesUnavailableError(
            "\x1b[31mFailed to provision all possible launchable resources.\x1b[0m Relax the task's resource "
            f"requirements: {task.num_nodes}x {list(task.resources)[0]}\n"
            "To keep retrying until the cluster is up, use the `--retry-until-up` flag.\n"
            "Reasons for provision failures (for details, please check the log above):\n"
            f"Provision failures (tried {len(tried)} infra):\n\n{blocks}",
            failover_history=history,
        )

    def _spot_now(self, resources) -> bool:
        if not (resources.use_spot and self.spot_schedule):
            return True
        return self.spot_schedule.pop(0) if len(self.spot_schedule) > 1 else self.spot_schedule[0]

    def exec(self, task, cluster_name=None, **_):
        self.calls.append(("exec", cluster_name, task.to_yaml_config()))

        def run(request):
            return self._add_job(cluster_name, setup=False, run=task), SimpleNamespace(cluster_name=cluster_name)

        return self._submit("exec", cluster_name, run)

    def _add_job(self, cluster_name, setup: bool, run) -> int:
        """`run`: the task whose run the job runs (None: setup only)."""
        jobs = self._cluster(cluster_name)["jobs"]
        job_id = len(jobs) + 1
        log, final = [], JobStatus.SUCCEEDED
        if setup:
            log.append("(setup pid=4242) Installing the project")
            if self.scenario == "setup":
                log.append("(setup pid=4242) ERROR: No matching distribution found for torch==9.9")
                final = JobStatus.FAILED_SETUP
        if run and final == JobStatus.SUCCEEDED:
            refused = node_refusal(run)
            log += refused or self.job_log
            if refused:
                final = JobStatus.FAILED
            elif self.scenario == "job":
                log += ["Traceback (most recent call last):", "RuntimeError: fail_at_epoch=1: failing on purpose"]
                final = JobStatus.FAILED
        duration = self.job_s if run else self.setup_s
        jobs[job_id] = {"status": JobStatus.RUNNING, "finish_at": time.time() + duration, "final": final, "log": log}
        return job_id

    def tail_logs(self, cluster_name, job_id, follow=True, output_stream=None, **_):
        cluster = self._cluster(cluster_name)
        job = cluster["jobs"][job_id]
        end, preempted = job["finish_at"], cluster["spot"] and self.preempt_spot > 0
        if preempted:  # the cloud takes the nodes back mid-job, however late the client follows the job's log
            self.preempt_spot -= 1
            end -= self.job_s / 2
        lines = job["log"]
        if self.streamed:  # line i at i/len of the job's time; a preempted job's log stops at the loss
            began = job["finish_at"] - self.job_s
            for i, line in enumerate(lines):
                at = began + self.job_s * i / len(lines)
                if at >= end:
                    break
                while time.time() < at and cluster_name in self.clusters:
                    time.sleep(0.01)
                if cluster_name not in self.clusters:  # downed mid-job: its log ends there
                    break
                output_stream.write(line + "\n")
            lines = []
        while time.time() < end and cluster_name in self.clusters:
            time.sleep(0.01)
        if preempted:
            self.clusters.pop(cluster_name, None)
        for line in lines:
            output_stream.write(line + "\n")
        job["status"] = job["final"] if cluster_name in self.clusters else JobStatus.FAILED
        return 0 if job["status"] == JobStatus.SUCCEEDED else sky.exceptions.JobExitCode.FAILED.value

    def job_status(self, cluster_name, job_ids=None):
        def run(request):
            jobs = self._cluster(cluster_name)["jobs"]
            return {job_id: jobs[job_id]["status"] for job_id in job_ids}

        return self._submit("job_status", cluster_name, run, 0)

    def status(self, cluster_names=None, **_):
        return self._submit(
            "status",
            "",
            lambda r: [dict(c) for c in self.clusters.values() if cluster_names is None or c["name"] in cluster_names],
            0,
        )

    def down(self, cluster_name, **_):
        self.calls.append(("down", cluster_name))

        def run(request):
            with self._lock:
                if self.down_failures > 0 and cluster_name in self.clusters:
                    self.down_failures -= 1
                    request.lines.append("Failed to terminate instances: RequestLimitExceeded")
                    raise RuntimeError(
                        f"Failed to terminate the cluster {cluster_name}: RequestLimitExceeded "
                        "(the cloud's API refused the deletion; try again later)"
                    )
                if self.clusters.pop(cluster_name, None) is None:
                    raise sky.exceptions.ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")

        return self._submit("down", cluster_name, run, self.down_s)  # the cluster is listed until its deletion ends

    def _cluster(self, cluster_name):
        if cluster_name not in self.clusters:
            raise sky.exceptions.ClusterNotUpError(f"Cluster {cluster_name!r} is not up.", cluster_status=None)
        return self.clusters[cluster_name]


def node_refusal(task) -> list[str]:
    """The traceback the node's job prints when the spec it was handed does not load (cluster/job/__main__.py)."""
    spec_json = JobEnv.from_env(task.envs).spec_json
    try:
        job_spec(spec_json).anchored()
    except Exception:  # noqa: BLE001  whatever the node would raise, it prints and fails the job
        return traceback.format_exc().splitlines()
    return []
