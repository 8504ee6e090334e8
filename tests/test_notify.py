"""Run messages: the webhook block `gpuflow notify add` saves, what a message says, each end said once, and a spec
whose block does not exist refused before anything starts. Real Prefect (its test API), real MLflow, a real HTTP
receiver; the runs that send them for real are in the fault tests (failing loop, budget, kill -9, recovery)."""

from mlflow import MlflowClient

from gpuflow.cluster.run.notify import NOTIFIED_TAG, Event, send, send_once, short_reason
from gpuflow.flows.cli import main as gpuflow
from tests.support.servers import the_one_message, webhook_receiver

EVENT = Event("stopped", "digits-mlp-2026-11-26-0300", "stopped_by=budget: stopped by budget: $2.00 spent", 2.0,
              "http://mlflow.team:5000/#/experiments/1/runs/abc", "http://prefect.team:4200/runs/flow-run/f00")


def test_a_saved_block_sends_the_event_with_its_reason_cost_and_links(prefect_server, capsys):
    from gpuflow.flows.notify import webhook_of

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


def test_an_unreachable_webhook_is_reported_without_its_address():
    with webhook_receiver() as (url, _):
        pass  # stopped: nothing listens there now
    failure = send({"url": url, "json_data": {"text": "{{body}}"}}, EVENT)
    assert failure and failure.startswith("notification not delivered") and url not in failure


def test_a_long_failure_becomes_one_line_with_the_loops_error():
    message = ("Flow run encountered an exception: JobFailed: training job failed with exit code 1; the end of its "
               "log:\n(TrainController pid=7) Traceback (most recent call last):\n(TrainController pid=7) "
               "RuntimeError: fail_at_epoch=2: failing on purpose\nray.train.WorkerGroupError: Training failed")
    assert short_reason(message) == ("Flow run encountered an exception: JobFailed: training job failed with exit "
                                     "code 1; the end of its log ... RuntimeError: fail_at_epoch=2: failing on purpose")
    assert "\n" not in short_reason("a\nb") and len(short_reason("x" * 5000)) <= 400


def test_a_spec_naming_a_missing_block_is_refused_before_anything_starts(prefect_server, digits_spec, gpuflow_home):
    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.experiment import run_experiment

    state = run_experiment(digits_spec.model_copy(update={"notify": NotifySpec(block="nobody-made-this")}),
                           return_state=True)
    assert state.is_failed() and "notify.block: 'nobody-made-this'" in state.message, state.message
    assert "gpuflow notify add nobody-made-this URL" in state.message
    assert not (gpuflow_home / "clusters").exists() or not any((gpuflow_home / "clusters").iterdir())


def test_validate_refuses_a_missing_block_naming_the_field(prefect_server, capsys):
    from tests.support.repo import REPO

    code = gpuflow(["validate", str(REPO / "experiments" / "digits.yaml"), "--set", "notify.block=no-such-block"])
    err = capsys.readouterr().err
    assert code == 2 and "notify.block: 'no-such-block' cannot be loaded" in err, err
