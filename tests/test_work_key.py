"""A run's work key (cluster/rerun/work_key.py): what changes it and what does not, on a real git repository and real
Parquet data; the lookups of a finished run by it, in a real local MLflow store. No cluster, no server."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from gpuflow.cluster.lineage import source_tags, uncommitted_changes
from gpuflow.cluster.protocol import WORK_KEY_MISSING_TAG, WORK_KEY_TAG, WORK_KEY_WITHOUT_EPOCHS_TAG
from gpuflow.cluster.rerun.sweep_reuse import finder, trial_plan
from gpuflow.cluster.rerun.work_key import WorkKey, finished_run_with_key, run_to_continue, work_key
from gpuflow.cluster.spec import ExperimentSpec

LOOP = "from helper import SCALE\n\n\ndef train_loop(config):\n    return SCALE * config['lr']\n"


def git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


def write_data(path, x):
    pq.write_table(pa.table({"x": x, "label": [value % 2 for value in x]}), path)


@pytest.fixture
def project(tmp_path):
    """A repository whose workdir (src/) holds a loop importing a committed helper; its data outside the repository,
    so that only the data's digest, never the diff, can see the data change."""
    repo, data = tmp_path / "repo", tmp_path / "train.parquet"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "loop.py").write_text(LOOP)
    (repo / "src" / "helper.py").write_text("SCALE = 1\n")
    (repo / "README.md").write_text("a project\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    write_data(data, list(range(100)))
    return repo, data


def spec_of(project, **changes) -> ExperimentSpec:
    repo, data = project
    raw = {
        "name": "keyed",
        "train": {"loop": "loop:train_loop", "epochs": 3, "lr": 0.01, "params": {"seed": 7}},
        "data": {"train": str(data)},
        "workdir": str(repo / "src"),
        **changes,
    }
    return ExperimentSpec.model_validate(raw)


def key_of(spec: ExperimentSpec) -> WorkKey:
    """The key as open_mlflow_run computes it: from the run's source tags and its diff."""
    tags = source_tags(spec.workdir)
    changes, diff = uncommitted_changes(spec.workdir)
    return work_key(spec, {**tags, **changes}, diff)


def test_the_reuse_check_computes_the_key_the_run_records(project):
    from gpuflow.cluster.rerun.reuse import key_here

    assert key_here(spec_of(project)) == key_of(spec_of(project))


def test_a_tracking_server_that_cannot_be_read_makes_the_run_train_saying_why(project, monkeypatch):
    from gpuflow.cluster.rerun.reuse import REUSE_ENV, finished_twin

    monkeypatch.delenv(REUSE_ENV, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    twin = finished_twin(spec_of(project, tracking={"uri": "http://127.0.0.1:9"}))
    assert twin.run is None and twin.why.startswith("could not look for a finished run"), twin.why


def test_the_reuse_check_and_plan_create_no_store_that_is_not_there(project, monkeypatch, tmp_path):
    from gpuflow.cluster.rerun.reuse import REUSE_ENV
    from gpuflow.flows.cli.check import reuse_line

    monkeypatch.delenv(REUSE_ENV, raising=False)
    store = tmp_path / "new" / "mlflow.db"
    line = reuse_line(spec_of(project, tracking={"uri": f"sqlite:///{store}"}))
    assert line.startswith("gpuflow run trains: no finished run") and "store is new" in line, line
    assert not store.exists() and not store.parent.exists()


def commit_all(repo):
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "next")


def test_the_key_is_the_same_for_the_same_inputs(project):
    first = key_of(spec_of(project))
    assert first.key and first.without_epochs and first.missing is None
    assert key_of(spec_of(project)) == first
    assert first.tags() == {WORK_KEY_TAG: first.key, WORK_KEY_WITHOUT_EPOCHS_TAG: first.without_epochs}


def test_one_value_of_the_data_changes_the_key(project):
    before = key_of(spec_of(project))
    write_data(project[1], [*range(50), 51, *range(51, 100)])
    assert key_of(spec_of(project)).key != before.key


def test_a_helper_the_loop_imports_changes_the_key_committed_or_not(project):
    repo = project[0]
    committed = key_of(spec_of(project))
    (repo / "src" / "helper.py").write_text("SCALE = 2\n")  # one byte, not committed: in the recorded diff
    uncommitted = key_of(spec_of(project))
    assert uncommitted.key not in (None, committed.key)
    commit_all(repo)
    assert key_of(spec_of(project)).key not in (None, committed.key)


def test_a_commit_outside_the_workdir_leaves_the_key(project):
    repo = project[0]
    before, commit = key_of(spec_of(project)), source_tags(repo)
    (repo / "README.md").write_text("a project, documented\n")
    commit_all(repo)
    assert source_tags(repo) != commit  # another commit, the same workdir tree
    assert key_of(spec_of(project)).key == before.key


def test_the_learning_rate_changes_both_keys(project):
    before = key_of(spec_of(project))
    after = key_of(spec_of(project, train={"loop": "loop:train_loop", "epochs": 3, "lr": 0.02, "params": {"seed": 7}}))
    assert after.key != before.key and after.without_epochs != before.without_epochs


def test_epochs_change_the_key_but_not_the_continuation_key(project):
    before = key_of(spec_of(project))
    after = key_of(spec_of(project, train={"loop": "loop:train_loop", "epochs": 9, "lr": 0.01, "params": {"seed": 7}}))
    assert after.key != before.key
    assert after.without_epochs == before.without_epochs


@pytest.mark.parametrize(
    "changes",
    [
        {"name": "another-name"},
        {"limits": {"max_runtime_minutes": 5, "max_cost_usd": 1}},
        {"tracking": {"experiment": "elsewhere", "uri": "sqlite:////tmp/elsewhere.db", "register_model": False}},
    ],
)
def test_where_a_run_is_recorded_and_its_limits_leave_the_key(project, changes):
    assert key_of(spec_of(project, **changes)) == key_of(spec_of(project))


def test_the_backend_leaves_the_key(project):
    spec = spec_of(project)
    on_the_cloud = spec.model_copy(update={"compute": spec.compute.model_copy(update={"backend": "skypilot"})})
    assert key_of(on_the_cloud) == key_of(spec)


def test_no_git_repository_gives_no_key_and_says_why(tmp_path):
    (tmp_path / "loop.py").write_text(LOOP)
    data = tmp_path / "train.parquet"
    write_data(data, list(range(10)))
    spec = ExperimentSpec.model_validate(
        {"train": {"loop": "loop:train_loop"}, "data": {"train": str(data)}, "workdir": str(tmp_path)}
    )
    found = key_of(spec)
    assert found.key is None and found.without_epochs is None
    assert found.tags() == {WORK_KEY_MISSING_TAG: found.missing} and "git repository" in found.missing


def test_data_that_cannot_be_read_gives_no_key(project):
    project[1].write_bytes(b"not parquet")
    found = key_of(spec_of(project))
    assert found.key is None and "data.train" in found.missing and "has no digest" in found.missing, found.missing
    project[1].unlink()  # the first run of a spec that writes its data: said as such, not as an error
    found = key_of(spec_of(project))
    assert found.key is None and "data.train" in found.missing and "is not written yet" in found.missing


def test_a_spec_without_data_gives_no_key(project):
    spec = spec_of(project).model_copy(update={"data": None})
    found = key_of(spec)
    assert found.key is None and "no data section" in found.missing


# -- the lookups ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One local sqlite store for the lookups: making its tables is the slow part."""
    folder = tmp_path_factory.mktemp("mlflow")
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    return client, client.create_experiment("keys", artifact_location=str(folder / "artifacts"))


def a_run(client, experiment, started, status, tags, epochs=None):
    run = client.create_run(experiment, start_time=started, tags=tags)
    if epochs is not None:
        client.log_param(run.info.run_id, "train.epochs", str(epochs))
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def test_the_newest_finished_run_with_the_key_is_found(store):
    client, experiment = store
    a_run(client, experiment, 1000, "FINISHED", {WORK_KEY_TAG: "k1"})
    newest_finished = a_run(client, experiment, 2000, "FINISHED", {WORK_KEY_TAG: "k1"})
    a_run(client, experiment, 3000, "FAILED", {WORK_KEY_TAG: "k1"})
    a_run(client, experiment, 4000, "FINISHED", {WORK_KEY_TAG: "k2"})
    assert finished_run_with_key(client, experiment, "k1").info.run_id == newest_finished
    assert finished_run_with_key(client, experiment, "k3") is None


def test_the_run_to_continue_is_the_finished_one_with_the_most_epochs_short_of_the_spec(store):
    client, experiment = store
    keyed = {WORK_KEY_WITHOUT_EPOCHS_TAG: "c1"}
    a_run(client, experiment, 1000, "FINISHED", keyed, epochs=5)
    older_eight = a_run(client, experiment, 2000, "FINISHED", keyed, epochs=8)
    newer_eight = a_run(client, experiment, 3000, "FINISHED", keyed, epochs=8)
    a_run(client, experiment, 4000, "FAILED", keyed, epochs=9)
    a_run(client, experiment, 5000, "FINISHED", keyed, epochs=12)
    a_run(client, experiment, 6000, "FINISHED", {WORK_KEY_WITHOUT_EPOCHS_TAG: "c2"}, epochs=9)
    assert run_to_continue(client, experiment, "c1", 10).info.run_id == newer_eight != older_eight
    assert run_to_continue(client, experiment, "c1", 6).data.params["train.epochs"] == "5"
    assert run_to_continue(client, experiment, "c1", 5) is None


# -- a sweep's trials ------------------------------------------------------------------------------------------------
GRID = {"train.lr": {"grid": [0.01, 0.1]}, "train.params.seed": {"grid": [7, 8]}}


def test_a_sweeps_trial_has_the_key_of_the_same_training_run_alone_and_is_found_by_it(project, store):
    client, experiment = store
    two_workers = {"backend": "local", "num_nodes": 1, "workers_per_node": 2}
    sweep = {"parameters": GRID, "metric": "loss", "mode": "min", "max_concurrent_trials": 2}  # 1 worker a trial
    spec = spec_of(project, compute=two_workers, sweep=sweep)
    alone = spec_of(  # what the third point trains, as a run of its own on one worker
        project,
        train={"loop": "loop:train_loop", "epochs": 3, "lr": 0.1, "params": {"seed": 7}},
        compute={"backend": "local", "num_nodes": 1, "workers_per_node": 1},
    )
    trained = a_run(client, experiment, 5000, "FINISHED", {WORK_KEY_TAG: key_of(alone).key})
    tags = source_tags(spec.workdir)
    changes, diff = uncommitted_changes(spec.workdir)

    plan = trial_plan(spec, {**tags, **changes}, diff, finder(client, experiment), reuse=True)
    assert [point["values"] for point in plan] == [
        {"train.lr": lr, "train.params.seed": seed} for lr in (0.01, 0.1) for seed in (7, 8)
    ]
    assert plan[2]["key"] == key_of(alone).key and len({point["key"] for point in plan}) == 4
    assert [point["reused"] for point in plan] == [None, None, trained, None]  # only the point trained before
    assert all(
        point["reused"] is None
        for point in trial_plan(spec, {**tags, **changes}, diff, finder(client, experiment), reuse=False)
    )
    drawn = {**sweep, "parameters": {**GRID, "train.lr": {"choice": [0.01, 0.1]}}}
    assert (
        trial_plan(spec_of(project, compute=two_workers, sweep=drawn), tags, diff, finder(client, experiment), True)
        is None
    )


def test_a_sweep_of_eight_points_resubmitted_with_two_more_plans_to_train_only_the_two(project, store):
    """The plan the flow writes for the job (`sweep/trials.json`): each point trained before is reused, by its key
    (the real sweep that then trains only its new point is tests/test_sweep.py's)."""
    client, _ = store
    experiment = client.create_experiment("eight-then-ten")
    one_worker = {"backend": "local", "num_nodes": 1, "workers_per_node": 1}

    def sweep_of(rates: list[float]) -> ExperimentSpec:
        grid = {"train.lr": {"grid": rates}, "train.params.seed": {"grid": [1, 2]}}
        return spec_of(project, compute=one_worker, sweep={"parameters": grid, "metric": "loss", "mode": "min"})

    tags, (changes, diff) = source_tags(project[0] / "src"), uncommitted_changes(project[0] / "src")
    first = trial_plan(sweep_of([0.1, 0.2, 0.3, 0.4]), {**tags, **changes}, diff, finder(client, experiment), True)
    for point in first:  # its eight trials trained: the job tags each with its key
        a_run(client, experiment, 5000, "FINISHED", {WORK_KEY_TAG: point["key"]})
    again = trial_plan(sweep_of([0.1, 0.2, 0.3, 0.4, 0.5]), {**tags, **changes}, diff, finder(client, experiment), True)
    assert len(first) == 8 and len(again) == 10
    to_train = [point["values"] for point in again if point["reused"] is None]
    assert to_train == [{"train.lr": 0.5, "train.params.seed": 1}, {"train.lr": 0.5, "train.params.seed": 2}]
