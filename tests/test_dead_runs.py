"""Runs killed where no lease of ours covers them (#38): while waiting for the quota, before their MLflow run opens.
Real processes killed with SIGKILL, a real Prefect API, one reaper pass: Crashed, not live in `gpuflow status`."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL
from prefect.states import Cancelled, Running

from gpuflow.cluster.backends import cluster_name_for
from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.cluster.config import default_tracking_uri
from gpuflow.cluster.protocol import FLOW_RUN_TAG, RENEWED_TAG
from gpuflow.cluster.run import liveness
from gpuflow.flows.cli.status import status
from gpuflow.flows.heartbeats import last_heartbeat
from gpuflow.flows.quota import pools
from gpuflow.flows.quota.pools import LIMIT_PREFIX, WAITING, set_quota
from gpuflow.flows.reaper import reap_clusters
from tests.loops import PLAIN_LOOP
from tests.support.processes import alive, processes_of, wait_until
from tests.support.servers import BIN, REPO, base_env
from tests.test_quota import holder, quota_of

STARTED = """
import time
from prefect import flow
from prefect.runtime import flow_run

@flow(name="run-experiment")
def run_experiment():
    print("started", flow_run.id, flush=True)
    time.sleep(600)  # provisioning, its MLflow run not open yet

run_experiment()
"""


@flow(name="run-experiment")
def run_experiment_standin():
    pass


def state_of(flow_run_id):
    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def stop_all(processes: list[subprocess.Popen], pool: str) -> None:
    """Kills what is still running and removes the test's quota."""
    for process in processes:
        if process.poll() is None:
            killed(process)
    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def killed(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_status_shows_a_run_whose_time_has_come_that_nothing_picked_up(prefect_server):
    """A run triggered (or scheduled) while no serve polls its deployment waits, Scheduled then Late: `gpuflow status`
    lists it, saying why; a run scheduled for later is not waiting yet."""
    from datetime import datetime, timedelta, timezone

    from prefect.states import Scheduled

    from gpuflow.flows.cli.status import UNCLAIMED

    now = datetime.now(timezone.utc)
    with get_client(sync_client=True) as client:
        due, later = (
            client.create_flow_run(run_experiment_standin, state=Scheduled(scheduled_time=now + offset)).id
            for offset in (timedelta(minutes=-1), timedelta(hours=1))
        )
        just = client.create_flow_run(run_experiment_standin, state=Scheduled(scheduled_time=now)).id
        try:
            shown = {row.flow_run_id: row for row in status()}
        finally:
            for flow_run_id in (due, later, just):
                client.delete_flow_run(flow_run_id)
    assert shown[str(just)].queue.endswith(" ago: not picked up yet"), shown[str(just)]  # a serve polls every 10 s
    assert shown[str(due)].state == "Scheduled", shown[str(due)]
    assert shown[str(due)].queue.startswith("due 1:0") and shown[str(due)].queue.endswith(f" ago: {UNCLAIMED}")
    assert str(later) not in shown


def test_runs_killed_waiting_for_gpus_or_before_mlflow_are_crashed_in_one_pass(
    prefect_server, gpuflow_home, monkeypatch
):
    pool, api_url = f"dead-{uuid.uuid4().hex[:8]}", PREFECT_API_URL.value()
    set_quota(pool, 1)
    with get_client(sync_client=True) as client:
        holding, waiting = (
            client.create_flow_run(run_experiment_standin, tags=[f"quota:{pool}", "backend:local"], state=Running()).id
            for _ in range(2)
        )
    processes = [holder(api_url, pool, holding)]
    with contextlib.ExitStack() as stack:
        stack.callback(stop_all, processes, pool)
        assert processes[0].stdout.readline().startswith("held")
        processes.append(holder(api_url, pool, waiting))  # waits behind the holder, stamping its state
        # and one killed before its MLflow run opens: a real flow run of its own, sending Prefect's heartbeats
        processes.append(
            subprocess.Popen(
                [str(BIN / "python"), "-c", STARTED],
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
                start_new_session=True,
                env=base_env(PREFECT_API_URL=api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30"),
            )
        )
        said, provisioning = processes[2].stdout.readline().split()
        assert said == "started"
        ours = {str(holding), str(waiting), provisioning}  # the worker's other tests may have live runs of their own
        wait_until(lambda: state_of(waiting).name == WAITING, 60, "the second run waits for the quota")
        row = next(row for row in status() if row.flow_run_id == str(waiting))
        assert (row.state, row.queue, row.cluster, row.lease, row.mlflow) == (
            WAITING,
            f"1 of 1 in {pool}",
            None,
            None,
            None,
        )
        wait_until(
            lambda: [row for row in status() if row.state == "Running" and row.flow_run_id == provisioning],
            60,
            "the third run is Running",
        )
        with get_client(sync_client=True) as client:
            beat = wait_until(lambda: last_heartbeat(client, provisioning), 60, "a Prefect heartbeat")
        assert abs(time.time() - beat) < 60

        for process in processes[1:]:
            killed(process)
        # the reaper's reading: no waiting the 75 s and 180 s out here. The holder beats as a live run's process
        # does (it is a flow run made through the API: nothing else would); the killed run's last beat gets late.
        monkeypatch.setattr(pools, "STALE_S", 2.0)
        monkeypatch.setattr(liveness, "HEARTBEAT_LATE_S", LATE_S)
        beating = heartbeats_of(str(holding))
        stack.callback(beating.set)
        with get_client(sync_client=True) as client:
            wait_until(lambda: last_heartbeat(client, str(holding)), 30, "the holder's heartbeats")
        time.sleep(max(3.0, LATE_S + 1 - (time.time() - beat)))
        shown = {row.flow_run_id: row.state for row in status()}
        assert shown[str(waiting)].startswith("dead, not yet marked Crashed: its process died while waiting")
        assert shown[provisioning].startswith("dead, not yet marked Crashed: its process died before")
        assert shown[str(holding)] == "Running"  # alive: it holds a slot and renews its lease

        started = time.monotonic()
        reap_clusters(backends=["local"], tracking_uris=[default_tracking_uri()])
        print(f"one reaper pass: {time.monotonic() - started:.1f} s")
        for flow_run_id, why in [
            (str(waiting), "while waiting for GPUs"),
            (provisioning, "before its MLflow run opened"),
        ]:
            state = state_of(flow_run_id)
            assert state.type.value == "CRASHED" and why in state.message and "found by the reaper" in state.message
        assert [row.flow_run_id for row in status() if row.flow_run_id in ours] == [str(holding)]  # the dead: gone
        assert quota_of(pool).active_slots == 1  # the holder's: the dead waiter holds none
        assert state_of(holding).type.value == "RUNNING"
    assert alive([process.pid for process in processes]) == []


LATE_S = 8.0  # a beat each second, kept by the server within a few: late past this


def heartbeats_of(flow_run_id: str) -> threading.Event:
    """Sends Prefect's heartbeat of the flow run each second until the returned event is set."""
    from prefect.events import emit_event

    stop = threading.Event()

    def beat():
        while not stop.wait(1.0):
            emit_event(
                "prefect.flow-run.heartbeat", resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"}
            )

    threading.Thread(target=beat, daemon=True).start()
    return stop


@pytest.mark.full  # `gpuflow run` prewarms a local Ray cluster: tens of seconds on a shared machine
def test_a_gpuflow_run_killed_while_waiting_for_the_quota_is_crashed_by_one_pass(
    prefect_server, gpuflow_home, monkeypatch
):
    pool, api_url = f"killed-{uuid.uuid4().hex[:8]}", PREFECT_API_URL.value()
    set_quota(pool, 1)
    with get_client(sync_client=True) as client:
        holding = client.create_flow_run(run_experiment_standin, tags=[f"quota:{pool}"], state=Running()).id
    processes = [holder(api_url, pool, holding)]
    try:
        assert processes[0].stdout.readline().startswith("held")
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuflow.flows.cli",
                    "run",
                    str(REPO / "experiments" / "digits.yaml"),
                    *[
                        f"--set={override}"
                        for override in (
                            f"workdir={REPO}",
                            f"train.loop={PLAIN_LOOP}",
                            "data=null",
                            "compute.workers_per_node=1",
                            f"compute.quota={pool}",
                            "tracking.register_model=false",
                        )
                    ],
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
                env=base_env(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(gpuflow_home)),
            )
        )

        def waiter():
            with get_client(sync_client=True) as client:
                return [
                    run
                    for run in client.read_flow_runs(limit=50)
                    if f"quota-wait:{pool}" in run.tags and run.state and run.state.name == WAITING
                ]

        flow_run_id = str(wait_until(waiter, 180, "`gpuflow run` waits for the quota")[0].id)
        assert [row.queue for row in status() if row.flow_run_id == flow_run_id] == [f"1 of 1 in {pool}"]
        killed(processes[1])
        wait_until(lambda: processes_of(gpuflow_home) == [processes[0].pid], 60, "its prewarmed cluster stops with it")

        monkeypatch.setattr(pools, "STALE_S", 2.0)
        time.sleep(3)
        reap_clusters(backends=["local"], tracking_uris=[default_tracking_uri()])
        state = state_of(flow_run_id)
        assert state.type.value == "CRASHED" and "while waiting for GPUs" in state.message, state
        assert flow_run_id not in [row.flow_run_id for row in status()]
        assert quota_of(pool).active_slots == 1  # the holder's only
    finally:
        stop_all(processes, pool)
    assert alive([process.pid for process in processes]) == [] and not processes_of(gpuflow_home)


