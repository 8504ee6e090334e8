"""The local backend starts real Ray processes on 127.0.0.1 and leaves none behind."""

import json
import subprocess
import sys
import time

import psutil
import pytest

from gpuflow.cluster.backends import cluster_name_for, flow_run_id_of
from gpuflow.cluster.backends.local import LocalBackend, ray_env
from gpuflow.cluster.spec import parse_spec
from tests.support.processes import alive, wait_until
from tests.support.repo import A_LOOP, REPO

NAME = cluster_name_for("0d5f6a0e-1b1c-4c2e-9a55-2f2d1c3b4a59")


def test_cluster_names_encode_the_flow_run():
    assert NAME == "gpuflow-0d5f6a0e1b1c4c2e9a552f2d1c3b4a59"
    assert flow_run_id_of(NAME) == "0d5f6a0e-1b1c-4c2e-9a55-2f2d1c3b4a59"
    assert flow_run_id_of("my-own-cluster") is None


@pytest.mark.full
def test_up_down_leaves_no_ray_process(gpuflow_home):
    backend = LocalBackend()
    spec = parse_spec({**A_LOOP, "compute": {"workers_per_node": 1}})
    handle = backend.launch(spec, NAME)
    pids = backend.pids(NAME)
    try:
        assert handle.address.startswith("127.0.0.1:")
        assert len(alive(pids)) >= 3  # supervisor, gcs_server, raylet at least
        # lean by default (GPUFLOW_LOCAL_RAY): no autoscaler monitor on a cluster whose nodes are fixed
        commands = [" ".join(psutil.Process(pid).cmdline()) for pid in alive(pids)]
        assert any("raylet" in command for command in commands), commands
        assert not any("autoscaler/_private/monitor.py" in command for command in commands), commands
        assert [c.status for c in backend.status() if c.name == NAME] == ["UP"]
        assert backend.launch(spec, NAME).address == handle.address  # same name: same cluster
    finally:
        assert backend.down(NAME) is True
    assert alive(pids) == []
    assert backend.down(NAME) is False  # twice is fine
    assert backend.status() == []


@pytest.mark.full
def test_two_nodes_are_two_ray_nodes(gpuflow_home):
    backend = LocalBackend()
    handle = backend.launch(parse_spec({**A_LOOP, "compute": {"num_nodes": 2, "workers_per_node": 1}}), NAME)
    pids = backend.pids(NAME)
    # A driver in its own process, as the job is: Ray reads its address settings at import.
    driver = (
        f"import json, ray; ray.init(address='{handle.address}', logging_level='ERROR'); "
        "print(json.dumps([n for n in ray.nodes() if n['Alive']]))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", driver], env=ray_env(), capture_output=True, text=True, timeout=120)
        nodes = json.loads(out.stdout.strip().splitlines()[-1])
        assert len(nodes) == 2
        assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
        assert [n["Resources"]["CPU"] for n in nodes] == [1.0, 1.0]
    finally:
        backend.down(NAME)
    assert alive(pids) == []


@pytest.mark.full
def test_down_of_a_half_made_cluster(gpuflow_home):
    """A record whose processes never started (a crash mid-launch) is cleaned up without error."""
    backend = LocalBackend()
    folder = backend.root / NAME
    folder.mkdir(parents=True)
    (folder / "cluster.json").write_text('{"session": 999999, "temp_dir": "/tmp/does-not-exist", "jobs": {}}')
    assert backend.down(NAME) is True
    assert not folder.exists()


