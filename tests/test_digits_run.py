"""The quick tier's one real run: the README's quickstart (experiments/digits.yaml) end to end under a real Prefect
API: a local Ray cluster, Ray Train DDP, MLflow, teardown. One run, read by every test of this file."""

import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from gpuflow.cluster.backends import cluster_name_for
from gpuflow.cluster.spec import ExperimentSpec, load_spec
from tests.support.processes import processes_of
from tests.support.repo import REPO
from tests.support.runs import flow_logs, mlflow_run_of, progress_bars
from tests.test_telemetry import PERF_KEYS, prefect_artifact_of

pytestmark = pytest.mark.cluster


@dataclass
class DigitsRun:
    spec: ExperimentSpec
    state: object
    home: Path
    left_running: list[int]

    @property
    def flow_run_id(self):
        return self.state.state_details.flow_run_id

    def mlflow_run(self):
        return mlflow_run_of(self.spec.tracking_uri, self.flow_run_id, self.spec.experiment_name)


@pytest.fixture(scope="module")
def digits_run(prefect_server, tmp_path_factory) -> DigitsRun:
    """`gpuflow run experiments/digits.yaml` as shipped, with a profiler window, its state in a folder of its own."""
    from gpuflow.flows.experiment import run_experiment

    home = tmp_path_factory.mktemp("digits-run")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPUFLOW_HOME", str(home))
        env.setenv(
            "MLFLOW_TRACKING_USERNAME", "digits-tester"
        )  # who ran it: the run's mlflow.user (a local store ignores it)
        spec = load_spec(
            REPO / "experiments" / "digits.yaml",
            [
                f"workdir={REPO}",
                f"data.train={home}/data/train.parquet",
                f"data.validation={home}/data/validation.parquet",
                f"tracking.uri=sqlite:///{home}/mlflow.db",
                f"storage.checkpoints={home}/checkpoints",
                "profile.steps=4",
                "profile.after=2",
            ],
        )
        state = run_experiment(spec, return_state=True)
        return DigitsRun(spec, state, home, processes_of(home))


def test_the_flow_run_completes_with_its_progress_bar_at_100_and_gpuflow_s_lines_in_its_logs(digits_run):
    assert digits_run.state.is_completed(), digits_run.state.message
    assert progress_bars(digits_run.flow_run_id) == [100.0]  # the train task's bar in the Prefect UI
    # gpuflow's module loggers (the backend's, the lifecycle's) write into the run, as the Prefect UI shows it
    logs = flow_logs(digits_run.flow_run_id)
    cluster = cluster_name_for(digits_run.flow_run_id)
    assert f"local Ray cluster {cluster}: 1 node(s) at" in logs and f"tearing down cluster {cluster}" in logs, logs


def test_the_mlflow_run_has_every_epoch_its_params_and_its_cluster(digits_run):
    spec = digits_run.spec
    client, run = digits_run.mlflow_run()
    assert run.info.status == "FINISHED"
    assert run.data.metrics["val_accuracy"] >= 0.95
    assert run.data.tags["gpuflow.backend"] == "local"
    assert run.data.tags["gpuflow.trained"].endswith("Z")  # the job's word: had the flow died, still FINISHED
    summary = digits_run.state.result()
    assert run.data.tags["gpuflow.cluster"] == cluster_name_for(digits_run.flow_run_id) == summary["cluster"]
    name = run.data.tags["prefect.flow_run_name"]  # what, when, and which: runs started in one second differ
    assert name.startswith("digits-mlp-") and name.endswith(f"-{str(digits_run.flow_run_id)[:4]}"), name
    assert run.data.tags["mlflow.user"] == run.info.user_id == "digits-tester"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(spec.train.epochs))
    assert run.data.params["train.lr"] == str(spec.train.lr)


def test_the_registered_model_predicts_held_out_digits(digits_run):
    import pyarrow.parquet as pq

    mlflow.set_tracking_uri(digits_run.spec.tracking_uri)
    model = mlflow.pytorch.load_model(f"models:/{digits_run.spec.name}/latest")
    table = pq.read_table(digits_run.spec.data.validation)
    pixels = torch.tensor(np.stack(table.column("pixels").to_numpy(zero_copy_only=False)))
    predictions = model(pixels).argmax(dim=1).numpy()
    assert (predictions == table.column("label").to_numpy()).mean() >= 0.95