def test_status_tells_a_gone_cluster_and_a_lease_from_a_clock_ahead(prefect_server, gpuflow_home):
    """A live run whose MLflow lease was renewed by a clock 30 s ahead of this one, and whose local cluster's
    processes were killed (SIGKILL) with its folder left."""
    with get_client(sync_client=True) as client:
        flow_run_id = str(
            client.create_flow_run(
                run_experiment_standin, state=Running(), tags=[f"tracking:{default_tracking_uri()}"]
            ).id
        )
    mlflow = MlflowClient(default_tracking_uri())
    experiment = mlflow.create_experiment(f"status-{uuid.uuid4().hex[:8]}")
    mlflow_run = mlflow.create_run(experiment, tags={FLOW_RUN_TAG: flow_run_id})
    mlflow.set_tag(mlflow_run.info.run_id, RENEWED_TAG, f"{time.time() + 30:.3f}")
    backend = LocalBackend()
    cluster = backend.root / cluster_name_for(flow_run_id)
    session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        cluster.mkdir(parents=True)
        (cluster / "cluster.json").write_text(f'{{"session": {session.pid}, "temp_dir": "{cluster / "tmp"}"}}')
        row = next(row for row in status() if row.flow_run_id == flow_run_id)
        assert (row.state, row.cluster) == ("Running", f"{cluster.name} (UP)")
        assert row.lease.startswith("alive, renewed 0 s ago (its clock 3") and "grace 120 s" in row.lease
        assert row.mlflow.endswith(f"/runs/{mlflow_run.info.run_id}")
        killed(session)
        row = next(row for row in status() if row.flow_run_id == flow_run_id)
        assert row.cluster == f"{cluster.name} (GONE)"
    finally:
        backend.down(cluster.name)
        if session.poll() is None:
            killed(session)
        mlflow.set_terminated(mlflow_run.info.run_id, "KILLED")
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelled(), force=True)


