"""A sweep end to end: one flow run, one local Ray cluster, Ray Tune trials that are Ray Train runs, one MLflow
parent run with a child run per trial; and a cancelled sweep that leaves nothing running."""

import time
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from gpuflow.cluster.spec import parse_spec
from tests.loops import TUNABLE_LOOP
from tests.support.processes import processes_of
from tests.support.repo import REPO
from tests.support.runs import mlflow_run_of
from tests.test_lifecycle import GpuflowRun, cancel, flow_run_state


def tunable_sweep(**sweep) -> dict:
    """A 2 × 2 grid of the tunable loop on 1 node × 2 CPUs, two trials at a time, ASHA after the first epoch."""
    return {
        "name": "tunable",
        "workdir": str(REPO),
        "train": {"loop": TUNABLE_LOOP, "epochs": 4, "lr": 0.01, "params": {"hidden": 8, "pace_s": 1.0}},
        "compute": {"backend": "local", "num_nodes": 1, "workers_per_node": 2},
        "sweep": {
            "parameters": {"train.lr": {"grid": [0.1, 0.01]}, "train.params.hidden": {"grid": [8, 16]}},
            "metric": "score",
            "mode": "max",
            "max_concurrent_trials": 2,
            "early_stopping": {"grace_epochs": 1, "reduction_factor": 2},
            **sweep,
        },
        "limits": {"max_runtime_minutes": 10},
    }


def children_of(client, parent):
    return client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")


@pytest.mark.full
def test_a_sweep_runs_its_trials_as_child_runs_and_registers_the_best(tracked_sweep):
    spec, state = tracked_sweep.spec, tracked_sweep.state
    assert state.is_completed(), state.message
    client, parent = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
    assert parent.info.status == "FINISHED"

    trials = children_of(client, parent)
    assert len(trials) == 4
    assert {(t.data.params["train.lr"], t.data.params["train.params.hidden"]) for t in trials} == {
        ("0.1", "8"),
        ("0.1", "16"),
        ("0.01", "8"),
        ("0.01", "16"),
    }
    assert all(t.info.status == "FINISHED" for t in trials)
    assert all(t.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id) for t in trials)
    stopped = [t for t in trials if t.data.tags.get("stopped_early") == "true"]
    assert stopped, "ASHA stopped no trial, though half of them trail from the first epoch"
    for trial in trials:  # each trial's own per-epoch series: all 4 epochs, or fewer where ASHA stopped it
        steps = sorted(m.step for m in client.get_metric_history(trial.info.run_id, "score"))
        assert steps == list(range(len(steps))) and (len(steps) < 4) == (trial in stopped), (trial.info.run_name, steps)
        assert trial.data.metrics["cost_usd"] == 0 and trial.data.metrics["trial_seconds"] > 0

    # the best trial (lr=0.1, hidden=16 by the loop's formula) is on the parent and in the registry
    [best] = [t for t in trials if t.data.params["train.lr"] == "0.1" and t.data.params["train.params.hidden"] == "16"]
    assert parent.data.tags["gpuflow.best_run_id"] == best.info.run_id
    assert parent.data.params["best.train.lr"] == "0.1" and parent.data.params["best.train.params.hidden"] == "16"
    assert parent.data.metrics["best_score"] == best.data.metrics["score"]
    assert parent.data.metrics["sweep/stopped_early"] == len(stopped)
    assert parent.data.metrics["sweep/placement_groups_reserved"] == 0
    assert Path(state.result()["checkpoint"], "checkpoint.pt").is_file()  # the best trial's last checkpoint
    [version] = MlflowClient(spec.tracking_uri).search_model_versions(f"name = '{spec.name}'")
    assert version.run_id == best.info.run_id
    mlflow.set_tracking_uri(spec.tracking_uri)
    assert mlflow.pytorch.load_model(f"models:/{spec.name}/{version.version}") is not None
    assert processes_of(tracked_sweep.home) == []


@pytest.mark.full
def test_a_cancelled_sweep_kills_every_trial_and_leaves_nothing(prefect_server, gpuflow_home, tmp_path):
    fields = tunable_sweep()
    fields["train"].update(epochs=400)  # still training when the cancel comes
    fields["train"]["params"]["pace_s"] = 5.0  # an epoch (a report, a checkpoint) every 5 s until then: little CPU
    del fields["sweep"]["early_stopping"]  # a trial stopped early ends FINISHED: here every trial must be cut short
    spec_file = tmp_path / "sweep.yaml"
    spec_file.write_text(yaml.safe_dump(fields))
    run = GpuflowRun(gpuflow_home, spec_file=spec_file)
    try:
        flow_run_id = run.wait_for_training()
        client, parent = mlflow_run_of(parse_spec(fields).tracking_uri, flow_run_id, parse_spec(fields).experiment_name)
        deadline = time.monotonic() + 180
        while len(children_of(client, parent)) < 2:  # both trials of the first round have started
            assert time.monotonic() < deadline and run.process.poll() is None, "".join(run.lines[-30:])
            time.sleep(1)
        cancel(flow_run_id)
        assert run.wait() != 0, "".join(run.lines[-30:])
    finally:
        if run.process.poll() is None:
            run.process.kill()

    assert flow_run_state(flow_run_id).is_cancelled()
    client, parent = mlflow_run_of(parse_spec(fields).tracking_uri, flow_run_id, parse_spec(fields).experiment_name)
    assert parent.info.status == "KILLED" and parent.data.tags["stopped_by"] == "cancelled"
    trials = children_of(client, parent)
    assert len(trials) == 2 and [t.info.status for t in trials] == ["KILLED"] * len(trials)
    assert processes_of(gpuflow_home) == []


