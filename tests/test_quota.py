"""The team's GPU quota on Prefect's global concurrency limits: runs over it wait their turn, in the order they
were submitted, and a run that dies gives its share back once its cluster is gone.

    .venv/bin/python -m pytest --full tests/test_quota.py

On the local backend the quota's unit is the worker: each run here has one, so `gpuflow quota set local N` lets
N runs hold it at once. Runs go through a served deployment of a Prefect server of the test's own.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid

import pytest
import sky
from prefect import flow

from gpuflow.cluster.backends import cluster_name_for
from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.flows.quota.pools import LIMIT_PREFIX, WAITING
from tests.loops import PLAIN_LOOP, WAITING_RUN_OVERRIDES
from tests.support.processes import processes_of, wait_until
from tests.support.repo import REPO
from tests.support.servers import BIN, base_env, gpuflow_serve, prefect_server, prefect_server_process, stable_port
from tests.support.tiers import carrying


def test_a_run_needs_its_clusters_gpus_of_its_pool():
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.flows.quota.pools import lease_seconds, need_of

    loop = {"loop": "experiments.digits:train_loop"}
    remote = {"tracking": {"uri": "http://mlflow.team:5000"}, "storage": {"checkpoints": "s3://team/checkpoints"}}
    local = parse_spec({"train": loop, "compute": {"workers_per_node": 3}})
    assert (need_of(local).pool, need_of(local).slots, need_of(local).describe()) == (
        "local",
        3,
        "3 workers of quota 'local'",
    )
    cloud = parse_spec(
        {
            "train": loop,
            "compute": {"backend": "skypilot", "num_nodes": 2, "accelerators": "H100:8", "cloud": "aws"},
            "limits": {"orphan_grace_minutes": 2},
            **remote,
        }
    )
    assert (need_of(cloud).pool, need_of(cloud).slots, need_of(cloud).unit) == ("aws-h100", 16, "GPU")
    named = parse_spec(
        {
            "train": loop,
            "compute": {
                "backend": "skypilot",
                "accelerators": ["A100:4", "H100:1"],
                "infra": "slurm/skyci",
                "quota": "team-a100",
            },
            **remote,
        }
    )
    assert (need_of(named).pool, need_of(named).slots) == ("team-a100", 4)
    options = parse_spec(
        {
            "train": loop,
            "compute": {
                "backend": "skypilot",
                "options": [  # the first option's pool
                    {"infra": "k8s/ctx", "accelerators": "L4:2"},
                    {"cloud": "aws", "accelerators": "H100:1"},
                ],
            },
            **remote,
        }
    )
    assert (need_of(options).pool, need_of(options).slots) == ("k8s-l4", 2)
    assert (
        lease_seconds(cloud) == 120 + 30 + 600 + 600
        and lease_seconds(
            parse_spec(  # + its autostop and down
                {"train": loop, "limits": {"orphan_grace_minutes": 0.2}}
            )
        )
        == 60
    )  # Prefect's shortest lease


@contextlib.contextmanager
def served_with_quota(tmp_path, size: int, grace_minutes: float = 2):
    """A Prefect server, `gpuflow quota set local SIZE` on it, and `gpuflow serve --limit 5` of run-experiment."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path / "served"
    # a plain Ray Train loop, no data: the queue is the point, not what trains (an epoch a second, a checkpoint each)
    overrides = [
        f"workdir={REPO}",
        f"train.loop={PLAIN_LOOP}",
        "train.epochs=4",
        "train.params={offset: 0, pace_s: 1}",
        *WAITING_RUN_OVERRIDES,
        "compute.workers_per_node=1",
        f"limits.orphan_grace_minutes={grace_minutes}",
        "tracking.register_model=false",
        "data=null",
    ]
    with prefect_server(tmp_path / "prefect") as api_url, temporary_settings({PREFECT_API_URL: api_url}):
        quota = gpuflow("quota", "set", "local", str(size), api_url=api_url, home=home)
        assert quota.returncode == 0 and f"quota local: {size} at once" in quota.stdout, quota.stderr
        with gpuflow_serve(api_url, home, overrides, ("run-experiment",), only=True, limit=5):
            yield api_url, home


def gpuflow(*args: str, api_url: str, home) -> subprocess.CompletedProcess:
    env = base_env(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(home))
    return subprocess.run([str(BIN / "gpuflow"), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def submit(count: int, **train) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("run-experiment/run-experiment")
        spec = {**deployment.parameters["spec"]}
        spec["train"] = {**spec["train"], **train}
        ids = []
        for _ in range(count):  # one after the other: their submission order is their creation order
            ids.append(client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec}).id)
            time.sleep(0.2)
        return ids