def test_a_run_killed_while_its_local_cluster_starts_is_crashed_and_what_it_left_downed(
    prefect_server, gpuflow_home, tmp_path
):
    """A local cluster stops with the process that launched it (its supervisor watches that process): a `gpuflow run`
    killed before its MLflow run opens leaves its cluster's folder, and the spare it warmed; one killed between the
    folder and its record leaves a folder alone. One pass downs all three and marks the run Crashed; a cluster whose
    processes died while its launcher lives (a flow that is relaunching it) is left to that flow."""
    backend = LocalBackend()
    launcher, alive_launcher = (subprocess.Popen(["sleep", "300"]) for _ in range(2))
    sessions = [subprocess.Popen(["sleep", "300"], start_new_session=True) for _ in range(3)]
    with get_client(sync_client=True) as client:
        dead_run, live_run = (
            client.create_flow_run(run_experiment_standin, tags=["backend:local"], state=Running()).id for _ in range(2)
        )
    names = [cluster_name_for(str(dead_run)), "gpuflow-warm-0123456789ab", cluster_name_for(str(live_run))]
    for name, session, owner in zip(names, sessions, [launcher, launcher, alive_launcher], strict=True):
        (backend.root / name).mkdir(parents=True)
        (backend.root / name / "cluster.json").write_text(
            json.dumps(
                {
                    "session": session.pid,
                    "temp_dir": str(tmp_path / name),
                    "launched_at": time.time(),
                    "jobs": {},
                    "owner": owner.pid,
                }
            )
        )
    half_made = backend.root / "gpuflow-warm-ba9876543210"  # killed between its folder and its record
    half_made.mkdir()
    os.utime(half_made, (time.time() - 60, time.time() - 60))
    try:
        assert {c.name: c.status for c in backend.status()} == {
            **{name: "UP" for name in names},
            half_made.name: "ORPHANED",
        }
        launcher.kill()  # kill -9 of `gpuflow run`: its supervisors stop its clusters
        for session in sessions:
            session.kill()
            session.wait()
        launcher.wait()
        assert {c.name: c.status for c in backend.status()} == {
            names[0]: "ORPHANED",
            names[1]: "ORPHANED",
            names[2]: "GONE",
            half_made.name: "ORPHANED",
        }

        # `gpuflow status` says what the pass will do: one verdict
        shown = {row.flow_run_id: row.state for row in status()}
        assert shown[str(dead_run)] == "dead, not yet marked Crashed: its process and cluster are gone", shown
        assert shown[str(live_run)] == "Running"
        reap_clusters(backends=["local"], tracking_uris=[default_tracking_uri()])
        assert [c.name for c in backend.status()] == [names[2]]  # what the dead run left is gone
        assert (
            state_of(dead_run).type.value == "CRASHED"
            and "its local cluster stopped with it" in state_of(dead_run).message
        )
        assert state_of(live_run).type.value == "RUNNING"  # its launcher lives: its flow decides
    finally:
        for process in [launcher, alive_launcher, *sessions]:
            process.kill()
            process.wait()
        backend.down(names[2])


