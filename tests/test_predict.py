"""Predicting a run's time and cost from past runs of the same loop on the same hardware: the pure decision, the
MLflow query against a real local store (runs written directly, no cluster), `gpuflow plan` and budget refusals."""

import time

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from gpuflow.cluster.cost.budget import BudgetExceeded, check_daily_budget, check_run_budget
from gpuflow.cluster.cost.history import hardware_key, identity_of, identity_tags, past_runs, prediction_for
from gpuflow.cluster.cost.predict import Identity, PastRun, Prediction, Span, predict
from gpuflow.cluster.cost.pricing import Estimate
from gpuflow.cluster.run.record import prediction_metrics
from gpuflow.cluster.spec import parse_spec
from gpuflow.cluster.usercode import loop_digest
from tests.support.repo import A_LOOP, REPO

SAME = Identity("loop-a", "local 1x2")
RATE = Estimate(3.6, 3.6, 1, False, "limits.hourly_rate_usd")  # $0.001 a second


def a_spec(epochs=5, **fields):
    return parse_spec({**A_LOOP, "workdir": str(REPO), "train": {**A_LOOP["train"], "epochs": epochs}, **fields})


def past(name, wall, epochs=5, epoch_s=2.0, identity=SAME, started_at=0.0, **figures):
    return PastRun(name, name, identity, epochs, wall, epoch_s=epoch_s, started_at=started_at, **figures)


# -- the pure decision ------------------------------------------------------------------------------------------------
def test_the_prediction_is_the_median_of_the_history_with_its_range_and_names_its_runs():
    history = [
        past("r1", 40.0, provision_s=5, first_epoch_s=4, teardown_s=2, started_at=1),
        past("r2", 50.0, provision_s=7, first_epoch_s=6, teardown_s=3, started_at=2),
        past("r3", 44.0, provision_s=6, first_epoch_s=5, teardown_s=2, started_at=3),
    ]
    prediction = predict(history, a_spec(epochs=5), SAME)
    assert prediction.wall == Span(44.0, 40.0, 50.0)
    assert prediction.provision == Span(6, 5, 7) and prediction.teardown == Span(2, 2, 3)
    assert prediction.later_epochs == Span(8.0, 8.0, 8.0)  # 4 epochs after the first × 2 s
    assert [run.name for run in prediction.based_on] == ["r3", "r2", "r1"]  # newest first
    assert prediction.cost(RATE) == Span(pytest.approx(0.044), pytest.approx(0.040), pytest.approx(0.050))
    shown = "\n".join(prediction.lines(RATE))
    assert "predicted wall time 44 s (40–50 s) from 3 past run(s) of this loop on this hardware: r3, r2, r1" in shown
    assert "4 more epoch(s) 8.0 s" in shown and "predicted cost $0.0440 ($0.0400–$0.0500) at $3.6/h" in shown


def test_each_past_run_is_scaled_to_the_specs_epochs_by_its_own_epoch_time():
    history = [past("short", 30.0, epochs=5, epoch_s=2.0), past("long", 60.0, epochs=20, epoch_s=3.0)]
    prediction = predict(history, a_spec(epochs=10), SAME)
    # 30 + 5 × 2 = 40 s; 60 − 10 × 3 = 30 s
    assert prediction.wall == Span(35.0, 30.0, 40.0)
    assert prediction.later_epochs == Span(22.5, 18.0, 27.0)  # 9 × 2, 9 × 3
    # a run without epoch times cannot be scaled: it counts only for its own epochs
    unscaled = past("no-epochs", 99.0, epochs=5, epoch_s=None)
    assert predict([unscaled], a_spec(epochs=10), SAME).known is False
    assert predict([unscaled], a_spec(epochs=5), SAME).wall == Span(99.0, 99.0, 99.0)


def test_with_no_history_the_prediction_is_the_bound_only():
    prediction = predict([], a_spec(), SAME)
    assert not prediction.known and prediction.cost(RATE) is None
    assert prediction.lines(RATE) == [
        "prediction: no history: bound only (no finished run of this loop (loop-a) on this hardware (local 1x2))"
    ]
    assert prediction_metrics(prediction, RATE) == {}


