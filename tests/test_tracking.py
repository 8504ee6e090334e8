"""Every ray.train.report of a plain Ray Train loop reaches the MLflow run (cluster/job/tracking.py), with the right
steps, the checkpoints' locations, the last checkpoint when no model was logged, and no step twice on a resume."""

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.cluster.job.reports import numbers_of, step_of
from gpuflow.cluster.spec import parse_spec
from tests.support.processes import processes_of
from tests.support.repo import REPO

NAME = "gpuflow-7ac0ffee0000000000000000000000a1"


def run_job(backend, handle, spec, run_name, env) -> str:
    lines = []
    job = backend.exec(handle, spec, run_name, env)
    assert backend.tail_logs(handle, job, lines.append) == 0, "\n".join(lines[-60:])
    return "\n".join(lines)


@pytest.mark.full
def test_every_report_of_a_plain_loop_is_tracked_once(gpuflow_home):
    tracking_uri = f"sqlite:///{gpuflow_home}/mlflow.db"
    client = MlflowClient(tracking_uri)
    artifacts = (gpuflow_home / "artifacts").as_uri()  # not ./mlruns: the controller's folder is the repository
    run_id = client.create_run(client.create_experiment("plain", artifact_location=artifacts)).info.run_id
    env = {"MLFLOW_TRACKING_URI": tracking_uri, "GPUFLOW_MLFLOW_RUN_ID": run_id}

    def spec(loop, **params):
        return parse_spec(
            {
                "train": {"loop": f"tests.loops.plain:{loop}", "epochs": params.pop("epochs", 1), "params": params},
                "workdir": str(REPO),
                "compute": {"workers_per_node": 2},
                # no flow renews these jobs' lease: its grace must outlast a slow start on a busy machine
                "limits": {"orphan_grace_minutes": 30},
            }
        )

    backend = LocalBackend()
    handle = backend.launch(spec("no_step_given"), NAME)
    try:
        # attempt 1: epochs 0-2; attempt 2 (a resume that repeats epochs 1-2 with other values) goes on to 4
        log = run_job(backend, handle, spec("epochs_with_checkpoints", epochs=3, offset=0.0), "attempt-1", env)
        assert "[gpuflow] epoch 2: loss=2" in log  # the progress line the flow follows, for any loop
        run_job(
            backend, handle, spec("epochs_with_checkpoints", epochs=5, offset=100.0, first_epoch=1), "attempt-2", env
        )
        history = client.get_metric_history(run_id, "loss")
        assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
        assert [m.step for m in client.get_metric_history(run_id, "eval/accuracy")] == [0, 1, 2, 3, 4]
        run = client.get_run(run_id)
        assert "epoch" not in run.data.metrics and "note" not in run.data.metrics  # the step, and text: not metrics
        checkpoint = Path(run.data.tags["gpuflow.checkpoint"])
        assert json.loads((checkpoint / "state.json").read_text()) == {"epoch": 4}
        assert run.data.tags["gpuflow.checkpoint_step"] == "4" and "attempt-2" in str(checkpoint)
        listed = json.loads(Path(client.download_artifacts(run_id, "checkpoints.json", str(gpuflow_home))).read_text())
        assert [c["step"] for c in listed] == [1, 2, 3, 4]  # this attempt's checkpoints
        # no model was logged: the last checkpoint is kept in the run itself
        assert [a.path for a in client.list_artifacts(run_id, "checkpoint")] == ["checkpoint/state.json"]

        # a loop that gives no step: the report's index, counted on after what the run already holds
        run_job(backend, handle, spec("no_step_given"), "no-step", env)
        assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))[-3:] == [
            (5, 3.0),
            (6, 2.0),
            (7, 1.0),
        ]
    finally:
        backend.down(NAME)
    assert processes_of(gpuflow_home) == []


def test_what_counts_as_a_metric_and_a_step():
    import numpy as np
    import torch

    assert numbers_of(
        {
            "a": 1,
            "b": np.float32(0.5),
            "c": torch.tensor(2.0),
            "d": "x",
            "e": True,
            "f": [1, 2],
            "g": {"h": 3},
            "bad key!": 1.0,
        }
    ) == {"a": 1.0, "b": 0.5, "c": 2.0, "g/h": 3.0, "bad key_": 1.0}
    assert step_of({"epoch": 3, "step": 70}) == ("epoch", 3)
    assert step_of({"step": 70.0}) == ("step", 70)
    assert step_of({"epoch": 1.5}) == (None, None) and step_of({}) == (None, None)