def test_every_epoch_left_a_checkpoint(digits_run):
    summary = digits_run.state.result()
    checkpoints = list(Path(summary["checkpoint"]).parent.glob("checkpoint_*/checkpoint.pt"))
    assert len(checkpoints) == digits_run.spec.train.epochs
    assert Path(summary["checkpoint"]).is_relative_to(digits_run.home / "checkpoints")


def test_telemetry_every_epoch_and_a_profiler_trace(digits_run, tmp_path):
    import json

    client, run = digits_run.mlflow_run()
    for key in PERF_KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(digits_run.spec.train.epochs)), key
        assert all(m.value > 0 for m in history), (key, history)
    assert client.get_metric_history(run.info.run_id, "perf/data_wait_pct")[0].value < 100
    assert "perf/mfu_pct" not in run.data.metrics  # a CPU has no known peak
    assert digits_run.state.result()["metrics"]["perf/samples_per_s"] > 0
    artifact = prefect_artifact_of(digits_run.flow_run_id)
    assert "**Training telemetry, last epoch**" in artifact and "samples/s" in artifact and "MFU | n/a" in artifact

    trace = client.download_artifacts(run.info.run_id, "profile/trace.json", str(tmp_path))
    assert json.loads(Path(trace).read_text())["traceEvents"]
    table = Path(client.download_artifacts(run.info.run_id, "profile/top_operators.txt", str(tmp_path))).read_text()
    assert "4 step(s) recorded after skipping 2" in table


def test_the_run_names_its_datasets_its_commit_and_its_packages(digits_run, tmp_path):
    import json

    import pyarrow.dataset as ds

    client, run = digits_run.mlflow_run()
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"train", "validation"}
    for name, context in (("train", "training"), ("validation", "validation")):
        dataset, parquet = inputs[name].dataset, ds.dataset(getattr(digits_run.spec.data, name))
        assert {tag.key: tag.value for tag in inputs[name].tags}["mlflow.data.context"] == context
        assert json.loads(dataset.profile)["num_rows"] == parquet.count_rows()
        assert [c["name"] for c in json.loads(dataset.schema)["mlflow_colspec"]] == parquet.schema.names
    # the workdir is this repository: its commit
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert run.data.tags["mlflow.source.git.commit"] == head
    assert run.data.tags["mlflow.source.git.dirty"] in ("true", "false")
    # and its flow run recorded the same as it opened the run: what a rerun checks MLflow's copy against
    from prefect.client.orchestration import get_client

    from gpuflow.cluster.rerun.source import source_stamp

    dirty = run.data.tags["mlflow.source.git.dirty"] == "true"
    diff = Path(client.download_artifacts(run.info.run_id, "source/uncommitted.diff", str(tmp_path))) if dirty else None
    with get_client(sync_client=True) as prefect:
        tags = prefect.read_flow_run(digits_run.flow_run_id).tags
    assert "source:" + source_stamp(head, diff.read_bytes() if diff else b"") in tags, tags
    packages = Path(client.download_artifacts(run.info.run_id, "environment/packages.txt", str(tmp_path))).read_text()
    assert {"torch", "ray"} <= {line.split("==")[0] for line in packages.splitlines()}


def test_nothing_is_left_running(digits_run):
    assert digits_run.left_running == []  # right after the run
    assert processes_of(digits_run.home) == []
    assert not list((digits_run.home / "clusters").glob("*/cluster.json"))  # no cluster record: the cluster is gone


