"""The reaper against real local Ray clusters and a real Prefect API: orphans downed, live and foreign clusters kept."""

import time
import uuid

import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.states import Running

from gpuflow.cluster.backends import ClusterStatus, cluster_name_for
from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.flows.reaper import reap_clusters
from gpuflow.flows.reconcile.records import close_stale_mlflow_runs, reap
from tests.support.processes import alive


@flow
def finished_experiment():
    return "done"


def finished_flow_run_id() -> str:
    return str(finished_experiment(return_state=True).state_details.flow_run_id)


def running_flow_run_id() -> str:
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(finished_experiment)
        client.set_flow_run_state(flow_run.id, Running(), force=True)
        return str(flow_run.id)


class CloudDouble:
    """Stands in for a cloud backend (SkyPilot) that cannot run here: status() and an idempotent down()."""

    def __init__(self, clusters: dict[str, float], name: str = "cloud"):
        self.name = name
        self.clusters = dict(clusters)  # name -> launched_at
        self.downed = []

    def status(self):
        return [ClusterStatus(name, self.name, "UP", launched_at) for name, launched_at in self.clusters.items()]

    def down(self, cluster_name):
        self.downed.append(cluster_name)
        return self.clusters.pop(cluster_name, None) is not None


@pytest.mark.full
def test_reaper_downs_orphans_keeps_live_and_foreign_clusters(prefect_server, digits_spec, gpuflow_home):
    spec = digits_spec.model_copy(update={"compute": digits_spec.compute.model_copy(update={"workers_per_node": 1})})
    finished, live = finished_flow_run_id(), running_flow_run_id()
    names = {"orphan": cluster_name_for(finished), "live": cluster_name_for(live), "foreign": "team-notebook"}
    backend = LocalBackend()
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    experiment = client.create_experiment("reaper", artifact_location=(gpuflow_home / "artifacts").as_uri())
    runs = {
        key: client.create_run(experiment, tags={"prefect.flow_run_id": run_id}).info.run_id
        for key, run_id in (("orphan", finished), ("live", live))
    }
    pids = {}
    try:
        for key, name in names.items():
            backend.launch(spec, name)
            pids[key] = backend.pids(name)
            assert alive(pids[key]), key

        verdicts = {v["cluster"]: v for v in reap_clusters(ttl_hours=24, backends=["local"])}

        assert verdicts[names["orphan"]]["downed"] and "COMPLETED" in verdicts[names["orphan"]]["reason"]
        assert not verdicts[names["live"]]["downed"] and verdicts[names["live"]]["action"] == "keep"
        assert names["foreign"] not in verdicts  # not ours: not even judged
        assert alive(pids["orphan"]) == []
        assert alive(pids["live"]) and alive(pids["foreign"])
        assert {s.name for s in backend.status()} == {names["live"], names["foreign"]}
        assert client.get_run(runs["orphan"]).info.status == "FINISHED"
        assert client.get_run(runs["orphan"]).data.tags["gpuflow.closed_by"] == "reaper"
        assert client.get_run(runs["live"]).info.status == "RUNNING"
    finally:
        for name in names.values():
            backend.down(name)
    assert alive(set().union(*pids.values())) == []


def test_reaper_on_any_backend_missing_run_and_ttl(prefect_server, gpuflow_home):
    live = running_flow_run_id()
    now = time.time()
    cloud = CloudDouble(
        {
            cluster_name_for(str(uuid.uuid4())): now,  # its flow run never existed (or was deleted)
            cluster_name_for(live): now - 3600,  # running for an hour: kept
            "gpuflow-" + "0" * 31: now - 10**6,  # 31 hex digits: not a gpuflow name, never touched
        }
    )
    stuck = CloudDouble({cluster_name_for(live): now - 30 * 3600}, name="cloud-b")  # same live run, up 30 h

    verdicts = reap([cloud, stuck], ttl_seconds=24 * 3600)

    assert [v.reason for v in verdicts if v.downed and v.backend == "cloud"] == [
        f"flow run {verdicts[0].flow_run_id} does not exist"
    ]
    assert cloud.downed == [verdicts[0].cluster] and len(cloud.clusters) == 2
    assert stuck.downed == [cluster_name_for(live)] and "TTL" in verdicts[-1].reason
    assert reap([CloudDouble({cluster_name_for(live): now})], 24 * 3600, dry_run=True)[0].action == "keep"


