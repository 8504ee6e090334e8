"""A run with a deadline (limits.deadline): the spec's refusals, `gpuflow validate` and `plan`, and the flow deciding
each launch on the SkyPilot double, whose spot capacity follows a scripted schedule (tests/support/sky_double.py).
The policy's own cases, on synthetic traces, are tests/test_deadline.py's."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
import yaml
from prefect.client.orchestration import get_client

from gpuflow.cluster.cost.deadline_run import DeadlineClock, Progress
from gpuflow.cluster.protocol import ATTEMPT_STARTED_TAG, CHECKPOINT_PERSISTED, SETUP_DONE
from gpuflow.cluster.spec import SpecError, parse_spec
from gpuflow.flows.experiment import run_experiment
from gpuflow.tasks.compute import MOVED
from tests.support.repo import A_LOOP
from tests.support.runs import flow_logs, mlflow_run_of, task_runs
from tests.support.sky_double import FakeSky
from tests.test_capacity import sky_prices, spec_file  # noqa: F401  (a fixture)
from tests.test_skypilot import spec_on_the_double

SPOT = {"infra": "aws", "accelerators": "L4:1", "use_spot": True}  # the test catalog: $0.2628/h spot, $0.8048 not
SPOT_USD, ON_DEMAND_USD = 0.2628, 0.8048
REMOTE_STORES = {"tracking": {"uri": "http://127.0.0.1:5000"}, "storage": {"checkpoints": "s3://bucket/gpuflow"}}


def in_hours(hours: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    "compute, limits, field, fix",
    [
        (
            {"infra": "aws", "accelerators": "L4:1"},
            {"finish_within_hours": 2},
            "limits.finish_within_hours",
            "set compute.use_spot: true",
        ),
        (
            {**SPOT, "spot_fallback_after": 2},
            {"finish_within_hours": 2},
            "compute.spot_fallback_after",
            "remove spot_fallback_after",
        ),
        (SPOT, {"finish_within_hours": 2, "deadline": "2030-01-01T00:00:00Z"}, "limits.deadline", "not both"),
        (SPOT, {"deadline": "2030-01-01T09:00:00"}, "limits.deadline", "2030-01-01T09:00:00Z (UTC)"),
        (SPOT, {"deadline": "next friday"}, "limits.deadline", "write it as 2026-12-24T09:00:00Z"),
        (
            {"options": [{**SPOT}, {"infra": "lambda", "accelerators": "A100:1"}]},
            {"finish_within_hours": 2},
            "compute.options",
            "give spot options only",
        ),
    ],
    ids=["no spot", "a fixed fallback too", "both forms", "no time zone", "not a time", "an on-demand option"],
)
def test_a_deadline_the_run_cannot_choose_by_is_refused_naming_the_field_and_the_fix(compute, limits, field, fix):
    with pytest.raises(SpecError) as refused:
        parse_spec({**A_LOOP, **REMOTE_STORES, "compute": {"backend": "skypilot", **compute}, "limits": limits})
    assert field in str(refused.value) and fix in str(refused.value)


def test_validate_refuses_a_deadline_on_demand_cannot_meet_naming_the_earliest(
    tmp_path,
    capsys,
    gpuflow_home,
    monkeypatch,
    sky_prices,  # noqa: F811
):
    from gpuflow.flows.cli import main

    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))
    path = spec_file(tmp_path, gpuflow_home, SPOT)  # limits.max_runtime_minutes: 30, no history: C(0) = 30 min
    spec = yaml.safe_load(open(path))
    spec["limits"].update(deadline=in_hours(0.5), changeover_minutes=6)
    open(path, "w").write(yaml.safe_dump(spec))
    assert main(["validate", path]) == 2
    refusal = capsys.readouterr().err
    assert "limits.deadline:" in refusal and "on-demand alone needs 36.0 min" in refusal
    earliest = datetime.strptime(refusal.split("set it to ")[1][:20], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert abs(earliest.timestamp() - (time.time() + 36 * 60)) < 60

    spec["limits"].update(deadline=in_hours(3))
    open(path, "w").write(yaml.safe_dump(spec))
    assert main(["plan", path]) == 0
    shown = capsys.readouterr().out
    assert "training needs 30.0 min (limits.max_runtime_minutes (no history))" in shown
    assert "a switch of cluster 6.0 min (limits.changeover_minutes)" in shown
    assert "feasible: 2.40 h of slack over on-demand alone, $0.48 on-demand alone" in shown  # 0.6 h × $0.8048
    assert "# option 1 (when the deadline needs it): aws L4:1 on-demand" in shown  # budgeted at the dearer price


def test_progress_counts_the_training_kept_not_the_work_redone_or_the_recovery():
    from gpuflow.cluster.cost.pricing import hourly_cost
    from gpuflow.cluster.run.lifecycle import Lifecycle
    from gpuflow.cluster.run.meter import Meter

    spec = parse_spec({**A_LOOP, "limits": {"hourly_rate_usd": 2.0}})
    life = Lifecycle("gpuflow-x", down=lambda name: True, meter=Meter(hourly_cost(spec)))
    started = time.time() - 100
    life.job_started_at = started
    life.epoch_done(0)
    life.checkpointed()  # one epoch of four kept, 40 s in; a loss at 60 s: 20 s redone, the recovery from there
    life.lost.checkpoint_at = started + 40
    life.lost.lost(started + 60, started)
    progress = life.progress(4)
    assert progress.compute_done_s == pytest.approx(40, abs=1) and progress.fraction_done == 0.25
    clock = DeadlineClock(time.time() + 3600, started, 600, 60, "test", "test")
    assert clock.situation(time.time(), progress, False).compute_total_s == pytest.approx(160, abs=4)  # 40 s / 25 %
    assert clock.choose(time.time(), Progress(), False).decision.value == "on_demand"  # nothing kept, time gone


@pytest.fixture
def deadline_flow(monkeypatch, gpuflow_home, prefect_server, sky_prices):  # noqa: F811
    """The real flow on the SkyPilot double, its spot capacity scripted; returns its state, MLflow run and client,
    the Prefect states it went through and what SkyPilot still lists."""
    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))
    monkeypatch.setattr("gpuflow.flows.capacity.waiting.RETRY_S", 0.5)

    def run(limits: dict, epochs: int = 4, **double):
        fake = FakeSky(**double)
        monkeypatch.setattr("gpuflow.cluster.backends.skypilot.load_sdk", lambda: fake)
        spec = spec_on_the_double(gpuflow_home, {**SPOT, "max_recoveries": 2}, {"max_runtime_minutes": 1, **limits})
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"epochs": epochs})})
        state = run_experiment(spec, return_state=True)
        flow_run_id = state.state_details.flow_run_id
        client, mlflow_run = mlflow_run_of(spec.tracking_uri, flow_run_id, spec.experiment_name)
        with get_client(sync_client=True) as prefect:
            states = [s.name for s in prefect.read_flow_run_states(flow_run_id)]
        return state, client, mlflow_run, states, flow_logs(flow_run_id), fake.clusters

    return run


def attempt_prices(client, run) -> list[float]:
    history = sorted(client.get_metric_history(run.info.run_id, "attempt_hourly_usd"), key=lambda m: m.step)
    return [round(m.value, 4) for m in history]


def test_behind_its_pace_with_no_spot_the_run_goes_on_demand_at_once_where_greedy_would_wait(deadline_flow):
    """No spot anywhere, 10 min to a deadline that needs 1 min: Greedy (SkyPilot's managed jobs) would wait for spot
    until the safety net, 8 min on; Uniform Progress is behind as soon as time passes with nothing trained."""
    state, client, run, states, logs, left = deadline_flow(
        {"finish_within_hours": 1 / 6, "changeover_minutes": 0.1}, spot_schedule=[False]
    )
    assert state.is_completed(), state.message
    assert "Waiting for spot" not in states
    assert "deadline: behind uniform progress, no spot: on-demand: launching on-demand" in logs
    assert attempt_prices(client, run) == [ON_DEMAND_USD]
    metrics = run.data.metrics
    assert metrics["spot_seconds"] == 0 and metrics["on_demand_seconds"] > 0
    assert 0 < metrics["deadline_slack_seconds"] < 600
    assert run.data.params["limits.deadline"].startswith(str(datetime.now(timezone.utc).year))  # made absolute
    assert run.info.status == "FINISHED" and left == {}


def test_ahead_after_a_spot_loss_the_run_waits_for_spot_unbilled_and_resumes_on_it(deadline_flow):
    """Spot trains half the job, is lost, and none is left for a while: the run has banked progress against a
    deadline hours away, so it waits (Prefect says so, nothing billed) and goes back to spot when it returns."""
    state, client, run, states, logs, left = deadline_flow(
        {"finish_within_hours": 10, "changeover_minutes": 0.1},
        spot_schedule=[True, False, False, False, True],
        preempt_spot=1,
        streamed=True,
        job_log=epochs_with_checkpoints(4),
        job_s=4.0,
    )
    assert state.is_completed(), state.message
    assert "Waiting for spot" in states
    assert "deadline: ahead of uniform progress: wait for spot" in logs
    assert attempt_prices(client, run) == [SPOT_USD, SPOT_USD]  # spot, lost; spot again, never on-demand
    metrics = run.data.metrics
    assert metrics["recoveries"] == 1 and metrics["on_demand_seconds"] == 0 and metrics["deadline_switches"] == 0
    assert metrics["spot_seconds"] == pytest.approx(metrics["cluster_hours"] * 3600)
    [_, relaunch] = sorted(client.get_metric_history(run.info.run_id, "attempt_cost_usd"), key=lambda m: m.step)
    billed_s = relaunch.value / SPOT_USD * 3600
    relaunched_to_end_s = run.info.end_time / 1000 - float(run.data.tags[ATTEMPT_STARTED_TAG])
    assert billed_s < relaunched_to_end_s - 1.0  # three waits of 0.5 s for spot and the tries between: not billed
    assert run.info.status == "FINISHED" and left == {}


def test_on_demand_and_far_ahead_the_run_goes_back_to_spot_at_a_checkpoint(deadline_flow):
    """No spot at first: on-demand. Hours ahead of its pace, the run launches spot beside it once spot is there,
    leaves on-demand at the loop's next checkpoint and resumes on spot: a move, not a loss (no recovery counted)."""
    state, client, run, states, logs, left = deadline_flow(
        {"finish_within_hours": 10, "changeover_minutes": 0.1},
        spot_schedule=[False, True],
        streamed=True,
        job_log=epochs_with_checkpoints(6),
        job_s=8.0,
        setup_s=0.5,
    )
    assert state.is_completed(), state.message
    assert "launching spot beside on-demand" in logs and "leaving on-demand cluster" in logs
    assert attempt_prices(client, run) == [ON_DEMAND_USD, SPOT_USD]
    metrics = run.data.metrics
    assert metrics["deadline_switches"] == 1 and metrics["spot_seconds"] > 0 and metrics["on_demand_seconds"] > 0
    assert "recoveries" not in metrics and "redone_seconds" not in metrics  # left at a checkpoint: nothing redone
    # the move is planned: the Prefect UI shows no failed train task, no job log as an error
    trains = [task.state_name for task in task_runs(state.state_details.flow_run_id, "train")]
    assert trains == [MOVED, "Completed"], trains
    assert run.info.status == "FINISHED" and left == {}


def epochs_with_checkpoints(epochs: int) -> list[str]:
    """A job's log as the flow reads it: setup done, then each epoch's line and its checkpoint persisted."""
    log = [SETUP_DONE]
    for epoch in range(epochs):
        log += [f"[gpuflow] epoch {epoch}: train_loss=1.0 val_accuracy=0.9", CHECKPOINT_PERSISTED]
    return log