def test_a_down_never_signals_a_session_that_got_a_recorded_pid_since(gpuflow_home):
    """A cluster's record names its session and jobs by pid and start time: once they are gone, their pids may be
    other sessions' (the machine's pids wrap), which a down of the stale record must leave alone."""
    backend = LocalBackend()
    folder = backend.root / NAME
    folder.mkdir(parents=True)
    others = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]  # each its own session
    try:
        record = {
            "session": others[0].pid,
            "session_started": 1.0,  # the cluster's session started then: not this one
            "temp_dir": "/tmp/does-not-exist",
            "jobs": {str(others[1].pid): {"log": "job.log", "run_name": "r", "started": 1.0}},
        }
        (folder / "cluster.json").write_text(json.dumps(record))
        backend.down(NAME)
        assert not folder.exists()
        assert [other.poll() for other in others] == [None, None], "a session that is not the cluster's was killed"
    finally:
        for other in others:
            other.kill()
            other.wait()


def test_status_lists_what_is_there_while_folders_come_and_go(gpuflow_home, monkeypatch):
    """A folder renamed (a spare claimed) or removed (downed) while status lists the clusters is not listed, and the
    listing goes on: the warm stack's idle check lists them every second, and a listing that raised stopped the stack
    and its API under a run starting on it."""
    backend = LocalBackend()
    for name in ("gpuflow-warm-claimed", "gpuflow-new"):
        (backend.root / name).mkdir(parents=True)
    read = LocalBackend.record

    def read_as_it_goes(self, name):
        if name == "gpuflow-warm-claimed":  # claimed between the listing and this read
            (self.root / name).rmdir()
        return read(self, name)

    monkeypatch.setattr(LocalBackend, "record", read_as_it_goes)
    assert [(s.name, s.status) for s in backend.status()] == [("gpuflow-new", "INIT")]


def test_a_cluster_whose_folder_cannot_be_removed_is_not_down_until_it_is(gpuflow_home):
    """A down that cannot remove the cluster's state raises, naming it (the run's teardown then fails, and its quota
    slot stays held): it never says down while anything of the cluster is left. Pinned as the chaos soak pins it."""
    backend = LocalBackend()
    folder = backend.root / NAME
    folder.mkdir(parents=True)
    session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    (folder / "cluster.json").write_text(json.dumps({"session": session.pid, "temp_dir": "", "jobs": {}}))
    pin = folder / "pinned"
    pin.touch()
    if subprocess.run(["chattr", "+i", str(pin)], capture_output=True).returncode:
        session.kill()
        pytest.skip("chattr +i is not allowed here (it needs root and a filesystem with immutable files)")
    try:
        with pytest.raises(OSError, match=f"local cluster {NAME}: its folder .* could not be removed"):
            backend.down(NAME)
        assert session.wait(timeout=10) is not None, "its processes are stopped all the same"
        # still listed, by its record (kept to the last): gone, and orphaned once the process that launched it is
        assert [(c.name, c.status) for c in backend.status()] == [(NAME, "GONE")], "a cluster not down is listed"
        with pytest.raises(OSError, match="could not be removed"):
            backend.down(NAME)
    finally:
        subprocess.run(["chattr", "-i", str(pin)], check=True)
    assert backend.down(NAME) is True
    assert backend.status() == [] and not folder.exists()


def test_an_early_job_handed_a_run_takes_its_environment_and_keeps_what_it_set_itself(monkeypatch):
    from gpuflow.cluster.backends.local.early_job import handoff_environment

    started_with = {"ONLY_THE_STARTERS": "1", "BOTH": "starter's"}
    for name in ("ONLY_THE_STARTERS", "BOTH", "SET_BY_THE_JOB", "THE_RUNS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONLY_THE_STARTERS", "1")
    monkeypatch.setenv("BOTH", "starter's")
    monkeypatch.setenv("SET_BY_THE_JOB", "0.1")  # e.g. Ray Train's health-check interval, set before Ray's import
    handoff_environment(started_with, {"BOTH": "run's", "THE_RUNS": "2"})
    import os

    assert (
        os.environ.get("ONLY_THE_STARTERS"),
        os.environ["BOTH"],
        os.environ["SET_BY_THE_JOB"],
        os.environ["THE_RUNS"],
    ) == (None, "run's", "0.1", "2")


