"""Spot notices: each cloud's notice read from a double of its node metadata service (tests/support/metadata_double.py),
the node drained in Ray by the notice's deadline, the MLflow run tagged."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from gpuflow.cluster.job.notices import CLOUDS, MetadataService, NotThisCloud, azure_notice, detect
from tests.support.metadata_double import metadata_double
from tests.support.servers import free_port


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_notice_is_read_as_the_cloud_gives_it(cloud):
    with metadata_double(cloud) as double:
        service = detect(f"{double.url}/node-a")
        assert service is not None and service.cloud.name == cloud
        assert service.check() is None and double.polls["node-a"] >= 1
        deadline = double.notify("node-a", in_s=30)
        seen = time.time()
        notice = service.check()
        assert notice is not None and notice.cloud == cloud
        # AWS says the time; GCP says only TRUE, its usual 30 s counted from when it is seen
        assert notice.deadline_s == pytest.approx(deadline if cloud == "aws" else seen + 30, abs=1.5)
        assert detect(f"{double.url}/node-b").check() is None, "another node's service has no notice"


def test_each_cloud_is_told_from_the_others():
    with metadata_double("aws") as aws, metadata_double("gcp") as gcp:
        assert detect(aws.url, clouds=("gcp", "azure")) is None
        assert detect(gcp.url, clouds=("aws", "azure")) is None
        # on GCP, an AWS token is no answer; the AWS service asks for its token before any answer
        with pytest.raises(NotThisCloud):
            MetadataService(CLOUDS["aws"], gcp.url).check()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{aws.url}/latest/meta-data/spot/instance-action", timeout=5)
        assert refused.value.code == 401


def test_no_metadata_service_means_no_watch():
    assert detect(f"http://127.0.0.1:{free_port()}", timeout_s=1) is None


def test_an_azure_preempt_event_for_this_vm_is_a_notice():
    def events(*listed):
        return json.dumps({"DocumentIncarnation": 2, "Events": list(listed)}).encode()

    freeze = {
        "EventId": "1",
        "EventType": "Freeze",
        "Resources": ["vm-a"],
        "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
    }
    preempt = {
        "EventId": "2",
        "EventType": "Preempt",
        "Resources": ["vm-b"],
        "EventStatus": "Scheduled",
        "NotBefore": "Mon, 19 Sep 2016 18:30:17 GMT",
    }
    assert azure_notice(200, events(), 0.0) is None
    assert azure_notice(200, events(freeze), 0.0, "vm-a") is None
    assert azure_notice(200, events(preempt), 0.0, "vm-a") is None, "another VM's event"
    notice = azure_notice(200, events(freeze, preempt), 0.0, "vm-b")
    assert notice.cloud == "azure" and notice.deadline_s == 1474309817.0
    with pytest.raises(NotThisCloud):
        azure_notice(404, b"<html>not here</html>", 0.0)


def test_a_job_ended_by_a_preemption_is_a_loss_to_wait_for():
    from gpuflow.cluster.protocol import PREEMPTED_EXIT_CODE
    from gpuflow.cluster.run.monitor import JobFailed

    assert JobFailed("preempted", PREEMPTED_EXIT_CODE).killed
    assert not JobFailed("the loop's own error", 1).killed


def test_a_job_ended_on_a_notice_has_lost_its_cluster_even_where_the_backend_reads_it_whole():
    """The deadline passed and Ray Train stopped the workers: a SkyPilot cluster whose node the cloud has not taken
    (yet, or at all) still reads UP; the run relaunches on the replacement at once instead of failing."""
    from gpuflow.cluster.protocol import PREEMPTED_EXIT_CODE
    from gpuflow.cluster.run.monitor import JobFailed, lost_on

    class Whole:
        asked = 0

        def lost(self, name):
            self.asked += 1
            return None

    backend = Whole()
    assert "spot notice ran out" in lost_on(backend, "c", JobFailed("preempted", PREEMPTED_EXIT_CODE))
    assert backend.asked == 1, "asked once, no settle wait"
    assert lost_on(backend, "c", JobFailed("the loop's own error", 1)) is None


def test_a_node_without_a_metadata_service_ends_its_watch_at_once():
    import subprocess
    import sys

    started = time.monotonic()
    watch = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuflow.cluster.job.spot_watch",
            "--gcs",
            "127.0.0.1:1",
            "--node-id",
            "ab" * 28,
            "--metadata-url",
            f"http://127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert watch.returncode == 0 and watch.stdout == "", watch.stderr
    assert time.monotonic() - started < 30


def test_ray_trains_watch_of_drains_is_on_only_where_a_notice_can_come(monkeypatch, tmp_path):
    from gpuflow.cluster.job.spot_watch import expect_notices
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.cluster.util.ray_internals import PREEMPTION_POLL_ENV, PREEMPTION_WATCHER_ENV
    from tests.support.repo import A_LOOP

    for name in (PREEMPTION_WATCHER_ENV, PREEMPTION_POLL_ENV, "GPUFLOW_METADATA_URL"):
        monkeypatch.delenv(name, raising=False)

    def cloud_spec(**compute):
        return parse_spec(
            {
                **A_LOOP,
                "compute": {"backend": "skypilot", "accelerators": "H100:1", **compute},
                "tracking": {"uri": "http://mlflow.example:5000"},
                "storage": {"checkpoints": "s3://a-bucket/gpuflow"},
            }
        )

    on_demand = cloud_spec()
    spot_option = cloud_spec(options=[{"infra": "aws/us-east-1"}, {"infra": "gcp", "use_spot": True}])
    assert expect_notices(on_demand) == {PREEMPTION_WATCHER_ENV: "0"}
    assert expect_notices(spot_option) == {PREEMPTION_WATCHER_ENV: "1", PREEMPTION_POLL_ENV: "1"}
    assert os.environ[PREEMPTION_WATCHER_ENV] == "1"
    local = parse_spec(A_LOOP)
    assert expect_notices(local)[PREEMPTION_WATCHER_ENV] == "0"
    monkeypatch.setenv("GPUFLOW_METADATA_URL", "http://127.0.0.1:9")  # a test's double of the clouds
    assert expect_notices(local)[PREEMPTION_WATCHER_ENV] == "1"


def test_the_flow_reads_a_new_notice_on_the_run_and_relaunches_on_it_only_without_an_elastic_range(digits_spec):
    from mlflow import MlflowClient

    from gpuflow.cluster.protocol import PREEMPTION_NOTICE_TAG, JobEnv
    from gpuflow.cluster.run.monitor import notice_check
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.flows.capacity.replacement import relaunches_on_notice
    from tests.support.repo import A_LOOP

    uri = digits_spec.tracking_uri
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("notices")).info.run_id
    client.set_tag(run_id, PREEMPTION_NOTICE_TAG, "the lost cluster's notice")  # before this relaunch
    check = notice_check(JobEnv(tracking_uri=uri, mlflow_run_id=run_id).to_env())
    assert check() is None
    client.set_tag(run_id, PREEMPTION_NOTICE_TAG, "aws takes node 0abc at 12:00:30 UTC")
    assert check() == ("notice", "aws takes node 0abc at 12:00:30 UTC")

    spec = parse_spec({**A_LOOP, "compute": {"max_recoveries": 2}})
    assert relaunches_on_notice(spec, 0) and relaunches_on_notice(spec, 1)
    assert not relaunches_on_notice(spec, 2), "no relaunch left"
    ranged = parse_spec(
        {**A_LOOP, "compute": {"max_recoveries": 2, "num_nodes": 2, "workers_per_node": 1, "num_workers": [1, 2]}}
    )
    assert not relaunches_on_notice(ranged, 0), "an elastic range carries on without the node"


@pytest.mark.full
def test_a_notice_drains_its_node_in_ray_and_tags_the_run(gpuflow_home, monkeypatch, tmp_path):
    """A real 2-node local cluster, a watch per node on the AWS double: the worker's notice drains the worker for
    preemption, not the head, and the run says so. Nothing runs on the worker, so Ray lets it go at once (a busy
    node stays, draining, until its workers stop: test_recovery.py's spot-notice test)."""
    from mlflow import MlflowClient

    from gpuflow.cluster.backends import cluster_name_for
    from gpuflow.cluster.backends.local import NODES_FILE, LocalBackend
    from gpuflow.cluster.job.spot_watch import start_watches, stop_watches
    from gpuflow.cluster.protocol import PREEMPTION_NOTICE_TAG
    from gpuflow.cluster.util.ray_internals import draining_nodes, preempted_nodes
    from tests.support.processes import wait_until

    client = MlflowClient(f"sqlite:///{gpuflow_home / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("spot"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", client.tracking_uri)
    monkeypatch.setenv("GPUFLOW_MLFLOW_RUN_ID", run.info.run_id)
    backend, name = LocalBackend(), cluster_name_for("5b0e2c7e-4f5a-4d9b-8c1e-3a2b1c0d9e8f")
    backend.start_shaped({"num_nodes": 2, "cpus": 1}, name, os.getpid())
    try:
        gcs = backend.wait_until_up(name)
        nodes = json.loads((Path(backend.record(name)["temp_dir"]) / NODES_FILE).read_text())
        [head] = [node["node_id"] for node in nodes if node["head"]]
        [worker] = [node["node_id"] for node in nodes if not node["head"]]
        with metadata_double("aws") as double, open(tmp_path / "watch.log", "wb") as log:
            watches = start_watches(gcs, [head, worker], double.url, out=log)
            try:
                wait_until(lambda: double.polls.get(head) and double.polls.get(worker), 60, "both watches polling")
                assert draining_nodes(gcs) == {} and preempted_nodes(gcs) == {}
                double.notify(worker, in_s=30)
                assert watches[1].wait(timeout=60) == 0, "the worker's watch acts once, then ends"
                drained = wait_until(lambda: preempted_nodes(gcs), 30, "the drained idle worker to leave")
                assert list(drained) == [worker] and drained[worker].startswith("spot notice: aws takes node")
                assert watches[0].poll() is None, "the head's watch goes on"
            finally:
                stop_watches(watches)
        said = (tmp_path / "watch.log").read_text()
        assert f"preemption notice: aws takes node {worker[:12]}" in said and "drained in Ray" in said, said
        tag = client.get_run(run.info.run_id).data.tags[PREEMPTION_NOTICE_TAG]
        assert f"aws takes node {worker[:12]}" in tag
    finally:
        backend.down(name)
    assert backend.status() == []


def test_the_runs_lost_compute_counts_from_the_checkpoint_it_resumes_from():
    """A notice's checkpoint mid-epoch (seen as the job's `checkpoint persisted` line) is where lost compute starts,
    not the last epoch's report: workers × (redone + replacement idle) + workers resumed × recovery."""
    from gpuflow.cluster.protocol import checkpoint_line, epoch_line, parse_line, resumed_line
    from gpuflow.cluster.run.losses import LostCompute

    assert parse_line("(TrainController pid=7) " + checkpoint_line(3)).kind == "checkpoint"
    assert parse_line("(RayTrainWorker pid=9) " + resumed_line(1, 15)).kind == "resumed"
    assert parse_line(epoch_line(1, "loss=0.2")).kind == "epoch"

    lost = LostCompute(workers=2)
    lost.epoch(at=100.0)  # the first epoch's report and its checkpoint
    lost.checkpointed(at=100.0)
    for at in (160.0, 162.0, 164.0):  # the notice: a checkpoint each step
        lost.checkpointed(at=at)
    lost.lost(at=165.0, started_at=50.0, replacements_requested=(150.0,))  # asked for on the notice, 15 s before
    lost.resumed(at=185.0)  # 20 s to the resumed loop's restore
    lost.epoch(at=200.0)
    assert lost.seconds == pytest.approx(2 * (1 + 15) + 2 * 20), "redone from the 164 s checkpoint, not the epoch's"
    assert lost.metrics() == {
        "lost_compute_seconds": pytest.approx(72),
        "redone_seconds": pytest.approx(1),
        "recovery_seconds": pytest.approx(35),
    }

    elastic = LostCompute(workers=2)
    elastic.lost(at=30.0, started_at=10.0, workers_after=1)  # no checkpoint yet: from the job's start
    elastic.checkpointed(at=36.0)  # a report on the one worker left: training went on
    assert elastic.seconds == pytest.approx(2 * 20 + 1 * 6)
    assert LostCompute(workers=2).metrics() == {}, "no loss, no figure"


def test_the_lifecycle_times_a_loss_from_its_first_sight_and_charges_the_replacement_asked_for_before():
    from gpuflow.cluster.cost.pricing import Estimate
    from gpuflow.cluster.run.lifecycle import Lifecycle
    from gpuflow.cluster.run.meter import Meter

    life = Lifecycle(
        "gpuflow-x", down=lambda name: None, meter=Meter(Estimate(3.6, 1.8, 2, True, "catalog")), workers=2
    )
    life.checkpointed()
    life.replacements["gpuflow-x-r1"] = time.time() - 10  # asked for on a notice, 10 s ago
    life.end_lost_job("lost", "a node is gone")  # the loss check's sight of it
    time.sleep(0.2)
    life.lost_cluster("a node is gone", job_ended_at=time.time())  # confirmed later: counted from the first sight
    assert life.lost.redone_seconds < 0.15 and life.lost.seconds == pytest.approx(2 * 10, abs=0.5)
    assert life.bill()["recoveries"] == 1 and "lost_compute_seconds" in life.bill()