def test_stale_mlflow_runs_closed_by_state(prefect_server, digits_spec, gpuflow_home):
    client = MlflowClient(tracking_uri=digits_spec.tracking_uri)
    experiment = client.create_experiment("stale", artifact_location=(gpuflow_home / "artifacts").as_uri())
    missing = client.create_run(experiment, tags={"prefect.flow_run_id": str(uuid.uuid4())}).info.run_id
    untagged = client.create_run(experiment).info.run_id

    assert close_stale_mlflow_runs(digits_spec.tracking_uri) == [missing]
    assert client.get_run(missing).info.status == "KILLED"
    assert client.get_run(untagged).info.status == "RUNNING"  # not a gpuflow flow's run: left alone


def test_a_live_run_of_another_prefect_server_keeps_its_cluster_and_mlflow_run(prefect_server, gpuflow_home):
    """Two Prefect servers (a team's staging and production, or a test's own beside the session's) may share a
    tracking server and a cloud account: a flow run this pass's API does not know is not dead while its flow renews
    its MLflow lease. Once the lease lapses, its records are ended as a missing run's."""
    from gpuflow.cluster.protocol import FLOW_RUN_TAG
    from gpuflow.cluster.run.lease import lease_tags
    from gpuflow.flows.reconcile.lapsed import lease_reader
    from gpuflow.flows.reconcile.records import RunRecords

    uri = f"sqlite:///{gpuflow_home}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("elsewhere", artifact_location=(gpuflow_home / "artifacts").as_uri())
    elsewhere, lapsed = str(uuid.uuid4()), str(uuid.uuid4())  # flow runs of another Prefect server
    runs = {
        flow_run_id: client.create_run(experiment, tags={FLOW_RUN_TAG: flow_run_id, **lease_tags(120, now)}).info.run_id
        for flow_run_id, now in ((elsewhere, time.time()), (lapsed, time.time() - 600))
    }
    cloud = CloudDouble({cluster_name_for(elsewhere): time.time(), cluster_name_for(lapsed): time.time()})

    verdicts = reap([cloud], 24 * 3600, records=RunRecords(lease_stale=lease_reader([uri])))
    assert cloud.downed == [cluster_name_for(lapsed)], [v.reason for v in verdicts]
    assert close_stale_mlflow_runs(uri) == [runs[lapsed]]
    assert client.get_run(runs[elsewhere]).info.status == "RUNNING"
    assert client.get_run(runs[lapsed]).info.status == "KILLED"


def test_an_orphaned_run_of_last_month_is_not_read_again(gpuflow_home):
    """A pass reads the runs that can still change: one its job closed as orphaned lately (its flow run may still
    need marking Crashed), not every one ever closed so."""
    from gpuflow.cluster.protocol import FLOW_RUN_TAG, STOPPED_BY_TAG

    uri = f"sqlite:///{gpuflow_home}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("orphans", artifact_location=(gpuflow_home / "artifacts").as_uri())
    ids = {}
    for age_days in (0, 30):
        flow_run_id = str(uuid.uuid4())
        run_id = client.create_run(experiment, tags={FLOW_RUN_TAG: flow_run_id, STOPPED_BY_TAG: "orphaned"}).info.run_id
        client.set_terminated(run_id, "FAILED", end_time=int((time.time() - age_days * 86400) * 1000))
        ids[age_days] = flow_run_id
    asked = []
    close_stale_mlflow_runs(uri, states_of=lambda flow_run_ids: asked.extend(flow_run_ids) or {})
    assert asked == [ids[0]]