def test_a_dead_runs_persisted_reports_fill_its_mlflow_run_once(digits_run):
    """What the reaper does for a run whose job died with reports still unlogged: Ray Train's record of this run's
    checkpoints, read into an MLflow run that has none of them, gives each epoch's metrics once and the last
    checkpoint; a second pass adds nothing."""
    from gpuflow.cluster.job.reports import fill_from_checkpoints
    from gpuflow.cluster.protocol import CHECKPOINT_TAG, CHECKPOINTS_TAG

    client, finished = digits_run.mlflow_run()
    folder = finished.data.tags[CHECKPOINTS_TAG]
    lost = client.create_run(finished.info.experiment_id, tags={CHECKPOINTS_TAG: folder}).info.run_id
    client.log_metric(lost, "val_accuracy", 0.5, step=0)  # the one report that reached MLflow before the job died
    assert fill_from_checkpoints(client, client.get_run(lost)) > 0
    epochs = list(range(digits_run.spec.train.epochs))
    assert sorted(m.step for m in client.get_metric_history(lost, "val_accuracy")) == epochs
    assert sorted(m.step for m in client.get_metric_history(lost, "train_loss")) == epochs
    tags = client.get_run(lost).data.tags
    assert (tags[CHECKPOINT_TAG], tags[CHECKPOINT_TAG + "_step"]) == (
        finished.data.tags[CHECKPOINT_TAG],
        finished.data.tags[CHECKPOINT_TAG + "_step"],
    )
    assert fill_from_checkpoints(client, client.get_run(lost)) == 0
    # each at the time the job's tracker logged it: a fill racing the tracker adds nothing MLflow keeps twice
    logged_at = {m.step: m.timestamp for m in client.get_metric_history(finished.info.run_id, "train_loss")}
    assert {m.step: m.timestamp for m in client.get_metric_history(lost, "train_loss")} == logged_at


def test_a_run_the_flow_stops_keeps_every_persisted_epoch_and_its_last_checkpoint(digits_run):
    """The flow interrupted (its runner gone, Ctrl-C) downs the cluster, and the job with it, reports still on their
    way: closing the run KILLED, the flow logs what Ray Train persisted and MLflow lacks, and tags the checkpoint."""
    from gpuflow.cluster.protocol import CHECKPOINT_TAG, CHECKPOINTS_TAG
    from gpuflow.cluster.run.lifecycle import Outcome
    from gpuflow.cluster.run.record import RunRecord

    client, finished = digits_run.mlflow_run()
    stopped = client.create_run(
        finished.info.experiment_id, tags={CHECKPOINTS_TAG: finished.data.tags[CHECKPOINTS_TAG]}
    ).info.run_id
    record = RunRecord(digits_run.spec, f"stopped-{stopped}")
    record.run_id = stopped
    record.close(Outcome("KILLED", "interrupted", "interrupted (SystemExit)"), {})
    run = client.get_run(stopped)
    assert (run.info.status, run.data.tags["stopped_by"]) == ("KILLED", "interrupted")
    epochs = list(range(digits_run.spec.train.epochs))
    assert sorted(m.step for m in client.get_metric_history(stopped, "val_accuracy")) == epochs
    assert run.data.tags[CHECKPOINT_TAG] == finished.data.tags[CHECKPOINT_TAG]