@pytest.mark.parametrize("trains", [True, False])
def test_a_resumed_attempt_logs_the_epochs_its_lost_controller_never_did(tmp_path, trains):
    """A loss can take the controller's last queued reports with it; their checkpoints are in Ray Train's record
    (checkpoint_manager_snapshot.json, in Ray 2.60's format), so the resumed attempt logs them before its own. One
    resumed after the last epoch's checkpoint (a deadline's move as training ended) trains nothing: it logs them as
    it finishes."""
    import ray

    from gpuflow.cluster.job.tracking import MlflowTracker
    from gpuflow.cluster.util.ray_internals import SNAPSHOT_FILE

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("resume", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    for epoch in range(3):  # what the lost attempt got into MLflow: epochs 0-2 of the 5 it checkpointed
        client.log_metric(run_id, "val_accuracy", 0.5 + epoch / 10, step=epoch)
    results = [
        {
            "version": 0,
            "checkpoint_dir_name": f"checkpoint_{epoch}",
            "metrics": {"val_accuracy": 0.5 + epoch / 10, "epoch": epoch},
        }
        for epoch in range(5)
    ]
    (tmp_path / SNAPSHOT_FILE).write_text(
        json.dumps(
            {
                "ray_version": ray.__version__,
                "checkpoint_results": results[-2:] + results[:3],  # kept in any order
                "checkpoint_report_indices": [3, 4, 0, 1, 2],
                "latest_checkpoint_result": results[-1],
                "pending_training_results": [],
                "pending_validation_specs": [],
                "current_report_index": 5,
                "validated_checkpoint_dir_names": [],
                "timed_out_validation_checkpoint_dir_names": [],
                "failed_validation_checkpoint_dir_names": [],
            }
        )
    )

    tracker = MlflowTracker(
        run_id, f"sqlite:///{tmp_path}/mlflow.db", print_progress=False, snapshot_uri=str(tmp_path / SNAPSHOT_FILE)
    )
    if trains:
        tracker.add({"val_accuracy": 1.0, "epoch": 5}, None)  # the resumed attempt's first report
    tracker.finish()
    history = client.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4] + [5] * trains
    assert {m.step: round(m.value, 2) for m in history}[4] == 0.9


def test_a_model_torch_export_cannot_trace_or_given_no_example_is_logged_pickled(tmp_path, monkeypatch, capsys):
    """log_model saves pt2 where torch.export can trace the model with its example; a model with a branch on its data,
    or logged without an example, is saved pickled instead, saying why, and loads back behaving as it trained."""
    import mlflow
    import numpy as np
    import torch

    from gpuflow.cluster import loop

    class Branchy(torch.nn.Module):  # data-dependent control flow: torch.export refuses it
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment("models", artifact_location=(tmp_path / "artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    monkeypatch.setattr(loop, "rank", lambda: 0)  # rank 0 of a Ray Train job: the one that logs
    mlflow.set_tracking_uri(tracking_uri)
    formats = []
    for model, example in [
        (torch.nn.Linear(2, 2), np.ones((1, 2), np.float32)),
        (Branchy(), np.ones((1, 2), np.float32)),
        (Branchy(), None),
    ]:
        run_id = client.create_run(experiment).info.run_id
        monkeypatch.setenv("GPUFLOW_MLFLOW_RUN_ID", run_id)
        loop.log_model(model, input_example=example)
        [output] = client.get_run(run_id).outputs.model_outputs
        logged = mlflow.pytorch.load_model(f"models:/{output.model_id}")
        formats.append("pt2" if isinstance(logged, torch.fx.GraphModule) else "pickle")  # an exported graph, or not
        x = torch.tensor([[1.0, -2.0]]) if isinstance(model, Branchy) else torch.ones(1, 2)
        assert torch.equal(logged(x), model(x)) and torch.equal(logged(-x), model(-x))
    assert formats == ["pt2", "pickle", "pickle"]
    said = capsys.readouterr().err
    assert "logged pickled: torch.export could not trace it (GuardOnDataDependentSymNode" in said
    assert "logged pickled: log_model got no input_example" in said