def test_a_run_that_trained_to_the_end_is_finished_though_its_flow_died(gpuflow_home):
    """The job said its training ended well (it tags the run), then its flow died before closing the run: the pass
    ends it FINISHED, saying the flow died, whether the flow run still reads Running (its lease lapsed) or Crashed.
    A run that had not trained to the end is FAILED as before."""
    from gpuflow.cluster.protocol import FLOW_RUN_TAG, STOP_DETAIL_TAG, STOPPED_BY_TAG, TRAINED_TAG
    from gpuflow.cluster.run.lease import lease_tags

    uri = f"sqlite:///{gpuflow_home}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("ends", artifact_location=(gpuflow_home / "artifacts").as_uri())
    lapsed = lease_tags(60, now=time.time() - 3600)
    flows, runs = {}, {}
    for trained in (True, False):
        for flow_state in (("RUNNING", False), ("CRASHED", True)):
            flow_run_id = str(uuid.uuid4())
            tags = {FLOW_RUN_TAG: flow_run_id, **lapsed, **({TRAINED_TAG: "2026-12-06T05:00:00Z"} if trained else {})}
            runs[(trained, flow_state[0])] = client.create_run(experiment, tags=tags).info.run_id
            flows[flow_run_id] = flow_state
    close_stale_mlflow_runs(
        uri, states_of=lambda flow_run_ids: {run: flows[run] for run in flow_run_ids}, heartbeat_at=lambda run: None
    )
    ended = {key: client.get_run(run_id) for key, run_id in runs.items()}
    assert {key: run.info.status for key, run in ended.items()} == {
        (True, "RUNNING"): "FINISHED",
        (True, "CRASHED"): "FINISHED",
        (False, "RUNNING"): "FAILED",
        (False, "CRASHED"): "FAILED",
    }
    said = ended[(True, "RUNNING")].data.tags
    assert said[STOPPED_BY_TAG] == "orphaned" and "trained to the end" in said[STOP_DETAIL_TAG], said


def test_a_run_cancelled_whose_process_died_before_it_closed_is_killed_not_failed(gpuflow_home):
    """Its cancel was asked for (the flow run Cancelling), its process then gone (its lease lapsed): the pass closes
    the MLflow run as the cancel would have, KILLED, stopped_by cancelled; not FAILED as an orphan."""
    from gpuflow.cluster.protocol import FLOW_RUN_TAG, STOP_DETAIL_TAG, STOPPED_BY_TAG
    from gpuflow.cluster.run.lease import lease_tags

    uri = f"sqlite:///{gpuflow_home}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("cancels", artifact_location=(gpuflow_home / "artifacts").as_uri())
    flow_run_id = str(uuid.uuid4())
    tags = {FLOW_RUN_TAG: flow_run_id, **lease_tags(60, now=time.time() - 3600)}
    run_id = client.create_run(experiment, tags=tags).info.run_id
    close_stale_mlflow_runs(
        uri, states_of=lambda ids: {flow_run_id: ("CANCELLING", False)}, heartbeat_at=lambda r: None
    )
    closed = client.get_run(run_id)
    assert closed.info.status == "KILLED" and closed.data.tags[STOPPED_BY_TAG] == "cancelled"
    assert "cancelled" in closed.data.tags[STOP_DETAIL_TAG]


def test_the_reaper_finds_every_tracking_server_the_runs_use(prefect_server, gpuflow_home):
    from gpuflow.cluster.config import default_tracking_uri
    from gpuflow.flows.deployments.known_servers import known_tracking_uris, tracking_tag

    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(finished_experiment)
        client.create_deployment(
            flow_id,
            "served-with-a-server",
            parameters={"spec": {"name": "x", "tracking": {"uri": "http://mlflow.team:5000/"}}},
        )
        for tag in (tracking_tag("https://other.team"), tracking_tag("sqlite:////elsewhere/mlflow.db")):
            run = client.create_flow_run(finished_experiment, tags=["experiment:x", tag])
            client.set_flow_run_state(run.id, Running(), force=True)

    found = known_tracking_uris(default_tracking_uri())
    assert found[0] == default_tracking_uri()
    assert {"http://mlflow.team:5000", "https://other.team"} <= set(found)
    assert not any("elsewhere" in uri for uri in found)  # another machine's local store is not opened here