def live_run(**facts) -> liveness.LiveRun:
    known = dict(waiting=False, state_age_s=0.0, heartbeat_age_s=None, heartbeats_kept=True, has_cluster=False)
    return liveness.LiveRun("run", **{**known, "has_mlflow_run": False, **facts})


@pytest.mark.parametrize(
    "facts, dead",
    [
        ({"heartbeat_age_s": 30.0, "state_age_s": 900.0}, False),  # beating: alive however old
        ({"heartbeat_age_s": 200.0}, True),  # six beats missed
        ({"state_age_s": 200.0}, True),  # killed before its first beat reached the server
        ({"state_age_s": 60.0}, False),  # may not have sent its first yet
        ({"state_age_s": 200.0, "heartbeats_kept": False}, False),  # a server that keeps none: the provisioning grace
        ({"state_age_s": 700.0, "heartbeats_kept": False}, True),
        ({"state_age_s": 900.0, "has_mlflow_run": True}, False),  # its lease judges it
        ({"state_age_s": 900.0, "has_mlflow_run": None}, False),  # a tracking server down: cannot be told
        ({"state_age_s": 900.0, "has_cluster": True}, False),
        ({"pending_without_deployment": True, "state_age_s": 130.0}, True),  # `gpuflow run`'s, never begun
        ({"pending_without_deployment": True, "state_age_s": 60.0}, False),
    ],
)
def test_a_silent_run_is_dead_once_its_heartbeats_are_late(facts, dead):
    assert (liveness.silent_death(live_run(**facts), pools.STALE_S) is not None) == dead


def test_a_run_that_gpuflow_run_left_pending_is_dead_once_late(prefect_server):
    """A `gpuflow run` whose process died as it created its flow run (or whose create was retried across an API
    restart, leaving the first copy) stays Pending: no worker will begin it. The pass judges it by its age."""
    from prefect.states import Pending

    from gpuflow.flows.reconcile.dead_runs import dead_without_lease

    with get_client(sync_client=True) as client:
        left = str(client.create_flow_run(run_experiment_standin, state=Pending()).id)
    now = time.time()
    assert left not in dead_without_lease(set(), [], now)  # it may still begin
    late = dead_without_lease(set(), [], now + liveness.NEVER_BEGUN_S + 10)
    assert "its process never began it" in late[left], late


def test_a_cancelling_run_whose_process_is_gone_is_dead_once_silent(prefect_server):
    """A served run whose engine died (the API restarting as it began) and was then cancelled stays Cancelling:
    its runner has no process to stop. Silent, with no cluster and no MLflow run, it is dead as a Running run is."""
    from prefect.states import Cancelling

    from gpuflow.flows.reconcile.dead_runs import dead_without_lease

    with get_client(sync_client=True) as client:
        cancelling = str(client.create_flow_run(run_experiment_standin, state=Cancelling()).id)
    now = time.time()
    assert cancelling not in dead_without_lease(set(), [default_tracking_uri()], now)
    late = dead_without_lease(set(), [default_tracking_uri()], now + liveness.PROVISION_GRACE_S + 10)
    assert "its process died" in late[cancelling], late


