"""A failing loop end to end under a real Prefect API (tests/support/runs.py reads a run back); the quickstart's own
run is in tests/test_digits_run.py."""

from pathlib import Path

import pytest
import torch

from gpuflow.flows.experiment import run_experiment
from tests.support.processes import processes_of
from tests.support.runs import flow_logs, mlflow_run_of


@pytest.mark.full
def test_a_failing_loop_fails_everything_and_keeps_checkpoints(prefect_server, digits_spec, gpuflow_home):
    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.run_messages import add_webhook
    from tests.support.servers import the_one_message, webhook_receiver

    spec = digits_spec.model_copy(
        update={
            "train": digits_spec.train.model_copy(
                update={"epochs": 4, "params": {**digits_spec.train.params, "fail_at_epoch": 2}}
            )
        }
    )
    with webhook_receiver() as (url, messages):
        add_webhook("failures", url)
        state = run_experiment(spec.model_copy(update={"notify": NotifySpec(block="failures")}), return_state=True)
        flow_run_id = state.state_details.flow_run_id
        assert state.is_failed()

        _, run = mlflow_run_of(spec.tracking_uri, flow_run_id, spec.experiment_name)
        message = the_one_message(messages, "failed", run.info.run_id, str(flow_run_id))
    assert "fail_at_epoch=2: failing on purpose" in message["reason"], message
    assert run.info.status == "FAILED"
    logs = flow_logs(flow_run_id)
    assert "Traceback" in logs and "fail_at_epoch=2: failing on purpose" in logs

    storage = Path(run.data.tags["gpuflow.checkpoints"])
    assert storage.parent == Path(spec.checkpoint_uri)
    saved = sorted(storage.glob("checkpoint_*/checkpoint.pt"))
    assert [torch.load(path, weights_only=False)["epoch"] for path in saved] == [0, 1]
    assert processes_of(gpuflow_home) == []