def test_a_reaper_pass_makes_no_local_store_where_there_is_none(prefect_server, gpuflow_home):
    from prefect.states import Crashed

    from gpuflow.cluster.config import default_tracking_uri, local_store
    from gpuflow.flows.deployments.known_servers import tracking_tag
    from gpuflow.flows.run_messages import OWED_TAG
    from tests.test_dead_runs import run_experiment_standin

    local_store().unlink()  # a team's serve folder: its runs track to the team's server
    with get_client(sync_client=True) as client:  # a crashed run owed its message, its spec on this machine's store
        spec = {"name": "x", "train": {"loop": "train:loop"}, "notify": {"block": f"gone-{uuid.uuid4().hex[:8]}"}}
        owed = client.create_flow_run(finished_experiment, parameters={"spec": spec}, tags=[OWED_TAG], state=Crashed())
        # and a live run whose tag names this machine's store: the pass looks there for its MLflow run
        silent = client.create_flow_run(
            run_experiment_standin, tags=[tracking_tag(default_tracking_uri())], state=Running()
        )
        try:
            reap_clusters(ttl_hours=24, backends=["local"])
        finally:
            client.update_flow_run(owed.id, tags=[])  # the session's server is shared: no other pass owes it
            client.set_flow_run_state(silent.id, Crashed(), force=True)
    assert not local_store().exists()


def test_a_pass_never_turns_a_run_that_ended_since_its_verdict_crashed(prefect_server):
    from prefect.states import Completed

    from gpuflow.flows.reconcile.records import mark_crashed

    with get_client(sync_client=True) as client:
        ended = client.create_flow_run(finished_experiment, state=Completed())  # judged dead, then it completed
        dead = client.create_flow_run(finished_experiment, state=Running())
        assert mark_crashed({str(ended.id), str(dead.id)}, "found dead") == [str(dead.id)]
        assert client.read_flow_run(ended.id).state.is_completed()
        assert client.read_flow_run(dead.id).state.is_crashed()


def test_a_run_that_ends_between_the_passs_last_read_and_its_write_keeps_its_end(prefect_server, monkeypatch):
    """The pass reads a run just before it marks it Crashed; a run whose own end lands in between keeps that end
    (Prefect refuses Crashed to a final run: the pass proposes it, never forces it). A Cancelling run whose process
    is gone ends Cancelled, as its cancel would have ended it: not Crashed, and owed no message of a bad end."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.states import Cancelling, Completed

    from gpuflow.flows.reconcile.records import mark_crashed
    from gpuflow.flows.run_messages import OWED_TAG

    with get_client(sync_client=True) as client:
        racing = client.create_flow_run(finished_experiment, state=Running())
        cancelling = client.create_flow_run(finished_experiment, state=Running())
        client.set_flow_run_state(cancelling.id, Cancelling(), force=True)
    read = SyncPrefectClient.read_flow_run

    def read_then_the_run_ends(self, flow_run_id):
        found = read(self, flow_run_id)
        if flow_run_id == racing.id:  # its process was alive after all: it completes right after the pass's read
            with get_client(sync_client=True) as other:
                other.set_flow_run_state(racing.id, Completed())
        return found

    monkeypatch.setattr(SyncPrefectClient, "read_flow_run", read_then_the_run_ends)
    assert mark_crashed({str(racing.id), str(cancelling.id)}, "found dead") == []
    monkeypatch.undo()
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(racing.id).state.is_completed()
        cancelled = client.read_flow_run(cancelling.id)
        assert cancelled.state.is_cancelled() and "stopped_by=cancelled" in cancelled.state.message
        assert "found dead" not in cancelled.state.message  # the crash's words are not a cancel's
        assert OWED_TAG not in cancelled.tags


def test_the_reaper_lists_only_the_backends_runs_used(prefect_server):
    from gpuflow.flows.deployments.known_servers import backends_in_use

    unused = f"cloud-{uuid.uuid4().hex[:8]}"  # the session's server is shared: a name no other test tags
    assert backends_in_use(["local", unused]) == ["local"]  # listing it could start its API server, for nothing
    with get_client(sync_client=True) as client:
        client.create_flow_run(finished_experiment, tags=[f"backend:{unused}"])
    assert backends_in_use(["local", unused]) == ["local", unused]


def test_the_jobs_lease_watch_does_not_count_a_tracking_server_outage_against_the_flow(gpuflow_home):
    """The job's guard judges the flow's lease by reads of the MLflow run. A renewal unchanged for the grace period of
    quick reads is expired; a read that failed, or that hung in the client's retries for a quarter of the grace (the
    server was down: the flow's renewals could not get through either), starts the window again."""
    from gpuflow.cluster.protocol import RENEWED_TAG
    from gpuflow.cluster.run.lease import LeaseWatch, lease_tags

    client = MlflowClient(f"sqlite:///{gpuflow_home}/mlflow.db")
    experiment = client.create_experiment("lease", artifact_location=(gpuflow_home / "artifacts").as_uri())
    run_id = client.create_run(experiment, tags=lease_tags(12)).info.run_id
    now = [0.0]

    class Tracking:  # the real store, reached through a server that is quick, or down (the read hangs, or fails)
        delay_s, fails = 0.0, False

        def get_run(self, run_id):
            if self.fails:
                raise ConnectionError("tracking server down")
            now[0] += self.delay_s
            return client.get_run(run_id)

    tracking = Tracking()
    watch = LeaseWatch(tracking, run_id, 12, clock=lambda: now[0])

    def after(seconds: float) -> bool:
        now[0] += seconds
        return watch.expired()

    assert not after(0) and not after(11) and after(1.5)  # quick reads, no renewal for 12 s: the flow is gone
    watch = LeaseWatch(tracking, run_id, 12, clock=lambda: now[0])
    assert not after(0)
    tracking.delay_s = 10  # the server went away: the read hung in the client's retries and came back unchanged
    assert not after(1)
    tracking.delay_s = 0
    assert not after(11) and after(1.5)  # a whole grace of quick reads since
    watch = LeaseWatch(tracking, run_id, 12, clock=lambda: now[0])
    tracking.fails = True
    assert not after(0) and not after(30)
    tracking.fails = False
    assert not after(1) and not after(11) and after(1.5)
    client.set_tag(run_id, RENEWED_TAG, f"{time.time():.3f}")
    assert not after(0)  # renewed: a new window