def digits_sweep(digits_spec, learning_rates: list[float]):
    """The digits loop on its data (so that each trial has a work key), 1 epoch a trial of 1 worker, 1 at a time."""
    fields = digits_spec.model_dump(mode="json")
    fields["train"].update(epochs=1)
    fields["compute"] = {"backend": "local", "num_nodes": 1, "workers_per_node": 1}
    fields["tracking"]["register_model"] = False
    grid = {"train.lr": {"grid": learning_rates}}
    fields["sweep"] = {"parameters": grid, "metric": "val_accuracy", "mode": "max", "max_concurrent_trials": 1}
    return parse_spec(fields)


@pytest.mark.full
def test_a_sweep_with_a_run_of_one_point_trains_the_other_alone_and_picks_the_best_of_both(
    prefect_server, digits_spec, gpuflow_home, monkeypatch
):
    from gpuflow.cluster.protocol import REUSED_RUN_TAG, WORK_KEY_TAG
    from gpuflow.flows.experiment import run_experiment

    monkeypatch.setenv("GPUFLOW_REUSE", "finished")
    spec = digits_sweep(digits_spec, [0.01, 0.05])
    single = spec.model_copy(update={"sweep": None, "train": spec.train.model_copy(update={"lr": 0.01})})
    first = run_experiment(single, return_state=True)  # a trial's key is that of a run of its own training
    assert first.is_completed(), first.message
    state = run_experiment(spec, return_state=True)
    assert state.is_completed(), state.message

    client, before = mlflow_run_of(spec.tracking_uri, first.state_details.flow_run_id, spec.experiment_name)
    _, parent = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
    trained_before = {before.data.params["train.lr"]: before}
    trials = children_of(client, parent)
    reused = {t.data.params["train.lr"]: t for t in trials if REUSED_RUN_TAG in t.data.tags}
    trained = [t for t in trials if REUSED_RUN_TAG not in t.data.tags]
    assert sorted(reused) == ["0.01"] and [t.data.params["train.lr"] for t in trained] == ["0.05"]
    for lr, trial in reused.items():  # each points at the trial that trained it, with its figures, and cost nothing
        original = trained_before[lr]
        assert trial.data.tags[REUSED_RUN_TAG] == original.info.run_id
        assert trial.data.tags[WORK_KEY_TAG] == original.data.tags[WORK_KEY_TAG]
        assert trial.data.metrics["val_accuracy"] == original.data.metrics["val_accuracy"]
        assert trial.data.metrics["cost_usd"] == 0 and trial.info.status == "FINISHED"
    assert parent.data.metrics["sweep/trials"] == 2 and parent.data.metrics["sweep/reused_trials"] == 1
    best = max(trials, key=lambda t: t.data.metrics["val_accuracy"])
    assert parent.data.metrics["best_val_accuracy"] == best.data.metrics["val_accuracy"]
    assert parent.data.params["best.train.lr"] == best.data.params["train.lr"]
    assert processes_of(gpuflow_home) == []


def test_closing_a_parent_run_closes_its_running_trials_with_the_same_status(gpuflow_home):
    """What every exit path relies on (the flow's finally, the cancel/crash hooks, the job's guard, the reaper)."""
    from gpuflow.cluster.run.mlflow_run import close_run

    client = MlflowClient(f"sqlite:///{gpuflow_home}/mlflow.db")
    experiment = client.create_experiment("closing")
    parent = client.create_run(experiment).info.run_id
    finished, running = (client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id for _ in "ab")
    client.set_terminated(finished, "FINISHED")  # a trial that completed before the sweep was stopped
    unrelated = client.create_run(experiment).info.run_id

    assert close_run(client, parent, "KILLED")
    status = {run_id: client.get_run(run_id).info.status for run_id in (parent, finished, running, unrelated)}
    assert status == {parent: "KILLED", finished: "FINISHED", running: "KILLED", unrelated: "RUNNING"}


def test_a_sweeps_job_has_ray_tune_whole_before_it_imports_ray_train_itself():
    """The job preloads Ray Train and Tune while Ray connects; its own next import of Ray Train, begun while that
    preload ran, met a half-imported module and failed every sweep. The preload is finished first."""
    import subprocess
    import sys

    script = f"""
import sys
from gpuflow.cluster.job.__main__ import preload
from gpuflow.cluster.spec import parse_spec
from gpuflow.cluster.util.preload import finish_background_imports
preload(parse_spec({tunable_sweep()!r}))
finish_background_imports()
print("ray.tune" in sys.modules, flush=True)
from gpuflow.cluster.job.elastic import count_nodes
from gpuflow.cluster.job.sweep import run_sweep
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True"]