@pytest.mark.full  # a real run on a local Ray cluster
def test_a_job_that_trained_to_the_end_after_its_flow_froze_is_finished_and_every_record_agrees(
    prefect_server, gpuflow_home
):
    """The flow of `gpuflow run` freezes (SIGSTOP) at its first checkpoint; its job trains to the end within the orphan
    grace, then the flow is killed (SIGKILL) before it closed anything. The MLflow run is FINISHED with every epoch
    and its checkpoint, saying its flow died; one pass marks the flow run Crashed and frees its slot. At every poll
    from the kill on, `gpuflow status` agrees with the flow run, the slot and the MLflow run: it never shows the run
    live while its slot is free or its MLflow run closed."""
    from gpuflow.cluster.protocol import STOP_DETAIL_TAG, STOPPED_BY_TAG, TRAINED_TAG
    from tests.test_faults import checkpoints_under

    pool = f"ended-{uuid.uuid4().hex[:8]}"
    set_quota(pool, 1)
    overrides = [f"workdir={REPO}", f"train.loop={PLAIN_LOOP}", "train.params.offset=0", "train.params.pace_s=1"]
    overrides += ["train.epochs=4", "data=null", "compute.workers_per_node=1", f"compute.quota={pool}"]
    flow = subprocess.Popen(
        [sys.executable, "-m", "gpuflow.flows.cli", "run", str(REPO / "experiments" / "digits.yaml")]
        + [f"--set={override}" for override in (*overrides, "tracking.register_model=false")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=base_env(PREFECT_API_URL=PREFECT_API_URL.value(), GPUFLOW_HOME=str(gpuflow_home)),
    )
    mlflow = MlflowClient(default_tracking_uri())

    def runs_where(condition):
        experiments = [experiment.experiment_id for experiment in mlflow.search_experiments()]
        return [run for run in mlflow.search_runs(experiments) if condition(run)] if experiments else []

    try:
        # the first checkpoint on disk (Ray Train persists it as the loop reports; MLflow hears of it later): the
        # training has 3 epochs of a second to go, and the flow's end is still far
        wait_until(lambda: checkpoints_under(gpuflow_home, "state.json"), 300, "the first checkpoint", interval_s=0.05)
        flow.send_signal(signal.SIGSTOP)
        [mlflow_run] = wait_until(
            lambda: runs_where(lambda run: TRAINED_TAG in run.data.tags), 120, "the job to train to the end"
        )
        run_id, flow_run_id = mlflow_run.info.run_id, mlflow_run.data.tags[FLOW_RUN_TAG]
        wait_until(lambda: "checkpoint" in {a.path for a in mlflow.list_artifacts(run_id)}, 60, "its checkpoint kept")
        flow.kill()
        flow.wait()

        def records() -> tuple[str, int, str]:
            return mlflow.get_run(run_id).info.status, quota_of(pool).active_slots, state_of(flow_run_id).type.value

        polls = []  # ((MLflow status, slots held, flow run state), what `gpuflow status` shows)

        def poll():  # judged only where the records held still while `status` read them
            before = records()
            row = next((row for row in status() if row.flow_run_id == flow_run_id), None)
            if records() == before:
                polls.append((before, row and row.state))
            return polls[-1] if polls else None

        wait_until(lambda: poll() and processes_of(gpuflow_home) == [], 180, "the job and its cluster gone")
        for _ in range(3):
            poll()
        reap_clusters(backends=["local"], tracking_uris=[default_tracking_uri()])
        poll()
    finally:
        stop_all([flow], pool)
    ended = mlflow.get_run(run_id)
    assert (ended.info.status, ended.data.tags[STOPPED_BY_TAG]) == ("FINISHED", "orphaned"), ended.data.tags
    assert flow_run_id in ended.data.tags[STOP_DETAIL_TAG], ended.data.tags
    assert [metric.step for metric in mlflow.get_metric_history(run_id, "loss")] == [0, 1, 2, 3]
    state = state_of(flow_run_id)
    assert state.type.value == "CRASHED", state
    assert polls[-1] == (("FINISHED", 0, "CRASHED"), None), polls
    for (mlflow_status, slots, flow_state), shown in polls:
        assert shown is None or shown.startswith("dead") or (mlflow_status == "RUNNING" and slots == 1), polls
        assert shown is not None or flow_state != "RUNNING", polls  # a live flow run is listed
    assert any(shown and shown.startswith("dead") for _, shown in polls), polls  # seen between the kill and the pass
    assert processes_of(gpuflow_home) == []