def test_an_early_job_is_taken_over_only_if_it_read_the_same_at_start(monkeypatch):
    from gpuflow.cluster.backends.local.early_job import environment_digest
    from gpuflow.cluster.config import STARTING_ENVIRONMENT

    before = environment_digest()
    monkeypatch.setenv("RAY_CLIENT_MODE", "0")  # set by Ray's import in this process: not what it was started with
    assert environment_digest() == before
    monkeypatch.setitem(STARTING_ENVIRONMENT, "MLFLOW_TRACKING_PASSWORD", "another")  # read when used: handed over
    monkeypatch.setitem(STARTING_ENVIRONMENT, "PREFECT_API_URL", "http://127.0.0.1:1/api")
    assert environment_digest() == before
    monkeypatch.setitem(STARTING_ENVIRONMENT, "PYTHONPATH", "/elsewhere")  # read as Python starts: another job
    assert environment_digest() != before


def test_a_spare_serves_only_a_run_whose_own_cluster_would_get_the_same_environment(gpuflow_home, monkeypatch):
    """The warm stack's spare runs its Ray processes (and a run's workers, forked from them) with the environment of
    the shell that left the stack: a run from a shell with other values starts its own cluster instead. Prefect's
    settings reach no Ray process, and do not count. And a spare is claimed only once the stack offers it (up, its
    early job started): a run that took it as it started crashed the stack, whose API other runs were using."""
    import os

    from gpuflow.cluster.backends.local import shape_of
    from gpuflow.cluster.backends.local.warm import SPARE_PREFIX
    from gpuflow.cluster.config import STARTING_ENVIRONMENT

    backend = LocalBackend()
    spec = parse_spec({**A_LOOP, "compute": {"workers_per_node": 1}})
    monkeypatch.setitem(STARTING_ENVIRONMENT, "OMP_NUM_THREADS", "1")  # the shell that left the stack
    backend.start_shaped(shape_of(spec), SPARE_PREFIX + "test", os.getpid())
    pids, claimed = backend.pids(SPARE_PREFIX + "test"), None
    try:
        assert backend.claim_spare(spec) is None  # still starting: the stack writes its record until it offers it
        backend.offer_spare(SPARE_PREFIX + "test")
        monkeypatch.setitem(STARTING_ENVIRONMENT, "OMP_NUM_THREADS", "4")  # this run's shell
        assert backend.claim_spare(spec) is None
        monkeypatch.setitem(STARTING_ENVIRONMENT, "OMP_NUM_THREADS", "1")
        monkeypatch.setitem(STARTING_ENVIRONMENT, "PREFECT_HOME", "/another/prefect/home")
        claimed = backend.claim_spare(spec)
        assert claimed and claimed.startswith("gpuflow-warm-"), claimed
    finally:
        for name in (SPARE_PREFIX + "test", claimed):
            if name:
                backend.down(name)
    assert alive(pids) == []


SLOW_PRELOAD = """
import importlib.abc, os, sys, time

class SlowRayTrainTorch(importlib.abc.MetaPathFinder):
    # An early job's preload, at its slowest: ray.train.torch (torch's import) takes 8 s to find, in the job only
    def find_spec(self, name, path, target=None):
        if name == "ray.train.torch" and "--handoff" in sys.argv:
            with open(os.environ["SLOW_PRELOAD_MARKS"], "a") as marks:
                marks.write(f"{time.time()} ")
                marks.flush()
                time.sleep(8)
                marks.write(f"{time.time()}\\n")
        return None

sys.meta_path.insert(0, SlowRayTrainTorch())
"""


