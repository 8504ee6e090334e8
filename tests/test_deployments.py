"""prefect.yaml's deployments: declared right, served by `gpuflow serve`, run by a schedule, bad values refused.

.venv/bin/python -m pytest --full tests/test_deployments.py
"""

import uuid

import pytest

from gpuflow.cluster.spec import SpecError, parse_spec
from gpuflow.flows.deployments.deploy import declared, runner_deployments
from tests.support.repo import REPO


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # prefect.yaml's entrypoints are relative to the project folder


def test_prefect_yaml_declares_the_deployments():
    deployments = {entry["name"]: entry for entry in declared()}
    assert set(deployments) == {"run-experiment", "nightly-digits", "reap-clusters"}
    assert deployments["run-experiment"]["entrypoint"] == "flows/experiment.py:run_experiment"
    assert deployments["nightly-digits"]["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC"}]
    assert deployments["reap-clusters"]["entrypoint"] == "flows/reaper.py:reap_clusters"
    assert deployments["reap-clusters"]["schedules"] == [{"interval": 600, "anchor_date": "2026-01-01T00:00:00+00:00"}]
    for name in ("run-experiment", "nightly-digits"):
        spec = parse_spec(deployments[name]["parameters"]["spec"])
        assert spec.name == "digits-mlp" and spec.data.generate, name


def test_served_deployments_carry_the_form_schema_and_overrides():
    deployments = {d.name: d for d in runner_deployments(["train.epochs=3"])}
    assert set(deployments) == {"run-experiment", "nightly-digits", "reap-clusters"}
    assert deployments["reap-clusters"].schedules[0].schedule.interval.total_seconds() == 600
    run_experiment = deployments["run-experiment"]
    assert run_experiment.parameters["spec"]["train"]["epochs"] == 3
    schema = run_experiment._parameter_openapi_schema.model_dump()
    assert {"spec", "spec_file"} <= set(schema["properties"])
    train = schema["definitions"]["TrainSpec"]["properties"]
    assert train["epochs"]["description"] == "Passes over the training data." and train["epochs"]["default"] == 10
    assert [s.schedule.cron for s in deployments["nightly-digits"].schedules] == ["0 3 * * *"]
    with pytest.raises(SpecError, match="train.epochs"):
        runner_deployments(["train.epochs=0"])


@pytest.mark.full
def test_a_schedule_a_minute_away_runs_without_a_click(served, scheduled_run, second_serve_stopped):
    # the second serve, stopped before the schedule was added, left the deployment to the first
    assert "still served elsewhere: run-experiment/nightly-digits" in second_serve_stopped, second_serve_stopped[-2000:]
    assert scheduled_run.auto_scheduled
    assert scheduled_run.state.is_completed(), scheduled_run.state.message
    assert scheduled_run.name.startswith("digits-mlp-20")
    assert {"gpuflow", "nightly", "experiment:digits-mlp", "backend:local"} <= set(scheduled_run.tags)
    assert scheduled_run.parameters["spec"]["train"]["epochs"] == 2
    with served.client() as client:
        artifacts = client.read_artifacts()
    summary = [a for a in artifacts if a.flow_run_id == scheduled_run.id and a.type == "markdown"]
    assert summary and served.mlflow_url in summary[0].data and "val_accuracy" in summary[0].data


