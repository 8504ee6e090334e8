"""A reaper pass that needs no serve (flows/reconcile/overdue.py): a gpuflow command against a Prefect server on which
no pass started within the reaper's interval starts one, and one asker at a time does."""

from __future__ import annotations

import contextlib
import subprocess
from datetime import datetime, timedelta, timezone

import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.states import Crashed, Running, Scheduled

from gpuflow.cluster.protocol import FLOW_RUN_TAG
from gpuflow.flows.deployments import REAPER
from gpuflow.flows.reconcile.overdue import DECIDE, decided_here, overdue
from tests.support.processes import processes_of, wait_until
from tests.support.repo import REPO
from tests.support.servers import BIN, base_env, prefect_server


@flow(name=REAPER)
def a_pass():
    pass


@flow(name="an-experiment")
def an_experiment():
    pass


def reaper_runs(client) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[REAPER])))


def test_a_pass_is_overdue_once_none_started_within_the_reapers_interval_and_one_asker_decides(prefect_server):
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        started = client.create_flow_run(a_pass, state=Running())  # Running: Prefect gives it its start time
        now = datetime.now(timezone.utc)
        # the schedule's next passes, made ahead by the scheduler, outlive a kill -9 of every serve: not a pass run
        client.create_flow_run(a_pass, state=Scheduled(scheduled_time=now + timedelta(minutes=12)))
        assert not overdue(client, now)
        assert overdue(client, now + timedelta(minutes=11))  # the reaper's schedule is every 10 minutes
        client.set_flow_run_state(started.id, Crashed(), force=True)
        with contextlib.suppress(ObjectNotFound):
            client.delete_global_concurrency_limit_by_name(DECIDE)
        assert decided_here(client) and not decided_here(client)  # taken, and left to decay: never given back


@pytest.mark.full
def test_with_no_serve_up_the_next_command_starts_a_pass_that_ends_a_dead_runs_records(tmp_path, gpuflow_home):
    """The team's serves are all down, so no scheduled pass runs: `gpuflow status` finds none within the reaper's
    interval and starts one in the background, which closes the MLflow run that a crashed flow run left RUNNING. A
    second command at once starts no second pass."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with prefect_server(tmp_path / "prefect") as api_url, temporary_settings({PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            dead = client.create_flow_run(an_experiment, state=Running())
            client.set_flow_run_state(dead.id, Crashed(message="its process died"), force=True)
        mlflow = MlflowClient(f"sqlite:///{gpuflow_home}/mlflow.db")
        left = mlflow.create_run(mlflow.create_experiment("dead"), tags={FLOW_RUN_TAG: str(dead.id)}).info.run_id
        env = base_env(PREFECT_API_URL=api_url, GPUFLOW_HOME=str(gpuflow_home), GPUFLOW_OVERDUE_PASS="ask")

        def status() -> str:
            done = subprocess.run(
                [str(BIN / "gpuflow"), "status"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        first, second = status(), status()
        assert "one runs now" in first and "one runs now" not in second, (first, second)
        wait_until(lambda: mlflow.get_run(left).info.status != "RUNNING", 180, "the dead run's MLflow run closed")
        wait_until(lambda: processes_of(gpuflow_home) == [], 120, "the pass's process gone")
        with get_client(sync_client=True) as client:
            passes = reaper_runs(client)
    assert mlflow.get_run(left).info.status == "FAILED"
    assert [run.state.is_completed() for run in passes] == [True], [(run.name, run.state) for run in passes]


def test_a_wrong_value_of_the_setting_is_named_with_the_fix(monkeypatch, prefect_server):
    from gpuflow.cluster.config import SettingError
    from gpuflow.flows.reconcile.overdue import ask_for_a_pass_if_overdue

    monkeypatch.setenv("GPUFLOW_OVERDUE_PASS", "sometimes")
    with pytest.raises(SettingError, match="GPUFLOW_OVERDUE_PASS='sometimes': set it to ask or never"):
        ask_for_a_pass_if_overdue()