def test_a_lapsed_lease_is_a_dead_flow_only_once_its_prefect_heartbeats_stopped_too(gpuflow_home):
    """A tracking server that was down stopped the flow's renewals, not its Prefect heartbeats: a pass in or right
    after the outage keeps the run (its MLflow run open, the flow run's death unsaid); once the heartbeats are late
    too, or where none are kept, the lapsed lease is a dead flow."""
    from gpuflow.cluster.protocol import FLOW_RUN_TAG
    from gpuflow.cluster.run.lease import lease_tags
    from gpuflow.cluster.run.liveness import HEARTBEAT_LATE_S
    from gpuflow.flows.reconcile.lapsed import lease_lapsed, lease_reader

    uri = f"sqlite:///{gpuflow_home}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("outage", artifact_location=(gpuflow_home / "artifacts").as_uri())
    now, flow_run_id = time.time(), str(uuid.uuid4())
    lapsed = lease_tags(12, now=now - 60)
    run_id = client.create_run(experiment, tags={FLOW_RUN_TAG: flow_run_id, **lapsed}).info.run_id
    beats = {"beating": now - 20, "late": now - HEARTBEAT_LATE_S - 10, "none kept": None}
    assert {name: lease_lapsed(lapsed, flow_run_id, now, lambda _, at=at: at) for name, at in beats.items()} == {
        "beating": False,
        "late": True,
        "none kept": True,
    }
    assert lease_lapsed(lease_tags(12, now=now - 5), flow_run_id, now, lambda _: None) is False  # renewed: alive
    assert lease_lapsed({}, flow_run_id, now, lambda _: None) is None  # no lease: others judge

    running = {flow_run_id: ("RUNNING", False)}
    assert not lease_reader([uri], lambda _: now - 20)(flow_run_id)
    assert close_stale_mlflow_runs(uri, lambda ids: running, dead=set(), heartbeat_at=lambda _: now - 20) == []
    assert client.get_run(run_id).info.status == "RUNNING"
    dead = set()
    assert close_stale_mlflow_runs(uri, lambda ids: running, dead=dead, heartbeat_at=lambda _: None) == [run_id]
    assert dead == {flow_run_id} and client.get_run(run_id).info.status == "FAILED"
