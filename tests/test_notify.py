"""Run messages: the webhook block `gpuflow notify add` saves, what a message says, each end said once, and a spec
whose block does not exist refused before anything starts. Real Prefect (its test API), real MLflow, a real HTTP
receiver; the runs that send them for real are in the fault tests (failing loop, budget, kill -9, recovery)."""

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.protocol import (
    FLOW_RUN_TAG,
    NOTIFIED_TAG,
    NOTIFY_BLOCK_TAG,
    NOTIFY_FAILED_TAG,
    NOTIFY_SENDING_TAG,
    STOPPED_BY_TAG,
)
from gpuflow.cluster.run import webhook
from gpuflow.cluster.run.mlflow_run import runs_of_flow_run
from gpuflow.cluster.run.webhook import Event, send, send_once, short_reason
from gpuflow.cluster.spec.notifying import NotifySpec
from gpuflow.cluster.util.processes import started_at
from gpuflow.flows.cli import main as gpuflow
from tests.support.servers import the_one_message, webhook_receiver

EVENT = Event(
    "stopped",
    "digits-mlp-2026-11-26-0300",
    "stopped_by=budget: stopped by budget: $2.00 spent",
    2.0,
    "http://mlflow.team:5000/#/experiments/1/runs/abc",
    "http://prefect.team:4200/runs/flow-run/f00",
)


def test_a_saved_block_sends_the_event_with_its_reason_cost_and_links(prefect_server, capsys):
    from gpuflow.flows.run_messages import webhook_of

    with webhook_receiver() as (url, messages):
        assert gpuflow(["notify", "add", "team-alerts", url, "--format", "slack"]) == 0
        assert "notify block 'team-alerts' saved (slack messages)" in capsys.readouterr().out
        webhook = webhook_of("team-alerts")
        assert webhook["url"] == "{{webhook_url}}", "the URL is one of the block's secrets, not a plain field"
        assert send(webhook, EVENT) is None
        [slack] = messages
    assert slack["text"].startswith("*gpuflow: digits-mlp-2026-11-26-0300 stopped*\nreason: stopped_by=budget")
    assert "cost so far: $2.00" in slack["text"] and EVENT.mlflow_url in slack["text"]

    with webhook_receiver() as (url, messages):
        assert gpuflow(["notify", "add", "team-alerts", url]) == 0  # replaced, in the generic JSON format
        assert send(webhook_of("team-alerts"), EVENT) is None
        fields = the_one_message(messages, "stopped", "abc", "f00", timeout_s=5)
    assert fields["cost"] == "$2.00" and fields["run"] == EVENT.run


def test_an_end_is_sent_once_whoever_sends_it(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("once")).info.run_id
    with webhook_receiver() as (url, messages):
        webhook = {"url": url, "json_data": {"subject": "{{subject}}", "body": "{{body}}"}}
        assert send_once(client, run_id, webhook, EVENT) is None  # the job's guard, say
        assert send_once(client, run_id, webhook, EVENT) is None  # then the reaper: already said
        assert len(messages) == 1
    assert client.get_run(run_id).data.tags[NOTIFIED_TAG].startswith("stopped 20"), "the event, and when"


def test_every_message_of_one_event_carries_one_dedupe_key():
    """What a receiver drops a repeat by, when two senders both said a run's end: the run and its end (or which
    recovery), in the Idempotency-Key header."""
    from dataclasses import replace

    from gpuflow.flows.run_messages import FORMATS

    got = []
    with webhook_receiver(headers=got) as (url, _):
        webhook = {"url": url, "json_data": FORMATS["json"]}
        crashed = replace(EVENT, event="crashed")  # the same end, said by another sender in other words
        recovered = Event("recovered", EVENT.run, "lost", dedupe_key=f"{EVENT.run}:recovered:1")
        for event in (EVENT, crashed, recovered):
            assert send(webhook, event) is None
    end, recovery = f"{EVENT.run}:end", f"{EVENT.run}:recovered:1"
    assert [sent["Idempotency-Key"] for sent in got] == [end, end, recovery]


