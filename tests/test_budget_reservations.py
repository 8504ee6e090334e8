"""The daily budget holds when runs start together: each reserves its most, then reads the day's total."""

import threading

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from gpuflow.cluster.cost.budget import (
    BudgetExceeded,
    active_reservations,
    check_budget,
    committed_since_usd,
    reserve,
    settle_budget,
)
from gpuflow.cluster.cost.spend import start_of_today_utc

BUDGET = "GPUFLOW_DAILY_BUDGET_USD"


@pytest.fixture
def priced_spec(digits_spec):
    """$6/h for at most 30 minutes: each run may cost $3."""
    return digits_spec.model_copy(
        update={"limits": digits_spec.limits.model_copy(update={"hourly_rate_usd": 6.0, "max_runtime_minutes": 30})}
    )


def live(spec):
    return active_reservations(spec.tracking_uri, start_of_today_utc())


def finish_run(spec, flow_run_id, cost_usd):
    """What the flow leaves in MLflow at its end: a gpuflow run, tagged with its flow run, with its real cost."""
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.name) or client.get_experiment(client.create_experiment(spec.name))
    run = client.create_run(
        experiment.experiment_id, tags={"gpuflow.backend": "local", "prefect.flow_run_id": flow_run_id}
    )
    client.log_batch(run.info.run_id, metrics=[Metric("cost_usd", cost_usd, 0, 0)], synchronous=True)
    client.set_terminated(run.info.run_id, "FINISHED")


def test_second_run_is_refused_while_the_first_holds_its_reservation(priced_spec, monkeypatch):
    monkeypatch.setenv(BUDGET, "5")
    check_budget(priced_spec, "flow-run-a")  # reserves $3 of $5
    assert [(r.owner, r.amount_usd) for r in live(priced_spec)] == [("flow-run-a", 3.0)]
    with pytest.raises(BudgetExceeded) as refused:
        check_budget(priced_spec, "flow-run-b")
    assert "cost $3.00 and this one may cost $3.00" in str(refused.value), refused.value
    assert [r.owner for r in live(priced_spec)] == ["flow-run-a"]  # the refused run left no reservation

    # the first run ends having cost $0.40: its reservation gives way to that, and the second run fits
    finish_run(priced_spec, "flow-run-a", 0.40)
    settle_budget(priced_spec, "flow-run-a")
    assert live(priced_spec) == []
    assert committed_since_usd(priced_spec.tracking_uri, start_of_today_utc())[0] == pytest.approx(0.40)
    check_budget(priced_spec, "flow-run-b")
    assert [r.owner for r in live(priced_spec)] == ["flow-run-b"]


def test_a_running_run_counts_as_its_reservation_not_twice(priced_spec, monkeypatch):
    monkeypatch.setenv(BUDGET, "100")
    check_budget(priced_spec, "flow-run-a")
    finish_run(priced_spec, "flow-run-a", 0.25)  # its cost so far, logged while the reservation holds
    assert committed_since_usd(priced_spec.tracking_uri, start_of_today_utc())[0] == pytest.approx(3.0)


def test_a_lapsed_reservation_no_longer_counts(priced_spec):
    reserve(priced_spec.tracking_uri, "flow-run-dead", 3.0, hold_s=-1)  # its flow died and its time is up
    assert live(priced_spec) == []


@pytest.mark.parametrize("runs", [2, 4])
def test_simultaneous_runs_never_all_pass_a_budget_for_one(priced_spec, monkeypatch, runs):
    monkeypatch.setenv(BUDGET, "4")  # room for one $3 run, not two
    start = threading.Barrier(runs)
    passed, refused, errors = [], [], []

    def one_run(owner):
        start.wait()
        try:
            check_budget(priced_spec, owner)
            passed.append(owner)
        except BudgetExceeded as exc:
            refused.append(str(exc))
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(repr(exc))

    threads = [threading.Thread(target=one_run, args=(f"flow-run-{i}",)) for i in range(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert len(passed) + len(refused) == runs
    assert len(passed) <= 1, f"{passed} all passed a $4 budget at $3 each"
    assert all(BUDGET in message for message in refused)
    assert sorted(r.owner for r in live(priced_spec)) == passed  # refused runs released what they reserved


def test_validate_without_a_flow_run_only_reads(priced_spec, monkeypatch):
    monkeypatch.setenv(BUDGET, "5")
    check_budget(priced_spec)
    check_budget(priced_spec)
    assert live(priced_spec) == []
