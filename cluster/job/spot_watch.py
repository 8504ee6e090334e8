"""A node's watch for its cloud's spot notice: on a notice, drain the node in Ray by the deadline, say so, tag the run.

    python -m gpuflow.cluster.job.spot_watch --gcs 10.0.0.1:6390 --node-id <hex> [--metadata-url URL] [--parent PID]

One runs per node, beside Ray: the clouds give a node's notice on that node's own metadata service
(cluster/job/notices.py). A SkyPilot node starts its own (cluster/backends/skypilot/node.py, which knows its Ray's
temp dir, not yet its node id: `--ray-temp-dir`); on the local backend the job starts one per simulated node. Ray is
told through its drain API (cluster/util/ray_internals.py: drain_node, reason preemption, with the deadline); Ray
Train's PreemptionWatcher sees the drain within its poll interval and the loop gets it from
`ray.train.get_preemption_info()`, in time to report checkpoints (gpuflow.cluster.loop.preempted). The node goes
when the cloud takes it (or, drained, once nothing runs on it), and the flow relaunches and resumes as for any lost
node (docs/spot.md).

The watch polls every POLL_S until a notice (then exits: a node is taken once), its parent exits, or no cloud answers
at the start (no notices to wait for: it exits at once). It imports neither Ray nor MLflow until a notice comes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime, timezone

from gpuflow.cluster.config import metadata_url
from gpuflow.cluster.job.notices import MetadataService, Notice, NotThisCloud, detect
from gpuflow.cluster.protocol import PREEMPTION_NOTICE_TAG, JobEnv, notice_line
from gpuflow.cluster.util.errors import caused_by

POLL_S = 1.0  # AWS suggests every 5 s; a GCP or Azure notice leaves 30 s, and this is far below any rate limit
NODE_TIMEOUT_S = 600  # for this node's Ray to join the cluster


def utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def describe(notice: Notice, node_id: str, seen_s: float) -> str:
    return (
        f"{notice.cloud} takes node {node_id[:12]} at {utc(notice.deadline_s)} "
        f"({notice.deadline_s - seen_s:.0f}s after the notice was seen; the cloud said: {notice.said})"
    )


def act_on(notice: Notice, gcs: str, node_id: str, seen_s: float) -> None:
    """Drains the node (first: the loop's time to checkpoint starts with it), then says so on the log and the run."""
    from gpuflow.cluster.util.ray_internals import drain_node

    detail = describe(notice, node_id, seen_s)
    try:
        drain_node(gcs, node_id, f"spot notice: {detail}", int(notice.deadline_s * 1000))
    except Exception as exc:  # Ray gone already (the node, or the run, ended): nothing is left to warn
        print(notice_line(f"{detail}; could not drain it in Ray: {type(exc).__name__}: {exc}"), flush=True)
        return
    print(notice_line(f"{detail}; drained in Ray, the loop may checkpoint until then"), flush=True)
    tag_run(f"{utc(seen_s)}: {detail}")


def tag_run(value: str) -> None:
    job = JobEnv.from_env()
    if not (job.mlflow_run_id and job.tracking_uri):
        return
    try:
        from mlflow import MlflowClient

        MlflowClient(job.tracking_uri).set_tag(job.mlflow_run_id, PREEMPTION_NOTICE_TAG, value[:500])
    except Exception as exc:  # the drain is what matters; the tag is a record
        print(f"[gpuflow] could not tag the run with the notice: {type(exc).__name__}: {exc}", flush=True)


def watch(service: MetadataService, gcs: str, node_id: str, parent: int | None, poll_s: float = POLL_S) -> bool:
    """Polls until a notice (acted on: True) or the parent's exit (False)."""
    while parent is None or os.getppid() == parent:
        try:
            notice = service.check()
        except (NotThisCloud, OSError):
            notice = None  # a slow or odd answer: the next poll may do
        if notice is not None:
            act_on(notice, gcs, node_id, time.time())
            return True
        time.sleep(poll_s)
    return False


def own_node(gcs: str, temp_dir: str, timeout_s: float = NODE_TIMEOUT_S) -> str | None:
    """This node's Ray node id, found by its Ray's temp dir once the node has joined (None: it never did)."""
    from gpuflow.cluster.util.ray_internals import node_with_temp_dir

    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            if node := node_with_temp_dir(gcs, temp_dir):
                return node
        except Exception:  # the head's GCS not up yet
            pass
        time.sleep(2)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gcs", required=True, help="the Ray cluster's GCS address")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node-id", help="this node's Ray node id (hex)")
    which.add_argument("--ray-temp-dir", help="or the temp dir this node's Ray was started with: its id is looked up")
    parser.add_argument(
        "--metadata-url",
        default=metadata_url(),
        help="ask this service instead of the cloud's own "
        "(default: GPUFLOW_METADATA_URL, a test's double; unset: the cloud's own)",
    )
    parser.add_argument("--parent", type=int, default=None, help="exit once this process is no longer the parent")
    args = parser.parse_args(argv)
    service = detect(args.metadata_url)
    if service is None:
        return 0  # not on a cloud this knows: no notice will come
    node = args.node_id or own_node(args.gcs, args.ray_temp_dir)
    if node is None:
        print(f"[gpuflow] no spot-notice watch: no Ray node with temp dir {args.ray_temp_dir} joined", flush=True)
        return 1
    watch(service, args.gcs, node, args.parent)
    return 0


def start_watches(gcs: str, nodes: list[str], base_url: str | None = None, out=None) -> list[subprocess.Popen]:
    """One watch per node id, children of this process, writing to `out` (default: this process's stdout). A double
    of the metadata service (`base_url`) stands in for every node's cloud; each node then asks <base_url>/<its node
    id>, its own instance, as on one host the nodes share the service."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "gpuflow.cluster.job.spot_watch",
                "--gcs",
                gcs,
                "--node-id",
                node,
                "--parent",
                str(os.getpid()),
                *(["--metadata-url", f"{base_url.rstrip('/')}/{node}"] if base_url else []),
            ],
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        for node in nodes
    ]


def start_local_watches(gcs: str) -> list[subprocess.Popen]:
    """On the local backend, where a test sets GPUFLOW_METADATA_URL: a watch per simulated node. Needs `ray.init`."""
    base_url = metadata_url()
    if not base_url:
        return []
    import ray

    return start_watches(gcs, [node["NodeID"] for node in ray.nodes() if node["Alive"]], base_url)


def notices_possible(spec) -> bool:
    """A notice can come: a compute option is spot, or a test stands a metadata double in for the clouds."""
    from gpuflow.cluster.spec.options import compute_options

    return metadata_url() is not None or any(option.use_spot for option in compute_options(spec.compute))


def expect_notices(spec) -> dict[str, str]:
    """Turns Ray Train's PreemptionWatcher on (an actor per worker group that polls the drains) where a notice can
    come; elsewhere it stays off, as it costs every run an actor. Returns the settings, set in this process's
    environment (a trainer built here propagates them to its workers) and for the job's runtime_env (a sweep's
    trainers are built in Tune's actors)."""
    from gpuflow.cluster.util.ray_internals import PREEMPTION_POLL_ENV, PREEMPTION_WATCHER_ENV

    settings = {PREEMPTION_WATCHER_ENV: "1" if notices_possible(spec) else "0"}
    if settings[PREEMPTION_WATCHER_ENV] == "1":  # its default, 5 s, would take that much from the loop's time
        settings[PREEMPTION_POLL_ENV] = os.environ.get(PREEMPTION_POLL_ENV, "1")
    os.environ.update(settings)
    return settings


def start_node_watch(gcs: str, ray_temp_dir: str) -> subprocess.Popen | None:
    """A SkyPilot node's watch, started beside its Ray where the spec (the job's) can get a notice."""
    from gpuflow.cluster.spec import job_spec

    if not notices_possible(job_spec(JobEnv.from_env().spec_json)):
        return None
    return subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-m",
            "gpuflow.cluster.job.spot_watch",
            "--gcs",
            gcs,
            "--ray-temp-dir",
            ray_temp_dir,
            "--parent",
            str(os.getpid()),
        ]
    )


def is_preemption(error: BaseException | None) -> bool:
    """Whether Ray Train ended training because a node was preempted (ray.train.PreemptionError in the chain)."""
    from ray.train import PreemptionError

    return caused_by(error, PreemptionError)


def stop_watches(watches: list[subprocess.Popen]) -> None:
    for process in watches:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    sys.exit(main())