def test_an_unreachable_webhook_is_reported_without_its_address(monkeypatch):
    quick_retries(monkeypatch, 1)
    with webhook_receiver() as (url, _):
        pass  # stopped: nothing listens there now
    failure = send({"url": url, "json_data": {"text": "{{body}}"}}, EVENT)
    assert failure and failure.startswith("notification not delivered") and url not in failure


def test_a_long_failure_becomes_one_line_with_the_loops_error():
    message = (
        "Flow run encountered an exception: JobFailed: training job failed with exit code 1; the end of its "
        "log:\n(TrainController pid=7) Traceback (most recent call last):\n(TrainController pid=7) "
        "RuntimeError: fail_at_epoch=2: failing on purpose\nray.train.WorkerGroupError: Training failed"
    )
    assert short_reason(message) == (
        "Flow run encountered an exception: JobFailed: training job failed with exit "
        "code 1; the end of its log ... RuntimeError: fail_at_epoch=2: failing on purpose"
    )
    assert "\n" not in short_reason("a\nb") and len(short_reason("x" * 5000)) <= 400


def test_a_spec_naming_a_missing_block_is_refused_before_anything_starts(prefect_server, digits_spec, gpuflow_home):
    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.experiment import run_experiment

    state = run_experiment(
        digits_spec.model_copy(update={"notify": NotifySpec(block="nobody-made-this")}), return_state=True
    )
    assert state.is_failed() and "notify.block: 'nobody-made-this'" in state.message, state.message
    assert "gpuflow notify add nobody-made-this URL" in state.message
    assert not (gpuflow_home / "clusters").exists() or not any((gpuflow_home / "clusters").iterdir())


def test_validate_refuses_a_missing_block_naming_the_field(prefect_server, capsys):
    from tests.support.repo import REPO

    code = gpuflow(["validate", str(REPO / "experiments" / "digits.yaml"), "--set", "notify.block=no-such-block"])
    err = capsys.readouterr().err
    assert code == 2 and "notify.block: 'no-such-block' cannot be loaded" in err, err


# -- at least once, said once (issue #38): a webhook down for a while, one never up, a sender that died -----------


def quick_retries(monkeypatch, bound_s: float) -> None:
    """The retry bound shortened so that a test lasts seconds: first retry after 0.1 s, then 0.2, 0.4 ..."""
    monkeypatch.setattr(webhook, "RETRY_BOUND_S", bound_s)
    monkeypatch.setattr(webhook, "FIRST_RETRY_S", 0.1)


def test_a_webhook_down_for_its_first_tries_gets_the_message_once(tmp_path, monkeypatch, caplog):
    quick_retries(monkeypatch, 10)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("down-then-up")).info.run_id
    with webhook_receiver(down_for=3) as (url, messages), caplog.at_level(logging.WARNING, webhook.__name__):
        assert send_once(client, run_id, {"url": url, "json_data": {"text": "{{body}}"}}, EVENT) is None
        assert send_once(client, run_id, {"url": url, "json_data": {"text": "{{body}}"}}, EVENT) is None
        assert len(messages) == 1, messages
    tags = client.get_run(run_id).data.tags
    assert tags[NOTIFIED_TAG].startswith("stopped 20") and NOTIFY_FAILED_TAG not in tags
    assert NOTIFY_SENDING_TAG not in tags, "the claim is let go once the message is out"
    tries = [r.getMessage() for r in caplog.records if "failed: HTTP 503" in r.getMessage()]
    assert len(tries) == 3 and url not in " ".join(tries), tries


