"""The watchdog stops a real running job (local Ray) on budget and on timeout (run KILLED, tagged, checkpoint kept),
and the job's guard stops a loop that no longer reports (run FAILED, its workers' stacks saved)."""

from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.backends.local import LocalBackend
from tests.loops import PACED_LOOP_IN_MEMORY, WAITING_RUN_ENVS
from tests.support.processes import processes_of

pytestmark = pytest.mark.full


# The limits: room for the cluster and Ray Train's workers to start, so that the stop comes mid-training. This
# module's three flows start at once, beside two other lanes of the suite (tests/conftest.py) on two cores: in CI a
# job has gone 98 s, and once 120 s, without its first epoch. The budget's bill starts with provisioning, the
# timeout's clock with the job: the budget needs the provisioning's time more.
LIMIT_MINUTES = 3.0
BUDGET_MINUTES = 4.0
HUNG_MINUTES = 0.75


def long_job(spec, **limits):
    """A job far longer than its limits: one worker, an epoch a second, so that the machine stays usable; its digits
    in memory (what stops it is the limit, not Ray Data's ingest)."""
    return spec.model_copy(
        update={
            "train": spec.train.model_copy(
                update={"loop": PACED_LOOP_IN_MEMORY, "epochs": 5000, "params": {**spec.train.params, "pace_s": 1.0}}
            ),
            "data": None,
            "envs": {**spec.envs, **WAITING_RUN_ENVS},
            "compute": spec.compute.model_copy(update={"workers_per_node": 1, "num_workers": 1}),
            "limits": spec.limits.model_copy(update=limits),
            "tracking": spec.tracking.model_copy(update={"register_model": False}),
        }
    )


def stopped_run(spec, state):
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    flow_run_id = str(state.state_details.flow_run_id)
    [run] = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'"
    )
    return run


def assert_stopped_and_clean(spec, state, reason):
    assert state.is_failed(), state
    run = stopped_run(spec, state)
    assert run.info.status == "KILLED"
    assert run.data.tags["stopped_by"] == reason
    for metric in ("cost_usd", "cluster_hours", "provision_seconds", "idle_seconds_before_teardown"):
        assert metric in run.data.metrics, metric
    assert "train_loss" in run.data.metrics  # it trained: the stop came mid-run
    checkpoint = Path(run.data.tags["gpuflow.checkpoint"])
    assert (checkpoint / "checkpoint.pt").is_file(), "the last checkpoint must be kept"
    return run


@pytest.fixture(scope="module")
def stopped_flows(prefect_server, tmp_path_factory):
    """Three flows at once, each stopped by a limit: budget, timeout and a hung loop. Each limit waits minutes of wall
    time; side by side the tests wait them out once. The budget's run names a webhook block: its messages."""
    import threading

    from gpuflow.cluster.spec import load_spec
    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.experiment import run_experiment
    from gpuflow.flows.run_messages import add_webhook
    from tests.loops import HANGING_LOOP
    from tests.support.repo import REPO
    from tests.support.servers import webhook_receiver

    home = tmp_path_factory.mktemp("watchdog") / "gpuflow-home"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPUFLOW_HOME", str(home))

        digits = load_spec(
            REPO / "experiments" / "digits.yaml", [f"workdir={REPO}", f"tracking.uri=sqlite:///{home}/mlflow.db"]
        )

        # $2 per second; the budget allows BUDGET_MINUTES of it: the estimate (rate × max runtime) passes, but the
        # bill also counts provisioning, so the budget runs out before the job's own BUDGET_MINUTES do.
        hung = long_job(digits, hung_minutes=HUNG_MINUTES, max_runtime_minutes=10)
        specs = {
            "budget": long_job(
                digits,
                hourly_rate_usd=7200.0,
                max_runtime_minutes=BUDGET_MINUTES,
                max_cost_usd=BUDGET_MINUTES * 120,
            ).model_copy(update={"notify": NotifySpec(block="budget")}),
            "timeout": long_job(digits, max_runtime_minutes=LIMIT_MINUTES),
            "hung": hung.model_copy(
                update={"train": hung.train.model_copy(update={"loop": HANGING_LOOP, "params": {"hang_after": 3}})}
            ),
        }
        states = {}
        flows = [
            threading.Thread(
                target=lambda name=name, spec=spec: states.update({name: run_experiment(spec, return_state=True)})
            )
            for name, spec in specs.items()
        ]
        with webhook_receiver() as (url, messages):
            add_webhook("budget", url)
            for flow in flows:
                flow.start()
            for flow in flows:
                flow.join()
            yield home, specs, states, messages


@pytest.mark.timeout(900)  # the module's three flows run in the setup of whichever test comes first
def test_budget_and_timeout_each_stop_a_running_job(stopped_flows):
    from tests.support.servers import the_one_message

    home, specs, states, messages = stopped_flows
    budget_spec, state = specs["budget"], states["budget"]
    run = stopped_run(budget_spec, state)
    message = the_one_message(messages, "stopped", run.info.run_id, str(state.state_details.flow_run_id))
    budget = budget_spec.limits.max_cost_usd
    assert "stopped_by=budget" in message["reason"] and float(message["cost"].lstrip("$")) >= budget, message
    assert "stopped by budget: $" in state.message and f"of max_cost_usd={budget:.2f}" in state.message, state.message
    run = assert_stopped_and_clean(budget_spec, state, "budget")
    assert run.data.metrics["cost_usd"] >= budget

    state, limit = states["timeout"], f"max_runtime_minutes is {LIMIT_MINUTES:g}"
    assert "stopped by timeout" in state.message and limit in state.message, state.message
    assert_stopped_and_clean(specs["timeout"], state, "timeout")
    assert_nothing_left(home)


@pytest.mark.timeout(900)
def test_a_loop_that_stops_reporting_is_stopped_as_hung_with_its_stacks(stopped_flows):
    home, specs, states, _ = stopped_flows
    spec, state = specs["hung"], states["hung"]
    assert state.is_failed() and "has not reported for" in state.message, state.message
    run = stopped_run(spec, state)
    assert (run.info.status, run.data.tags["stopped_by"]) == ("FAILED", "hung")
    losses = MlflowClient(spec.tracking_uri).get_metric_history(run.info.run_id, "train_loss")
    assert [loss.step for loss in losses] == [0, 1, 2]
    # stopped within the limit and the guard's poll after the last report, not at max_runtime_minutes
    silent_s = run.info.end_time / 1000 - losses[-1].timestamp / 1000
    # the guard's poll, the stacks' dump (up to 30 s for a worker to run it) and a busy machine's margin
    assert HUNG_MINUTES * 60 <= silent_s <= HUNG_MINUTES * 60 + 120, silent_s
    stacks = Path(
        MlflowClient(spec.tracking_uri).download_artifacts(run.info.run_id, "hung/stacks.txt", str(home / "stacks"))
    ).read_text()
    assert 'loops/hanging.py", line 12 in train_loop' in stacks, stacks[-3000:]
    assert_nothing_left(home)


def assert_nothing_left(home: Path) -> None:
    assert LocalBackend(home / "clusters").status() == []
    assert processes_of(home) == []