def test_other_hardware_or_another_loop_is_never_mixed_in_and_only_the_newest_count():
    history = [
        past("same", 40.0, started_at=1),
        past("other-gpu", 400.0, identity=Identity("loop-a", "skypilot 1x1 H100:1")),
        past("edited-loop", 4.0, identity=Identity("loop-b", "local 1x2")),
    ]
    prediction = predict(history, a_spec(), SAME)
    assert [run.name for run in prediction.based_on] == ["same"] and prediction.wall.median == 40.0
    many = [past(f"r{i}", 10.0 * i, started_at=i) for i in range(1, 16)]
    assert [run.name for run in predict(many, a_spec(), SAME, limit=3).based_on] == ["r15", "r14", "r13"]


def test_a_sweep_is_not_predicted():
    sweep = a_spec(sweep={"metric": "val_accuracy", "mode": "max", "parameters": {"train.lr": {"grid": [0.1, 0.2]}}})
    assert not predict([past("r", 40.0)], sweep, SAME).known


def test_the_predicted_figures_go_beside_the_actual_ones_at_open():
    prediction = predict([past("r1", 40.0), past("r2", 60.0)], a_spec(), SAME)
    assert prediction_metrics(prediction, RATE) == {
        "predicted_wall_seconds": 50.0,
        "predicted_cost_usd": pytest.approx(0.05),
    }


def test_a_budget_refusal_says_the_prediction_but_is_decided_on_the_bound():
    spec = a_spec(limits={"max_runtime_minutes": 60, "max_cost_usd": 2})  # bound: 60 min × $3.6/h = $3.60
    prediction = predict([past("r1", 600.0), past("r2", 900.0)], spec, SAME)  # $0.60–$0.90
    with pytest.raises(BudgetExceeded) as refused:
        check_run_budget(spec, RATE, prediction)
    assert "may cost $3.60" in str(refused.value)
    assert "(predicted $0.75 ($0.60–$0.90) from 2 past run(s), max_cost_usd $2.00;" in str(refused.value)
    with pytest.raises(BudgetExceeded) as refused:
        check_daily_budget(a_spec(limits={"max_runtime_minutes": 60}), RATE, 9.0, 10.0, prediction)
    assert "predicted $0.75 ($0.60–$0.90) from 2 past run(s), budget left $1.00" in str(refused.value)
    with pytest.raises(BudgetExceeded) as refused:  # no history: the refusal as before
        check_run_budget(spec, RATE, Prediction(5, why_bound_only="none"))
    assert "predicted" not in str(refused.value)


# -- identity ---------------------------------------------------------------------------------------------------------
def test_the_loop_digest_follows_the_loop_files_bytes(tmp_path):
    (tmp_path / "mine.py").write_text("def train_loop(config):\n    pass\n")
    first = loop_digest(str(tmp_path), "mine:train_loop")
    assert first == loop_digest(str(tmp_path), "mine:train_loop") and len(first) == 12
    (tmp_path / "mine.py").write_text("def train_loop(config):\n    return 1\n")
    assert loop_digest(str(tmp_path), "mine:train_loop") != first
    assert loop_digest(str(REPO), "experiments.digits:train_loop") == loop_digest(
        str(REPO), "experiments.digits:write_parquet"
    )  # one file, one digest


def test_the_hardware_key_names_backend_shape_and_accelerators():
    assert hardware_key(a_spec(compute={"workers_per_node": 3})).startswith("local 1x3, 1 CPU/worker of ")
    sky = a_spec(
        compute={"backend": "skypilot", "num_nodes": 2, "workers_per_node": 4, "accelerators": ["H100:8", "A100:8"]},
        storage={"checkpoints": "s3://bucket/ckpt"},
        tracking={"uri": "http://127.0.0.1:1"},
    )
    assert hardware_key(sky) == "skypilot 2x4 H100:8|A100:8"