def test_two_senders_at_once_send_one_message(tmp_path, monkeypatch):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("race")).info.run_id
    with webhook_receiver() as (url, messages):
        webhook = {"url": url, "json_data": {"text": "{{body}}"}}
        senders = [threading.Thread(target=send_once, args=(client, run_id, webhook, EVENT)) for _ in range(2)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(30)
        assert len(messages) == 1, messages


def test_a_client_error_is_not_retried_a_busy_webhook_is():
    error = lambda code: urllib.error.HTTPError("http://x", code, "", {}, None)  # noqa: E731
    assert webhook.failure_of(error(404)) == ("HTTP 404", True)
    assert webhook.failure_of(error(429)) == ("HTTP 429", False) and webhook.failure_of(error(503))[1] is False


def open_and_close_this_flows_run(spec, block: str, status: str) -> None:
    """Inside a flow: its MLflow run, opened as an experiment opens it (naming its webhook block), closed `status`."""
    from prefect import runtime

    client = MlflowClient(spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    run = client.create_run(
        experiment.experiment_id if experiment else client.create_experiment(spec.experiment_name),
        tags={FLOW_RUN_TAG: runtime.flow_run.id, NOTIFY_BLOCK_TAG: block},
    )
    client.set_terminated(run.info.run_id, status)


def failing_flow_run(spec, block: str):
    """A flow run that fails as an experiment does, with the real end hook: its MLflow run FAILED, then raised."""
    from prefect import flow

    from gpuflow.flows.run_messages import notify_end

    @flow(name="run-experiment", on_failure=[notify_end])
    def failing_experiment(spec: dict):
        open_and_close_this_flows_run(spec_obj, block, "FAILED")
        raise RuntimeError("fail_at_epoch=2: failing on purpose")

    spec_obj = spec.model_copy(update={"notify": NotifySpec(block=block)})
    state = failing_experiment(spec_obj.model_dump(mode="json"), return_state=True)
    client = MlflowClient(spec_obj.tracking_uri)
    [run] = runs_of_flow_run(client, str(state.state_details.flow_run_id), spec_obj.experiment_name)
    return state, client.get_run(run.info.run_id)


def test_a_flow_whose_webhook_is_down_at_first_says_its_end_once(prefect_server, digits_spec, monkeypatch):
    quick_retries(monkeypatch, 10)
    with webhook_receiver(down_for=2) as (url, messages):
        assert gpuflow(["notify", "add", "down-at-first", url]) == 0
        state, run = failing_flow_run(digits_spec, "down-at-first")
        assert len(messages) == 1 and messages[0]["subject"].endswith(" failed"), messages
    assert state.is_failed() and "failing on purpose" in state.message
    assert run.info.status == "FAILED" and run.data.tags[NOTIFIED_TAG].startswith("failed 20")


def test_a_webhook_never_up_leaves_the_end_as_it_was_and_says_so(prefect_server, digits_spec, monkeypatch, caplog):
    from gpuflow.flows.cli.status import status, table

    quick_retries(monkeypatch, 1.5)
    with webhook_receiver() as (url, _):
        assert gpuflow(["notify", "add", "never-up", url]) == 0
    with caplog.at_level(logging.WARNING):
        state, run = failing_flow_run(digits_spec, "never-up")
    assert state.is_failed() and "failing on purpose" in state.message, "the run's end is its own, not the message's"
    assert run.info.status == "FAILED" and NOTIFIED_TAG not in run.data.tags
    when, _, failure = run.data.tags[NOTIFY_FAILED_TAG].partition(" ")
    assert when.startswith("20") and "ConnectionRefusedError" in failure and url not in failure, failure
    logged = caplog.text
    assert "try 1 failed: ConnectionRefusedError" in logged and "notification not delivered after" in logged, logged
    lines = [line for line in table(status()).splitlines() if "not delivered" in line]
    assert len(lines) == 1 and run.info.run_name in lines[0] and "ConnectionRefusedError" in lines[0], lines


def crashed_run_owing_its_message(spec, block: str, **tags: str) -> tuple[object, MlflowClient, str]:
    """A run-experiment flow run Crashed (its flow and job killed) and its MLflow run FAILED, its end unsaid: the
    flow run, the MLflow client and the run's id."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from gpuflow.flows.reaper import reap_clusters

    spec = spec.model_copy(update={"notify": NotifySpec(block=block)})
    with get_client(sync_client=True) as prefect:
        flow_run = prefect.create_flow_run(
            reap_clusters.with_options(name="run-experiment"), parameters={"spec": spec.model_dump(mode="json")}
        )
        prefect.set_flow_run_state(flow_run.id, Crashed(message="its process died"), force=True)
    client = MlflowClient(spec.tracking_uri)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    experiment = experiment.experiment_id if experiment else client.create_experiment(spec.experiment_name)
    tags = {FLOW_RUN_TAG: str(flow_run.id), NOTIFY_BLOCK_TAG: block, STOPPED_BY_TAG: "orphaned", **tags}
    run_id = client.create_run(experiment, tags=tags).info.run_id
    client.set_terminated(run_id, "FAILED")
    return flow_run, client, run_id


def a_dead_senders_claim(how: str) -> str:
    if how == "an hour old":
        return f"{time.time() - 3600:.3f} dead"
    # just made, by a process of this host that is gone: a serve stopped while a run's end hook sent
    sender = subprocess.Popen([sys.executable, "-c", "pass"])
    started = started_at(sender.pid)
    sender.wait()
    return f"{time.time():.3f} dead {socket.gethostname()} {sender.pid} {started}"


def test_a_live_senders_claim_holds_for_a_whole_send():
    """Its process alive (this one), a claim holds until one whole send is over; another host's, by age alone."""
    now = time.time()
    here = f"{socket.gethostname()} {os.getpid()} {started_at()}"
    assert not webhook.may_claim({NOTIFY_SENDING_TAG: f"{now - 60:.3f} live {here}"}, now)
    assert not webhook.may_claim({NOTIFY_SENDING_TAG: f"{now - 60:.3f} live elsewhere 1 1.0"}, now)
    assert webhook.may_claim({NOTIFY_SENDING_TAG: f"{now - 3600:.3f} live elsewhere 1 1.0"}, now)


@pytest.mark.parametrize("claim", ["an hour old", "just made, its process gone"])
def test_the_reapers_pass_sends_what_a_dead_sender_did_not_once(prefect_server, digits_spec, monkeypatch, claim):
    from gpuflow.flows.reaper import reap_clusters

    quick_retries(monkeypatch, 5)
    with webhook_receiver() as (url, messages):
        assert gpuflow(["notify", "add", "reaped", url]) == 0
        flow_run, client, run_id = crashed_run_owing_its_message(
            digits_spec, "reaped", **{NOTIFY_SENDING_TAG: a_dead_senders_claim(claim)}
        )
        said_before = client.create_run(
            client.get_run(run_id).info.experiment_id,
            tags={
                FLOW_RUN_TAG: str(flow_run.id),
                NOTIFY_BLOCK_TAG: "reaped",
                NOTIFIED_TAG: "crashed 2026-11-26T00:00:00Z",
            },
        ).info.run_id
        client.set_terminated(said_before, "FAILED")

        reap_clusters(backends=["local"], tracking_uris=[digits_spec.tracking_uri])
        assert len(messages) == 1 and messages[0]["subject"] == f"gpuflow: {flow_run.name} crashed", messages
        reap_clusters(backends=["local"], tracking_uris=[digits_spec.tracking_uri])
        time.sleep(0.5)
        assert len(messages) == 1, "a second pass sends nothing"
    tags = client.get_run(run_id).data.tags
    assert tags[NOTIFIED_TAG].startswith("crashed 20") and NOTIFY_SENDING_TAG not in tags


def test_a_pass_tries_a_webhook_that_is_down_once_and_the_next_pass_says_it(prefect_server, digits_spec):
    """The passes are a message's retries: one try each, so that a webhook down holds no pass for the two minutes
    a flow's own send retries (a team's serve passes every ten minutes, and may owe many messages)."""
    from gpuflow.flows.reaper import reap_clusters

    with webhook_receiver(down_for=1) as (url, messages):
        assert gpuflow(["notify", "add", "down-for-a-pass", url]) == 0
        flow_run, client, run_id = crashed_run_owing_its_message(digits_spec, "down-for-a-pass")
        reap_clusters(backends=["local"], tracking_uris=[digits_spec.tracking_uri])
        tags = client.get_run(run_id).data.tags
        assert messages == [] and "after 1 tries: HTTP 503" in tags[NOTIFY_FAILED_TAG], tags
        reap_clusters(backends=["local"], tracking_uris=[digits_spec.tracking_uri])
        assert len(messages) == 1 and messages[0]["subject"] == f"gpuflow: {flow_run.name} crashed", messages
    assert client.get_run(run_id).data.tags[NOTIFIED_TAG].startswith("crashed 20")


def test_a_cancel_that_timed_out_is_not_said_as_a_crash(prefect_server, digits_spec):
    """A runner kills a run whose cancel timed out and calls its crash hooks; Prefect then ends it Cancelled: the
    user asked for that end, which is never messaged. A crash of a run nobody cancelled is."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling, Crashed, Running

    from gpuflow.flows.experiment import run_experiment
    from gpuflow.flows.run_messages import notify_end

    with webhook_receiver() as (url, messages):
        assert gpuflow(["notify", "add", "cancelled-block", url]) == 0
        spec = digits_spec.model_copy(update={"notify": NotifySpec(block="cancelled-block")})
        with get_client(sync_client=True) as prefect:
            runs = [
                prefect.create_flow_run(run_experiment, parameters={"spec": spec.model_dump(mode="json")})
                for _ in range(2)
            ]
            for flow_run, state in zip(runs, [Cancelling(), Running()], strict=True):
                prefect.set_flow_run_state(flow_run.id, state, force=True)
            for flow_run in runs:
                notify_end(run_experiment, prefect.read_flow_run(flow_run.id), Crashed(message="killed"))
        time.sleep(0.5)
        assert [message["subject"] for message in messages] == [f"gpuflow: {runs[1].name} crashed"]


def test_ends_no_pass_would_find_unsaid_in_mlflow_are_owed_and_said_once_by_passes_side_by_side(
    prefect_server, digits_spec, monkeypatch
):
    """Two bad ends while the webhook is down that no MLflow run records as owed (the passes retry FAILED and KILLED
    MLflow runs): a run refused before it opened its MLflow run (its tracking server down as it checked the spec),
    and a run whose training FINISHED but whose teardown failed. Each flow run records the debt (notify-owed), and the
    passes say each once, two passes at once included (they say messages in turns)."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    from gpuflow.flows.reconcile.invariants import Pass, send_unsaid
    from gpuflow.flows.run_messages import OWED_TAG, notify_end

    quick_retries(monkeypatch, 1.0)
    spec = digits_spec.model_copy(update={"notify": NotifySpec(block="down-at-the-end")})

    @flow(name="run-experiment", on_failure=[notify_end])
    def refused(spec: dict):
        raise RuntimeError("tracking.uri: the MLflow server does not answer")

    @flow(name="run-experiment", on_failure=[notify_end])
    def trained_then_not_torn_down(spec: dict):
        open_and_close_this_flows_run(digits_spec, "down-at-the-end", "FINISHED")
        raise RuntimeError("could not tear down cluster gpuflow-x after 3 tries")

    with webhook_receiver() as (url, _):
        assert gpuflow(["notify", "add", "down-at-the-end", url]) == 0  # and then it is gone
    ids = []
    for failing in (refused, trained_then_not_torn_down):
        state = failing(spec.model_dump(mode="json"), return_state=True)
        assert state.is_failed()
        ids.append(str(state.state_details.flow_run_id))
    with get_client(sync_client=True) as client:
        assert all(OWED_TAG in client.read_flow_run(flow_run_id).tags for flow_run_id in ids)

    with webhook_receiver() as (url, messages):
        assert gpuflow(["notify", "add", "down-at-the-end", url]) == 0  # back, at a new address
        passes = [threading.Thread(target=send_unsaid, args=(Pass([], [spec.tracking_uri]),)) for _ in range(2)]
        for one in passes:
            one.start()
        for one in passes:
            one.join(60)
        time.sleep(0.5)
        for flow_run_id in ids:
            said = [m for m in messages if flow_run_id in str(m)]
            assert len(said) == 1 and said[0]["subject"].endswith(" failed"), messages
    with get_client(sync_client=True) as client:
        assert not any(OWED_TAG in client.read_flow_run(flow_run_id).tags for flow_run_id in ids)