def test_a_run_of_the_same_work_reuses_the_finished_run_without_a_cluster(digits_run, monkeypatch):
    """The same spec, code and data again: no cluster, no MLflow run of its own, Completed, linking the run it
    reused. A changed learning rate, --force, `reuse: never` or GPUFLOW_REUSE=never train (the decision, read
    against this store)."""
    from gpuflow.cluster.backends.local import LocalBackend
    from gpuflow.cluster.rerun.reuse import REUSE_ENV, finished_twin
    from gpuflow.flows.cli.check import reuse_line
    from gpuflow.flows.experiment import run_experiment
    from gpuflow.flows.run_tags import REUSED_TAG_PREFIX

    monkeypatch.delenv(REUSE_ENV)
    monkeypatch.setenv("GPUFLOW_HOME", str(digits_run.home))
    spec = digits_run.spec
    client, first = digits_run.mlflow_run()
    assert finished_twin(spec).run.info.run_id == first.info.run_id
    plan_says = reuse_line(spec)  # `gpuflow plan` says so before anything runs
    assert plan_says.startswith("gpuflow run reuses the finished run") and first.info.run_id in plan_says, plan_says
    for changed, why in [
        (spec.model_copy(update={"train": spec.train.model_copy(update={"lr": spec.train.lr * 2})}), "no finished"),
        (spec.model_copy(update={"reuse": "never"}), "reuse: never"),
    ]:
        twin = finished_twin(changed)
        assert twin.run is None and why in twin.why, twin.why
    assert finished_twin(spec, force=True).run is None
    monkeypatch.setenv(REUSE_ENV, "never")
    assert finished_twin(spec).run is None
    monkeypatch.delenv(REUSE_ENV)

    runs_before = client.search_runs([first.info.experiment_id], max_results=100)
    state = run_experiment(spec, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["reused"] and summary["run_id"] == first.info.run_id
    assert summary["metrics"]["val_accuracy"] == first.data.metrics["val_accuracy"]
    flow_run_id = state.state_details.flow_run_id
    logs = flow_logs(flow_run_id)
    assert f"reusing it: nothing to train; the finished run {first.info.run_name}" in logs, logs
    cluster = cluster_name_for(flow_run_id)
    assert f"local Ray cluster {cluster}" not in logs and cluster not in {c.name for c in LocalBackend().status()}
    assert len(client.search_runs([first.info.experiment_id], max_results=100)) == len(runs_before)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        assert REUSED_TAG_PREFIX + first.info.run_id in prefect.read_flow_run(flow_run_id).tags
    assert prefect_artifact_of(flow_run_id).startswith(f"# {spec.name}")


def test_more_epochs_of_the_same_work_continue_the_finished_run_from_its_last_checkpoint(
    digits_run, monkeypatch, capsys
):
    """The same spec, code and data with two more epochs: the run starts from the finished run's last checkpoint and
    trains the two epochs left, its metrics going on from there, linked to the run it continued. --force trains from
    scratch; fewer epochs than the finished run's are not a continuation."""
    from gpuflow.cluster.protocol import CHECKPOINT_TAG, CONTINUED_FROM_TAG
    from gpuflow.cluster.rerun.reuse import REUSE_ENV, finished_twin
    from gpuflow.flows.cli.check import plan, reuse_line
    from gpuflow.flows.experiment import run_experiment

    monkeypatch.delenv(REUSE_ENV)
    monkeypatch.setenv("GPUFLOW_HOME", str(digits_run.home))
    client, first = digits_run.mlflow_run()
    epochs = digits_run.spec.train.epochs
    more = digits_run.spec.model_copy(update={"train": digits_run.spec.train.model_copy(update={"epochs": epochs + 2})})
    twin = finished_twin(more)
    assert twin.run is None and twin.continues.info.run_id == first.info.run_id, twin.why
    assert twin.checkpoint == first.data.tags[CHECKPOINT_TAG]
    assert f"from its checkpoint of epoch {epochs - 1}: 2 epoch(s) to train" in reuse_line(more)
    capsys.readouterr()
    assert plan(more) == 0
    planned = capsys.readouterr().out  # predicted for the two epochs left: a first and one more
    assert "2 epoch(s) to train" in planned and "1 more epoch(s)" in planned, planned
    assert finished_twin(more, force=True).continues is None
    fewer = digits_run.spec.model_copy(update={"train": digits_run.spec.train.model_copy(update={"epochs": 3})})
    assert finished_twin(fewer).continues is None

    state = run_experiment(more, return_state=True)
    assert state.is_completed(), state.message
    continued = client.get_run(state.result()["run_id"])
    assert continued.info.status == "FINISHED" and continued.data.tags[CONTINUED_FROM_TAG] == first.info.run_id
    # a run from scratch would have reported every epoch from 0
    assert [m.step for m in client.get_metric_history(continued.info.run_id, "val_accuracy")] == [epochs, epochs + 1]
    # from the trained model: where a fresh one would start from chance
    assert continued.data.metrics["val_accuracy"] >= first.data.metrics["val_accuracy"] - 0.05, continued.data.metrics
    assert f"training: continues the finished run {first.info.run_name}" in flow_logs(state.state_details.flow_run_id)