@pytest.mark.full
def test_a_run_handed_to_an_early_job_in_the_middle_of_its_preload_trains_and_is_tracked(
    gpuflow_home, tmp_path, monkeypatch
):
    """The warm path's worst moment, made certain: the run comes while the early job's background import of Ray
    Train's torch module is at its slowest (held 8 s by an import hook on its path). The job's own imports of the same
    wait for it (`after_background_imports`): the run trains and every report reaches MLflow."""
    from mlflow import MlflowClient

    from gpuflow.cluster.config import STARTING_ENVIRONMENT

    hooks, marks = tmp_path / "hooks", tmp_path / "marks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_PRELOAD)
    for name, value in (("PYTHONPATH", str(hooks)), ("SLOW_PRELOAD_MARKS", str(marks))):
        monkeypatch.setitem(STARTING_ENVIRONMENT, name, value)  # the shell that left the stack: its early job's
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment("handover", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    spec = parse_spec(
        {
            "train": {"loop": "tests.loops.plain:epochs_with_checkpoints", "epochs": 2, "params": {"offset": 0.0}},
            "workdir": str(REPO),
            "compute": {"workers_per_node": 1},
            "limits": {"orphan_grace_minutes": 30},  # no flow renews this job's lease
        }
    )
    backend = LocalBackend()
    handle = backend.launch(spec, NAME)
    try:
        backend.start_early_job(NAME, str(REPO))
        [early] = backend.record(NAME)["jobs"]
        wait_until(lambda: marks.exists() and marks.read_text(), 120, "the early job's preload at its slowest")
        handed_at = time.time()
        env = {"MLFLOW_TRACKING_URI": tracking_uri, "GPUFLOW_MLFLOW_RUN_ID": run_id}
        job, lines = backend.exec(handle, spec, "handed-over", env), []
        assert job == early, "the run went to the early job"
        assert backend.tail_logs(handle, job, lines.append) == 0, "\n".join(lines[-60:])
    finally:
        backend.down(NAME)
    [(slow_from, slow_to)] = [tuple(map(float, line.split())) for line in marks.read_text().splitlines()]
    assert slow_from < handed_at < slow_to, "handed over while the preload was held"
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert losses == [(0, 0.0), (1, 1.0)], losses


RACE = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from gpuflow.cluster.util.preload import after_background_imports, import_in_background

import_in_background("ring_b")  # as an early job preloads MLflow while it waits for its run


def guard_client():  # a function of the job that imports what the preload imports, from the other end
    import ring_a

    return ring_a.get()


outcome = []
declared = after_background_imports(guard_client) if sys.argv[2] == "declared" else guard_client
thread = threading.Thread(target=lambda: outcome.append(declared()))
thread.start()
thread.join()
print(outcome)
"""


def test_a_function_declared_after_the_background_imports_never_meets_a_half_imported_module(tmp_path):
    """An early job handed its run at once: its preload is still importing when the job's own code imports the same
    package from the other end (MLflow's modules, another order). A function declared `after_background_imports`
    runs once the preload is done; one that is not meets a half-imported module."""
    ring_a = "import time\ntime.sleep(0.3)\nimport ring_b\nX = 1\n\n\ndef get():\n    return ring_b.Y\n"
    (tmp_path / "ring_a.py").write_text(ring_a)
    (tmp_path / "ring_b.py").write_text("import time\ntime.sleep(0.3)\nfrom ring_a import X\ntime.sleep(0.3)\nY = 2\n")
    for how, returned, raised in (("declared", "[2]", None), ("undeclared", "[]", "Error")):
        done = subprocess.run([sys.executable, "-c", RACE, str(tmp_path), how], capture_output=True, text=True)
        assert done.stdout.strip() == returned, (how, done.stdout, done.stderr[-2000:])
        assert raised is None or raised in done.stderr, (how, done.stderr[-2000:])


def test_the_local_ray_is_lean_unless_asked_for_in_full(monkeypatch):
    from gpuflow.cluster.backends.local.early_job import LEAN_RAY
    from gpuflow.cluster.config import SettingError

    monkeypatch.delenv("GPUFLOW_LOCAL_RAY", raising=False)
    monkeypatch.delenv("RAY_enable_metrics_collection", raising=False)
    monkeypatch.setenv("RAY_TRAIN_METRICS_ENABLED", "1")  # the user's own value
    lean = ray_env()
    assert lean["RAY_enable_metrics_collection"] == "0" and lean["RAY_TRAIN_METRICS_ENABLED"] == "1"
    monkeypatch.setenv("GPUFLOW_LOCAL_RAY", "Full")
    assert not {name for name in LEAN_RAY if name in ray_env()} - {"RAY_TRAIN_METRICS_ENABLED"}
    monkeypatch.setenv("GPUFLOW_LOCAL_RAY", "tiny")
    with pytest.raises(SettingError, match="GPUFLOW_LOCAL_RAY='tiny': set it to lean or full"):
        ray_env()


def test_a_runs_trainer_starts_no_actor_it_does_not_use():
    """Ray Train's placement-group cleaner never, its dataset manager only for a run with datasets (each a worker
    process of its own), and only where one streams; everything else Ray Train starts with stays."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from gpuflow.cluster.util.ray_train_internals import without_unused_actors

    def kinds(trainer_class, **datasets) -> set[type]:
        return {
            type(callback) for callback in trainer_class(lambda: None, datasets=datasets)._create_default_callbacks()
        }

    lean = without_unused_actors(TorchTrainer)
    assert lean.__name__ == "TorchTrainer" and issubclass(lean, TorchTrainer)
    everything = kinds(TorchTrainer)
    assert {PlacementGroupCleanerCallback, DatasetsCallback} <= everything
    assert kinds(lean) == everything - {PlacementGroupCleanerCallback, DatasetsCallback}
    with_data = kinds(lean, train=[1, 2])
    (datasets_callback,) = with_data - everything  # its tables split by the controller (tests/test_ingest.py)
    assert issubclass(datasets_callback, DatasetsCallback)
    assert with_data - {datasets_callback} == everything - {PlacementGroupCleanerCallback, DatasetsCallback}


def test_a_fixed_size_run_without_data_asks_no_autoscaler_for_its_workers(monkeypatch):
    """Ray Train's fixed policy starts Ray Data's AutoscalingCoordinator actor to request resources from an autoscaler
    our clusters do not have: the lean trainer's policy sizes the worker group the same and sends nothing (a request
    would fail here: no Ray is up). An elastic run keeps Ray's own policy, which reads the coordinator, and so does a
    run with datasets, whose ingest reads the request."""
    from types import SimpleNamespace

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy, FixedScalingPolicy
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        TrainAutoscalingCoordinatorClient,
    )
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from gpuflow.cluster.util.ray_train_internals import without_unused_actors

    def no_request(*_, **__):
        raise AssertionError("a resource request was sent")

    monkeypatch.setattr(TrainAutoscalingCoordinatorClient, "send_resource_request", no_request)
    monkeypatch.setattr(TrainAutoscalingCoordinatorClient, "cancel_resource_request", no_request)
    handed = []
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller", lambda _, **kw: handed.append(kw))
    lean = without_unused_actors(TorchTrainer)
    for workers, datasets in ((3, {}), ((1, 3), {}), (3, {"train": [1, 2]})):
        config = ScalingConfig(num_workers=workers)
        policy = FixedScalingPolicy(config) if workers == 3 else ElasticScalingPolicy(config)
        trainer = lean(lambda: None, scaling_config=config, datasets=datasets)
        trainer._initialize_and_run_controller(scaling_policy=policy)
    fixed, elastic, with_data = (kw["scaling_policy"] for kw in handed)
    assert isinstance(fixed, FixedScalingPolicy) and type(fixed) is not FixedScalingPolicy
    assert type(elastic) is ElasticScalingPolicy and type(with_data) is FixedScalingPolicy  # Ray Data reads its request
    fixed.after_controller_start(SimpleNamespace(run_id="r"))
    assert fixed.make_decision_for_non_running_worker_group().num_workers == 3
    fixed.before_controller_abort()