def runs_and_held(ids) -> tuple[list, int]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return (
            [client.read_flow_run(run_id) for run_id in ids],
            client.read_global_concurrency_limit_by_name(LIMIT_PREFIX + "local").active_slots,
        )


def steps_of(flow_run_id) -> set[str]:
    """The names of the tasks a flow run ran (provision, open-mlflow-run, ...)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0] for run in runs}


def states_of(flow_run_id) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return sorted(client.read_flow_run_states(flow_run_id), key=lambda state: state.timestamp)


def holding(run) -> bool:
    return bool(
        run.state and run.state.is_running() and run.state.name != WAITING and "holding" in (run.state.message or "")
    )


def test_quota_list_without_a_server_answers_in_a_line_each_time(tmp_path):
    """No Prefect server and no warm stack: the quotas of the database `gpuflow run` uses, on a temporary API, and no
    error on the console: not Prefect's telemetry offline, not a server traceback for a limit the first call made."""
    env = base_env(PREFECT_HOME=str(tmp_path / "prefect"), GPUFLOW_HOME=str(tmp_path / "home"))
    env.pop("PREFECT_API_URL", None)
    for _ in range(2):
        listed = subprocess.run(
            [str(BIN / "gpuflow"), "quota", "list"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
        )
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.strip() == "no quotas: runs never wait (gpuflow quota set POOL SIZE)", listed.stdout
        assert "ERROR" not in listed.stderr and "Traceback" not in listed.stderr, listed.stderr
    assert not (tmp_path / ".gpuflow").exists()  # no reaper pass for a server gone with the command


def test_gpuflow_status_reads_as_a_table():
    from gpuflow.flows.cli.status import RunStatus, table

    rows = [
        RunStatus(
            "digits-mlp-1",
            "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0",
            "Running",
            "local",
            "gpuflow-1 (UP)",
            "1 worker",
            0.5,
            0.0125,
            "alive, renewed 3 s ago (grace 120 s)",
            None,
            "http://mlflow:5000/#/experiments/1/runs/a",
        ),
        RunStatus(
            "digits-mlp-1",
            "9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4",
            WAITING,
            "local",
            gpus="1 worker",
            queue="1 of 1 in local",
            triggered_by="bob",
        ),
    ]
    header, first, second = table(rows).splitlines()
    assert header.split() == "run id state by cluster GPUs $/h spent lease queue MLflow message".split()
    assert second.index("bob") == header.index("by") and first.split()[3] == "-"  # who triggered it, if anyone said
    assert "$0.50" in first and "$0.01" in first and "alive, renewed 3 s ago" in first
    assert first.split()[:2] == ["digits-mlp-1", "0f1e2d3c"] and second.split()[:2] == ["digits-mlp-1", "9a8b7c6d"]
    assert "Waiting for GPUs" in second and "1 of 1 in local" in second
    assert second.index("1 of 1 in local") == header.index("queue")  # columns line up
    assert table([]) == "nothing running or waiting"


@pytest.mark.full
def test_runs_over_the_quota_take_it_in_submission_order_and_a_killed_holders_share_comes_back_after_its_cluster(
    tmp_path,
):
    """A quota of 1 and four runs through the served deployment, one after the other: a long one takes it, the three
    others wait their turn. The last, cancelled while it waits, leaves nothing. The long one is killed (kill -9 of its
    flow): its share comes back once its cluster is gone, and the first waiter takes it, then the second once the
    first gave it back. Both complete, each giving its share back."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    first_held, most = {}, {"held": 0, "holding": 0}
    with served_with_quota(tmp_path, size=1, grace_minutes=0.2) as (api_url, home):
        ids = submit(1, epochs=400) + submit(3)  # the long one a paced run of 400 epochs, the others of 4
        killed, first, second, cancelled = ids

        def look() -> list:
            """The runs, in submission order; every look tallies what Prefect counts and what the runs say."""
            runs, held = runs_and_held(ids)
            most["held"], most["holding"] = max(most["held"], held), max(most["holding"], sum(map(holding, runs)))
            for run in runs:
                if holding(run) or (run.state and run.state.is_final()):
                    first_held.setdefault(run.id, time.monotonic())
            return runs

        last = []

        def lined_up() -> bool:
            last[:] = look()
            return holding(last[0]) and [run.state and run.state.name for run in last[1:]] == [WAITING] * 3

        try:
            wait_until(lined_up, 600, "the long run holding the quota, the three others waiting")
        except AssertionError as error:
            said = [(run.state_name, run.state and run.state.message) for run in last]
            raise AssertionError(f"{error}: {said}") from None
        status = json.loads(gpuflow("status", "--json", api_url=api_url, home=home).stdout)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(cancelled, Cancelling(), force=True)
        flow_process = [
            p
            for p in carrying("PREFECT__FLOW_RUN_ID", str(killed))
            if p.parent() is None or p.parent().environ().get("PREFECT__FLOW_RUN_ID") != str(killed)
        ]
        assert len(flow_process) == 1, flow_process
        os.kill(flow_process[0].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        backend = LocalBackend(home / "clusters")
        cluster = cluster_name_for(str(killed))
        gone = wait_until(
            lambda: cluster not in {c.name for c in backend.status()} and time.monotonic(),
            120,
            "the killed run's cluster gone",
        )
        wait_until(lambda: holding(look()[1]), 180, "the first waiting run taking the quota")
        took_over = time.monotonic()
        runs = wait_until(
            lambda: (runs := look()) and all(run.state and run.state.is_final() for run in runs) and runs,
            600,  # two whole runs, one after the other, on a loaded machine
            "every run over",
        )
        said = [[state.message for state in states_of(run_id)] for run_id in (first, second)]
        steps = {run_id: steps_of(run_id) for run_id in (first, second, cancelled)}
    assert [run.state_name for run in runs[1:3]] == ["Completed"] * 2, [run.state.message for run in runs]
    assert runs[3].state.is_cancelled(), runs[3].state.message
    assert all("gave back 1 worker of quota 'local'" in messages for messages in said), said
    assert most["held"] <= 1, "Prefect counted more slots held than the quota"
    assert most["holding"] <= 1, "more runs said they were holding the quota than it has"  # a run says it gave it back
    assert sorted(ids[:3], key=first_held.get) == ids[:3]  # they got the quota in the order they were submitted
    rows = {row["flow_run_id"]: row for row in status}
    assert [rows[str(run_id)]["state"] for run_id in ids] == ["Running", WAITING, WAITING, WAITING]
    assert [rows[str(run_id)]["queue"] for run_id in ids[1:]] == [f"{n} of 3 in local" for n in (1, 2, 3)]
    assert all(rows[str(run_id)]["gpus"] == "1 worker" for run_id in ids)
    # the cancelled waiter never opened an MLflow run nor asked for a cluster; the ones that took over did both
    assert not {"open-mlflow-run", "provision"} & steps[cancelled]
    assert all({"open-mlflow-run", "provision"} <= steps[run_id] for run_id in (first, second)), steps
    assert took_over >= gone  # never while the killed run's cluster still ran
    # within its lease (Prefect's 60 s minimum), a repossessor pass (15 s) and a loaded machine's polls; a slot held
    # on for the lease a cloud cluster gets (150 s and more) fails this
    assert took_over - killed_at < 60 + 15 + 30
    assert processes_of(home) == []


# -- a slot Prefect counts as held that no run holds (a lease the server forgot): the recount gives it back -----------
@flow(name="quota-holder")
def quota_holder():
    pass


def holder_run(client, pool: str, state, *tags: str):
    """A flow run of the pool's queue in `state`, as flows/experiment.py tags one (the quota's own tags to come)."""
    return client.create_flow_run(quota_holder, tags=[f"quota:{pool}", "backend:local", *tags], state=state)


@pytest.mark.full
def test_a_queue_longer_than_a_page_of_the_server_is_read_whole(prefect_server):
    """A Prefect server answers a read with at most 200 flow runs: the 201st waiter of a pool is still in its queue,
    and first submitted is first."""
    from prefect.client.orchestration import get_client

    from gpuflow.flows.quota.pools import WAIT_TAG_PREFIX, waiting_runs, waiting_state

    pool = f"long-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        made = [holder_run(client, pool, waiting_state("waiting"), WAIT_TAG_PREFIX + pool).id for _ in range(201)]
        queue = waiting_runs(pool, client)
    assert [run.id for run in queue] == made


def quota_of(pool: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def local_spec(pool: str, max_queue_minutes: float = 5):
    from gpuflow.cluster.spec import parse_spec

    return parse_spec(
        {
            "train": {"loop": "experiments.digits:train_loop"},
            "limits": {"max_queue_minutes": max_queue_minutes},
            "compute": {"workers_per_node": 1, "quota": pool},
        }
    )


def quota_list(api_url: str, home) -> subprocess.Popen:
    env = base_env(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(home))
    return subprocess.Popen(
        [str(BIN / "gpuflow"), "quota", "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def test_the_recount_gives_a_leaked_slot_back_once_the_dead_runs_cluster_is_gone(prefect_server, gpuflow_home):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Crashed, Running

    from gpuflow.cluster.config import default_tracking_uri
    from gpuflow.flows.quota.hold import QuotaHold
    from gpuflow.flows.quota.pools import set_quota
    from gpuflow.flows.reaper import reap_clusters
    from gpuflow.flows.reconcile.quota_recount import recount

    pool, api_url = f"recount-{uuid.uuid4().hex[:8]}", PREFECT_API_URL.value()
    set_quota(pool, 3)
    backend = LocalBackend()
    with get_client(sync_client=True) as client:
        live = QuotaHold(local_spec(pool), str(holder_run(client, pool, Running()).id))
        assert live.acquire()  # a real lease, renewed by this process: never given back by a recount
        dead = holder_run(client, pool, Crashed(message="kill -9"), f"quota-held:{pool}", "quota-slots:1")
        # its slot, as Prefect keeps it once it has forgotten the lease: counted, and no lease to give it back
        client.increment_concurrency_slots(names=[LIMIT_PREFIX + pool], slots=1, mode="concurrency")
    cluster = backend.root / cluster_name_for(str(dead.id))  # its cluster, still up: a process of its own
    session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        cluster.mkdir(parents=True)
        (cluster / "cluster.json").write_text(json.dumps({"session": session.pid, "temp_dir": str(cluster / "tmp")}))
        try:
            kept = next(found for found in recount() if found.pool == pool)
            assert (kept.counted, kept.held, kept.freed, quota_of(pool).active_slots) == (2, 2, 0, 2)
            assert backend.down(cluster.name) and session.wait(timeout=10) is not None

            at_once = [quota_list(api_url, gpuflow_home) for _ in range(2)]  # two recounts at once: one gives it back
            outputs = [process.communicate(timeout=120) for process in at_once]
            assert [process.returncode for process in at_once] == [0, 0], outputs
            said = [out for out, _ in outputs if f"quota {pool}: gave back 1 leaked slot(s)" in out]
            assert len(said) == 1, outputs
            assert [line.split()[1:3] for line in said[0].splitlines() if line.startswith(pool)] == [["3", "1"]]
            assert quota_of(pool).active_slots == 1  # the live run's, still held
            again = next(found for found in recount() if found.pool == pool)
            assert (again.counted, again.held, again.freed) == (1, 1, 0)

            with get_client(sync_client=True) as client:  # leaked again: the reaper's pass gives it back too
                client.increment_concurrency_slots(names=[LIMIT_PREFIX + pool], slots=1, mode="concurrency")
            reap_clusters(backends=["local"], tracking_uris=[default_tracking_uri()])
            assert quota_of(pool).active_slots == 1
        finally:
            live.release()
        assert quota_of(pool).active_slots == 0
    finally:
        backend.down(cluster.name)
        session.kill()
        session.wait()
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def test_a_dead_holders_lease_is_given_back_once_and_only_by_the_recount_whose_turn_it_is(prefect_server):
    """Prefect gives a lease back in steps of its own (read, decrement, revoke): two recounts doing it at once could
    both decrement, freeing a live run's slot. A recount gives back only in its turn."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from gpuflow.flows.quota.hold import QuotaHold
    from gpuflow.flows.quota.pools import set_quota
    from gpuflow.flows.reconcile.quota_recount import recount, turn

    pool = f"once-{uuid.uuid4().hex[:8]}"
    set_quota(pool, 2)
    try:
        with get_client(sync_client=True) as client:
            live = QuotaHold(local_spec(pool), str(holder_run(client, pool, Running()).id))
            assert live.acquire()
            dead_run = holder_run(client, pool, Running())
            dead = QuotaHold(local_spec(pool), str(dead_run.id))
            assert dead.acquire()
            dead._stop.set()  # its process is gone: nothing renews or releases its lease
            client.set_flow_run_state(dead_run.id, Crashed(message="kill -9"), force=True)
            with turn(client) as ours:  # another recount is on
                assert ours
                recount()
                assert quota_of(pool).active_slots == 2, "given back outside its turn"
        for _ in range(2):
            recount()
            assert quota_of(pool).active_slots == 1, "the dead run's slot back once, the live run's kept"
        live.release()
        assert quota_of(pool).active_slots == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def test_a_run_whose_lease_is_revoked_stops_and_its_release_frees_nobody_elses_slot(prefect_server):
    """A pass judged the holder dead and gave its lease back (or the lease lapsed): Prefect may give the slot to the
    next run. The holder must not train on over the quota: its stop check fires, naming the quota; its release then
    gives back nothing, not the slot the next run now holds."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from gpuflow.cluster.protocol import QUOTA_LOST, STATUS_FOR_STOP
    from gpuflow.flows.quota.hold import QuotaHold
    from gpuflow.flows.quota.pools import set_quota

    pool = f"revoked-{uuid.uuid4().hex[:8]}"
    set_quota(pool, 1)
    try:
        with get_client(sync_client=True) as client:
            first = QuotaHold(local_spec(pool), str(holder_run(client, pool, Running()).id))
            first.renew_every_s = 0.2  # the lease is renewed every lease_s / 4 (15 s and more)
            assert first.acquire() and first.lost_check() is None
            client.release_concurrency_slots_with_lease(first.lease_id)  # what a pass does to a dead holder
            next_run = QuotaHold(local_spec(pool, max_queue_minutes=0.5), str(holder_run(client, pool, Running()).id))
            assert next_run.acquire()
        reason, detail = wait_until(first.lost_check, 30, "the revoked holder's stop check firing", interval_s=0.2)
        assert (reason, STATUS_FOR_STOP[reason]) == (QUOTA_LOST, "FAILED")
        assert f"the quota lease on 1 worker of quota '{pool}' is gone" in detail, detail
        assert "Checkpoints are kept" in detail, detail
        first.release()
        assert quota_of(pool).active_slots == 1, "the first run's release freed the next run's slot"
        next_run.release()
        assert quota_of(pool).active_slots == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def test_a_replacement_cluster_holds_a_second_share_or_waits_for_the_loss(prefect_server, caplog):
    """A spot notice's replacement bills beside the cluster still training: it holds a second share of the run's
    slots, counted by the recount, given back once the first is down, or by the reaper with the run's own should the
    run die. A full pool gives no second share: the replacement is then not provisioned before the loss."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from gpuflow.cluster.cost.pricing import hourly_cost
    from gpuflow.cluster.run.lifecycle import Lifecycle
    from gpuflow.cluster.run.meter import Meter
    from gpuflow.cluster.run.record import RunRecord
    from gpuflow.flows.capacity.replacement import Replacement
    from gpuflow.flows.capacity.waiting import Capacity
    from gpuflow.flows.quota.hold import QuotaHold
    from gpuflow.flows.quota.pools import set_quota
    from gpuflow.flows.reconcile.quota_recount import recount

    pool = f"replace-{uuid.uuid4().hex[:8]}"
    set_quota(pool, 3)
    try:
        with get_client(sync_client=True) as client:
            first_run = holder_run(client, pool, Running())
            first = QuotaHold(local_spec(pool), str(first_run.id))
            assert first.acquire() and first.hold_for_replacement()
            assert quota_of(pool).active_slots == 2
            recount()
            assert quota_of(pool).active_slots == 2, "the replacement's share was freed as a leak"
            second = QuotaHold(local_spec(pool), str(holder_run(client, pool, Running()).id))
            assert second.acquire() and not second.hold_for_replacement()
            assert quota_of(pool).active_slots == 3, "a full pool gave a second share"

            spec = local_spec(pool)
            life = Lifecycle("gpuflow-x", down=lambda name: True, meter=Meter(hourly_cost(spec)))
            capacity = Capacity(RunRecord(spec, second.flow_run_id), life, lambda name, msg: None, quota=second)
            replacement = Replacement(capacity, "gpuflow-x-r1", {}, 0)
            caplog.set_level("WARNING", logger="gpuflow")
            replacement.provision("notice", "spot notice on node 1")
            assert replacement.take() is None, "a replacement was provisioned without slots"
            assert f"quota {pool!r} has no room for a second cluster" in caplog.text, caplog.text

            first.give_back_replacement()
            assert quota_of(pool).active_slots == 2
            assert first.hold_for_replacement()  # room again; then the run dies holding both shares
            first._stop.set()  # its process is gone: nothing renews or releases its leases
            client.set_flow_run_state(first_run.id, Crashed(message="kill -9"), force=True)
        recount()  # no backend lists a cluster of the dead run: both its shares come back, the live run's stays
        assert quota_of(pool).active_slots == 1
        second.release()
        assert quota_of(pool).active_slots == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