# -- the MLflow query, on a real local store ------------------------------------------------------------------------
def log_run(client, experiment_id, tags, wall, epoch_times, status="FINISHED", epochs=None, **phases):
    run = client.create_run(experiment_id, run_name=f"run-{wall:g}", tags=tags)
    now = int(time.time() * 1000)
    metrics = [Metric(f"gpuflow.{name}_seconds", value, now, 0) for name, value in {"wall": wall, **phases}.items()]
    metrics += [Metric("perf/epoch_s", value, now, step) for step, value in enumerate(epoch_times, 1)]
    client.log_batch(
        run.info.run_id, metrics=metrics, params=[] if epochs is None else [Param("train.epochs", str(epochs))]
    )
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


@pytest.fixture
def store(gpuflow_home):
    """The digits spec's own store, with its history: two finished runs, and runs that must not count."""
    spec = a_spec(epochs=5, tracking={"uri": f"sqlite:///{gpuflow_home}/mlflow.db"})
    client = MlflowClient(spec.tracking_uri)
    experiment = client.create_experiment(spec.experiment_name)
    tags = identity_tags(spec)
    log_run(
        client,
        experiment,
        tags,
        40.0,
        [6.0, 2.0, 3.0, 2.0, 2.0],
        epochs=5,
        provision=5.0,
        first_epoch=6.0,
        teardown=1.0,
    )
    log_run(
        client,
        experiment,
        tags,
        50.0,
        [7.0, 3.0, 3.0, 3.0, 3.0],
        epochs=5,
        provision=6.0,
        first_epoch=7.0,
        teardown=2.0,
    )
    log_run(client, experiment, tags, 500.0, [1.0, 1.0], status="FAILED", epochs=5)
    log_run(client, experiment, {**tags, "gpuflow.hardware": "skypilot 1x1 H100:1"}, 5.0, [1.0, 1.0], epochs=5)
    log_run(client, experiment, {**tags, "gpuflow.loop_digest": "an-edit"}, 7.0, [1.0, 1.0], epochs=5)
    return spec


def test_the_query_reads_the_finished_runs_of_the_same_loop_and_hardware(store):
    runs = past_runs(store, identity_of(store))
    assert sorted(run.wall_s for run in runs) == [40.0, 50.0]
    first = next(run for run in runs if run.wall_s == 40.0)
    assert (first.epochs, first.provision_s, first.first_epoch_s, first.teardown_s) == (5, 5.0, 6.0, 1.0)
    assert first.epoch_s == 2.0  # the median of the epochs after the first
    prediction = prediction_for(store)
    assert prediction.wall == Span(45.0, 40.0, 50.0) and len(prediction.based_on) == 2


def test_a_store_not_yet_created_is_no_history_and_is_not_created(gpuflow_home):
    spec = a_spec(tracking={"uri": f"sqlite:///{gpuflow_home}/none/mlflow.db"})
    assert not prediction_for(spec).known
    assert not (gpuflow_home / "none").exists()


def test_plan_shows_the_prediction_with_history_and_the_bound_without(store, capsys):
    from gpuflow.flows.cli import main

    spec_file = REPO / "experiments" / "digits.yaml"
    with_history = [
        "plan",
        str(spec_file),
        f"--set=workdir={REPO}",
        "--set",
        "train.epochs=5",
        "--set",
        f"tracking.uri={store.tracking_uri}",
        "--set",
        f"tracking.experiment={store.experiment_name}",
    ]
    assert main(with_history + ["--set", "limits.hourly_rate_usd=3.6"]) == 0
    shown = capsys.readouterr().out
    assert (
        "# predicted wall time 45 s (40–50 s) from 2 past run(s) of this loop on this hardware: run-50, run-40" in shown
    )
    assert "provision 5.5 s (5.0–6.0 s), first epoch 6.5 s (6.0–7.0 s), 4 more epoch(s) 10 s (8.0–12 s)" in shown
    assert "#   predicted cost $0.0450 ($0.0400–$0.0500) at $3.6/h" in shown
    assert main(with_history[:-2] + ["--set", "tracking.experiment=elsewhere"]) == 0
    assert "# prediction: no history: bound only (no finished run of this loop" in capsys.readouterr().out