@pytest.mark.full
def test_the_schedule_on_unchanged_code_and_data_reuses_the_last_run_without_a_cluster(tmp_path, mlflow_url):
    """A serve of nightly-digits on a Prefect server of its own (the session's serves it too), reusing finished work
    (GPUFLOW_REUSE=finished; its experiment its own): a run of it trains; then its schedule fires on the same code,
    data and training, and that run trains nothing (no cluster, no MLflow run of its own), ends Completed and links
    the run it reused. Its seconds are a benchmark's (benchmarks/reuse_savings.py), not a test's."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from gpuflow.flows.run_tags import REUSED_TAG_PREFIX
    from tests.conftest import served_overrides
    from tests.support.runs import mlflow_run_of, mlflow_runs_of
    from tests.support.servers import ServedDeployments, gpuflow_serve, prefect_server, run_on_a_schedule_a_minute_away

    home = tmp_path / "served"
    overrides = [*served_overrides(mlflow_url, home), f"name=nightly-{uuid.uuid4().hex[:8]}"]
    reuse = {"GPUFLOW_REUSE": "finished"}
    with (
        prefect_server(tmp_path / "prefect") as api_url,
        gpuflow_serve(api_url, home, overrides, ("nightly-digits",), only=True, env=reuse),
    ):
        served = ServedDeployments(api_url, mlflow_url, home)
        deployment = served.deployment("nightly-digits")
        spec = {**deployment.parameters["spec"], "train": {**deployment.parameters["spec"]["train"], "epochs": 2}}
        with served.client() as client:
            first = client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec})
        first = served.wait_until_final(first.id)
        assert first.state.is_completed(), first.state.message
        again = run_on_a_schedule_a_minute_away(served, "nightly-digits", overrides={"epochs": 2})
        with served.client() as client:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[again.id])))
    _, trained = mlflow_run_of(mlflow_url, first.id)
    assert again.auto_scheduled and again.state.is_completed(), again.state.message
    assert REUSED_TAG_PREFIX + trained.info.run_id in again.tags
    assert mlflow_runs_of(mlflow_url, again.id)[1] == [], "no MLflow run of its own"
    assert not {"provision", "open-mlflow-run"} & {task.name.rsplit("-", 1)[0] for task in tasks}, tasks


@pytest.mark.full
def test_a_serve_killed_9_mid_run_leaves_its_run_to_end_whole(tmp_path, mlflow_url):
    """kill -9 of `gpuflow serve` alone, in the second after an epoch of its run: the run's process (the serve's
    child, its output the serve's pipe) trains on past its next log line and ends true: Completed, its MLflow run
    FINISHED with every epoch once, nothing of it left running."""
    from tests.conftest import served_overrides
    from tests.support.processes import processes_of, wait_until
    from tests.support.runs import mlflow_run_of
    from tests.support.servers import ServedDeployments, gpuflow_serve, prefect_server

    home = tmp_path / "served"
    with (
        prefect_server(tmp_path / "prefect") as api_url,
        gpuflow_serve(api_url, home, served_overrides(mlflow_url, home), ("run-experiment",), only=True) as serve,
    ):
        served = ServedDeployments(api_url, mlflow_url, home)
        deployment = served.deployment("run-experiment")
        spec = {**deployment.parameters["spec"], "train": {**deployment.parameters["spec"]["train"], "epochs": 12}}
        with served.client() as client:
            flow_run = client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec, "force": True})
        log = home / "serve.log"
        wait_until(lambda: "[gpuflow] epoch 1:" in log.read_text(errors="replace"), 300, "epoch 1", interval_s=0.2)
        serve.kill()
        serve.wait(30)
        ended = served.wait_until_final(flow_run.id)
        wait_until(lambda: processes_of(home) == [], 120, "the run's processes gone", interval_s=1)
    assert ended.state.is_completed(), ended.state.message
    client, run = mlflow_run_of(mlflow_url, flow_run.id)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")) == list(range(12))


def test_a_stopped_serve_pauses_what_nobody_else_serves(prefect_server):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_RUNNER_POLL_FREQUENCY, temporary_settings

    from gpuflow.flows.deployments.serve import pause_unless_served_elsewhere

    @flow(name="nightly-alone")
    def nightly_alone():
        pass

    with get_client(sync_client=True) as client:
        client.create_deployment(client.create_flow(nightly_alone), "alone")
        with temporary_settings({PREFECT_RUNNER_POLL_FREQUENCY: 1}):
            assert pause_unless_served_elsewhere(["nightly-alone/alone"]) == ["nightly-alone/alone"]
        assert client.read_deployment_by_name("nightly-alone/alone").paused


@pytest.mark.full
def test_a_bad_form_value_fails_the_run_naming_the_field(served):
    spec = served.deployment("run-experiment").parameters["spec"]
    bad = {**spec, "compute": {**spec["compute"], "accelerators": "H100:1"}}  # valid JSON schema, invalid spec
    with served.client() as client:
        flow_run = client.create_flow_run_from_deployment(
            served.deployment("run-experiment").id, parameters={"spec": bad}
        )
    flow_run = served.wait_until_final(flow_run.id)
    assert flow_run.state.is_failed()
    assert "compute" in flow_run.state.message and "backend: skypilot" in flow_run.state.message, flow_run.state.message


@pytest.mark.full
def test_a_value_outside_the_schema_is_refused_at_submission(served):
    spec = served.deployment("run-experiment").parameters["spec"]
    bad = {**spec, "train": {**spec["train"], "epochs": 0}}
    with served.client() as client, pytest.raises(Exception, match="epochs"):
        client.create_flow_run_from_deployment(served.deployment("run-experiment").id, parameters={"spec": bad})


@pytest.mark.full
def test_spec_file_is_used_instead_of_the_form(served, tmp_path):
    spec_file = tmp_path / "from-file.yaml"
    # where metrics go is the deployment's (its form_policy), so the file names the same tracking server
    spec_file.write_text(
        f"name: from-file\nworkdir: {REPO}\ntrain: {{loop: 'experiments.digits:train_loop'}}\n"
        "data: {train: /nonexistent/train.parquet, validation: null}\n"
        f"tracking: {{uri: '{served.mlflow_url}'}}\n"
    )
    deployment = served.deployment("run-experiment")
    with served.client() as client:
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"spec": deployment.parameters["spec"], "spec_file": str(spec_file)}
        )
    flow_run = served.wait_until_final(flow_run.id)
    assert flow_run.state.is_failed() and "data.train" in flow_run.state.message, flow_run.state.message
    assert flow_run.name.startswith("from-file-") and "experiment:from-file" in flow_run.tags


def next_reaper_run(client, deployment_id):
    """When the server's scheduler puts the deployment's next run, from the schedule it holds."""
    import asyncio

    from prefect.server.schemas.schedules import IntervalSchedule

    (schedule,) = client.read_deployment_schedules(deployment_id)
    return asyncio.run(IntervalSchedule(**schedule.schedule.model_dump()).get_dates(n=1))[0]


def test_a_serve_of_another_setup_is_refused_while_another_serves(prefect_server):
    """Each serve registers its deployments anew: a second serve of other code or another default spec would make
    every serve run its runs from the second's files. Refused, naming the field, while the first polls; the same
    setup (another machine of the team), or a deployment nobody serves, is served."""
    from prefect.client.orchestration import get_client

    from gpuflow.flows.deployments.serve import ServedElsewhere, refuse_a_takeover

    def setup(*overrides):
        [deployment] = runner_deployments(list(overrides), only=["run-experiment"])
        deployment.name = "takeover"  # the session's own run-experiment stays as it is
        return [deployment]

    deployment_id = setup("train.epochs=3")[0].apply()
    with get_client(sync_client=True) as client:
        try:
            client.get_scheduled_flow_runs_for_deployments([deployment_id])  # a serve's poll
            refuse_a_takeover(setup("train.epochs=3"))
            with pytest.raises(ServedElsewhere) as refused:
                refuse_a_takeover(setup("train.epochs=4", "train.lr=0.01"))
            assert "run-experiment/takeover is served now by another serve" in str(refused.value), refused.value
            assert "differ in spec.train.epochs, spec.train.lr." in str(refused.value), refused.value
            client.pause_deployment(deployment_id)  # as a serve that stops pauses what nobody else serves
            refuse_a_takeover(setup("train.epochs=4"))
        finally:
            client.delete_deployment(deployment_id)


def test_a_serve_restart_keeps_the_reapers_next_run(prefect_server):
    import time

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        first = runner_deployments(only=["reap-clusters"])[0].apply()
        before = next_reaper_run(client, first)
        time.sleep(1.5)  # a restart: Prefect's own default anchor would now be 1.5 s later
        again = runner_deployments(only=["reap-clusters"])[0].apply()
        assert again == first
        after = next_reaper_run(client, again)
    # on the same 10-minute grid, not 10 minutes from the restart (the grid's next point if it passed meanwhile)
    assert before.minute % 10 == 0 and before.second == 0, before
    assert (after - before).total_seconds() in (0, 600), (before, after)


def test_a_serve_start_asks_for_one_reaper_pass(prefect_server):
    from prefect.client.orchestration import get_client

    from gpuflow.flows.deployments.serve import reap_on_start

    assert reap_on_start(runner_deployments(only=["run-experiment"])) is None
    flow_run_id = reap_on_start(runner_deployments(only=["reap-clusters"]))
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        deployment = client.read_deployment(flow_run.deployment_id)
    assert deployment.name == "reap-clusters" and not flow_run.auto_scheduled
    # asked for, not failed: a runner of the session's API may have picked it up already (seen once: Submitting)
    assert flow_run.state.type.value in ("SCHEDULED", "PENDING", "RUNNING", "COMPLETED"), flow_run.state
    assert "serve-start" in flow_run.tags