HOLD = """
import sys, time
from gpuflow.flows.quota.hold import QuotaHold, QueueTimeout
from tests.test_quota import local_spec
hold = QuotaHold(local_spec(sys.argv[1], max_queue_minutes=float(sys.argv[3])), sys.argv[2])
hold.renew_every_s = 0.5  # the lease's length as a run's; renewed more often, so a test sees what a renewal meets
started = time.monotonic()
try:
    print("held" if hold.acquire() else "no quota", f"after {time.monotonic() - started:.1f} s", flush=True)
except QueueTimeout:
    print("timed out", flush=True)
    sys.exit(0)
sys.stdin.readline()  # until told
print("lost" if hold.lost_check() else "held on", flush=True)
hold.release()
print("released", flush=True)
"""


def holder(api_url: str, pool: str, flow_run_id, max_queue_minutes: float = 5) -> subprocess.Popen:
    """A process that takes the pool's quota for a flow run (QuotaHold), says so, and gives it back when told."""
    return subprocess.Popen(
        [str(BIN / "python"), "-c", HOLD, pool, str(flow_run_id), str(max_queue_minutes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=base_env(PREFECT_API_URL=api_url),
        start_new_session=True,
    )


def held_across_a_restart(tmp_path, lease_storage: str | None = None, recount_after: bool = False) -> str:
    """A run holds the one slot of a quota; its Prefect server is killed (SIGKILL) and restarted on the same
    database; the holder gives the slot back (recount_after: its run ends, and the quota is recounted) and another
    run asks for it: what that run says."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Completed, Running

    from gpuflow.flows.deployments.known_servers import forgetful_server
    from gpuflow.flows.quota.pools import set_quota
    from gpuflow.flows.reconcile.quota_recount import recount

    home, port, pool = tmp_path / "prefect", stable_port(), "restarted"
    processes = []
    try:
        with (
            prefect_server_process(home, port, lease_storage) as (server, api_url),
            temporary_settings({PREFECT_API_URL: api_url}),
        ):
            set_quota(pool, 1)
            with get_client(sync_client=True) as client:
                first, second = (holder_run(client, pool, Running()).id for _ in range(2))
                warning = forgetful_server(client)  # what `gpuflow quota set` and a serve's start say of it
            processes.append(holder(api_url, pool, first))
            assert processes[0].stdout.readline().startswith("held"), "the first run never held the slot"
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        with prefect_server(home, port, lease_storage) as api_url, temporary_settings({PREFECT_API_URL: api_url}):
            time.sleep(2)  # renewals meet the restarted server: a lease it forgot was not given to another run
            processes[0].stdin.write("release\n")
            processes[0].stdin.flush()
            assert processes[0].stdout.readline() == "held on\n", "a server restart stopped the holder"
            assert processes[0].stdout.readline() == "released\n"
            if recount_after:
                with get_client(sync_client=True) as client:
                    client.set_flow_run_state(first, Completed(), force=True)
                assert [(found.pool, found.freed) for found in recount()] == [(pool, 1)]
            processes.append(holder(api_url, pool, second, max_queue_minutes=0.5))
            said = processes[1].stdout.readline().strip()
            if said.startswith("held"):
                processes[1].communicate("release\n", timeout=60)
            return said, warning
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.mark.full
def test_a_slot_held_when_the_prefect_server_restarts_is_given_back(tmp_path):
    # with Prefect's default in-memory lease storage the restart forgets the lease: the release gives nothing back
    # and the second run times out waiting
    said, warning = held_across_a_restart(tmp_path)
    assert said.startswith("held"), said
    assert float(said.split()[-2]) < 40, said  # at once, not after a lease's expiry (60 s and more)
    assert warning is None  # leases on disk: nothing to warn of


@pytest.mark.full
def test_a_slot_that_a_server_restart_leaked_is_given_back_by_the_recount(tmp_path):
    said, warning = held_across_a_restart(
        tmp_path, "prefect.server.concurrency.lease_storage.memory", recount_after=True
    )
    assert said.startswith("held") and float(said.split()[-2]) < 40, said
    assert "keeps concurrency leases in memory" in warning and "lease_storage.filesystem" in warning


@pytest.mark.full
def test_a_run_waiting_for_the_quota_holds_no_cluster(tmp_path):
    """`gpuflow run` starts its local cluster early, while Prefect's API and the flow start; a run that then has to
    wait for the quota gives that cluster back first: while it waits it holds nothing, spare or not."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Running

    from gpuflow.flows.quota.pools import set_quota

    home = tmp_path / "home"
    with prefect_server(tmp_path / "prefect") as api_url, temporary_settings({PREFECT_API_URL: api_url}):
        set_quota("local", 1)
        with get_client(sync_client=True) as client:
            taken = holder(api_url, "local", holder_run(client, "local", Running()).id)
        run = None
        try:
            assert taken.stdout.readline().startswith("held")
            run = subprocess.Popen(
                [str(BIN / "gpuflow"), "run", "experiments/digits.yaml", "--set", "compute.workers_per_node=1"],
                cwd=REPO,
                start_new_session=True,
                env=base_env(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(home)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

            def waiting():
                with get_client(sync_client=True) as client:
                    return [
                        r
                        for r in client.read_flow_runs(
                            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["quota-wait:local"]))
                        )
                        if r.state and r.state.name == WAITING
                    ]

            wait_until(waiting, 120, "the run waiting for the quota")
            # the wait is stamped after the early cluster went: none is left while it waits
            assert LocalBackend(home / "clusters").status() == []
            assert not any("raylet" in " ".join(process.cmdline()) for process in carrying("GPUFLOW_HOME", str(home)))
        finally:
            if run is not None:
                os.killpg(run.pid, signal.SIGTERM)
                run.wait(timeout=120)
            taken.stdin.write("release\n")
            taken.stdin.flush()
            taken.wait(timeout=30)
    wait_until(lambda: processes_of(home) == [], 60, "nothing of the run left")


@pytest.mark.full
def test_a_dead_runs_slot_comes_back_only_once_its_cloud_cluster_is_gone(prefect_server, gpuflow_home, monkeypatch):
    """A holder dies (no one renews its lease) while its SkyPilot cluster lives on, and deleting it takes longer than
    the job's orphan grace: the reaper's pass downs it, and the slot comes back once it is gone, never before (its
    GPUs would bill beside the next run's)."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from gpuflow.cluster.backends.skypilot import SkyPilotBackend
    from gpuflow.cluster.config import default_tracking_uri
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.flows.quota.hold import QuotaHold
    from gpuflow.flows.quota.pools import set_quota
    from gpuflow.flows.reaper import reap_clusters
    from tests.support.sky_double import FakeSky

    pool = f"cloud-{uuid.uuid4().hex[:8]}"
    fake = FakeSky(down_s=100)  # past the old lease (grace + 30 s, Prefect's 60 s at least) and its repossessor's pass
    monkeypatch.setattr("gpuflow.cluster.backends.skypilot.load_sdk", lambda: fake)
    spec = parse_spec(
        {
            "train": {"loop": "experiments.digits:train_loop"},
            "compute": {"backend": "skypilot", "infra": "aws", "accelerators": "H100:1", "quota": pool},
            "limits": {"orphan_grace_minutes": 0.2, "idle_minutes_to_autostop": 1, "hourly_rate_usd": 2.0},
            "tracking": {"uri": "http://127.0.0.1:1"},
            "storage": {"checkpoints": "s3://bucket/ckpt"},
        }
    )
    set_quota(pool, 1)
    try:
        with get_client(sync_client=True) as client:
            run_id = str(
                client.create_flow_run(quota_holder, tags=[f"quota:{pool}", "backend:skypilot"], state=Running()).id
            )
            hold = QuotaHold(spec, run_id)
            assert hold.acquire()
            hold._stop.set()  # its process dies: the lease is renewed no more
            client.set_flow_run_state(run_id, Crashed(message="kill -9"), force=True)
        cluster = cluster_name_for(run_id)
        fake.clusters[cluster] = {
            "name": cluster,
            "status": sky.ClusterStatus.UP,
            "launched_at": int(time.time()),
            "autostop": 1,
            "to_down": True,
            "jobs": {},
            "spot": False,
        }
        samples, done = [], threading.Event()

        def sample():
            while not done.is_set():
                listed = cluster in {c.name for c in SkyPilotBackend(fake).status()}
                samples.append((listed, quota_of(pool).active_slots))
                done.wait(2)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            reap_clusters(backends=["skypilot"], tracking_uris=[default_tracking_uri()])
        finally:
            done.set()
            sampler.join()
        assert cluster not in fake.clusters and sum(listed for listed, _ in samples) > 30, samples
        assert all(slots == 1 for listed, slots in samples if listed), f"the slot came back first: {samples}"
        assert quota_of(pool).active_slots == 0  # and back once the cluster was gone, in the same pass
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def test_a_run_the_quota_cannot_take_fails_saying_what_it_needs_who_holds_it_and_the_fix(prefect_server, gpuflow_home):
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from gpuflow.flows.experiment import run_experiment
    from gpuflow.flows.quota.hold import QueueTimeout, QuotaHold
    from gpuflow.flows.quota.pools import set_quota

    pool = f"small-{uuid.uuid4().hex[:8]}"
    set_quota(pool, 1)
    try:
        with get_client(sync_client=True) as client:
            held_by = holder_run(client, pool, Running(), f"quota-held:{pool}", "triggered-by:alice")
            client.increment_concurrency_slots(names=[LIMIT_PREFIX + pool], slots=1, mode="concurrency")
            waiter = holder_run(client, pool, Running())
        with pytest.raises(QueueTimeout) as timed_out:  # the slot is taken: waits its 1.2 s, then says why
            QuotaHold(local_spec(pool, max_queue_minutes=0.02), str(waiter.id)).acquire()
        assert str(timed_out.value).startswith(
            f"the run needs 1 worker, quota '{pool}' is 1 with 1 held, held by "
            f"{held_by.name} (alice), 0 run(s) ahead; waited 0.02 min"
        )
        assert f"raise limits.max_queue_minutes or the quota (gpuflow quota set {pool} N)" in str(timed_out.value)

        too_big = local_spec(pool).model_dump(mode="json", exclude={"secrets"})
        too_big["compute"].update(workers_per_node=2, num_workers=2)
        too_big["limits"]["max_queue_minutes"] = 0.02  # should it wait after all, not for 5 min
        state = run_experiment(spec=too_big, return_state=True)  # a real flow run: its state is what the UI shows
        assert state.is_failed()
        assert state.message == (
            f"the run needs 2 workers, quota '{pool}' is 1, held by {held_by.name} (alice): it "
            f"can never start; make the cluster smaller (compute), or raise the quota: gpuflow "
            f"quota set {pool} 2"
        )
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(LIMIT_PREFIX + pool)


def test_a_run_started_through_a_deployment_is_recorded_as_its_callers(
    prefect_server, gpuflow_home, monkeypatch, capsys
):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from gpuflow.cluster.protocol import TRIGGERED_BY_TAG, triggered_by
    from gpuflow.flows.cli import main
    from gpuflow.flows.deployments.deploy import runner_deployments

    monkeypatch.chdir(REPO)
    assert main(["run", "--deployment", "run-experiment/no-such-name"]) == 2
    assert "no deployment 'run-experiment/no-such-name' on the Prefect server at" in capsys.readouterr().err
    deployment_id = runner_deployments(only=["run-experiment"])[0].apply()
    # a field its form_policy fixes: refused here, naming it, nothing triggered (the serve would fail the run)
    assert main(["run", "--deployment", "run-experiment/run-experiment", "--set", "storage.checkpoints=/tmp/x"]) == 2
    assert "storage.checkpoints: deployment 'run-experiment' fixes this field" in capsys.readouterr().err
    with get_client(sync_client=True) as client:
        assert (
            client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))) == []
        )
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    assert main(["run", "--deployment", "run-experiment/run-experiment", "--set", "train.epochs=3"]) == 0
    said = capsys.readouterr().out
    [flow_run_id] = re.findall(r"gpuflow: started flow run ([0-9a-f-]{36}) of run-experiment/run-experiment", said)
    assert "follow it with `gpuflow status`, or at " in said, said
    # registered, and served by nobody (no serve here): the user is told the run waits for one
    assert "run-experiment/run-experiment is polled by no serve now: the run waits, Scheduled" in said, said
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        client.delete_flow_run(flow_run.id)  # nothing serves it here: no run left scheduled
    assert triggered_by(flow_run.tags) == "bob" and flow_run.parameters["spec"]["train"]["epochs"] == 3
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")  # the serve's user is another: the trigger's is what is recorded

    from gpuflow.tasks.tracking import open_mlflow_run

    spec = local_spec("any")
    run = open_mlflow_run(spec, "gpuflow-x", {"id": flow_run_id, "name": flow_run.name, "triggered_by": "bob"})
    tags = MlflowClient(spec.tracking_uri).get_run(run.run_id).data.tags
    assert tags[TRIGGERED_BY_TAG] == "bob"
    from gpuflow.cluster.cost.history import identity_tags

    assert identity_tags(spec).items() <= tags.items()  # what later runs are predicted from
