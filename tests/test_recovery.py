"""A lost node or cluster mid-training (real local Ray cluster, processes SIGKILLed): the flow relaunches it (as
<name>-r1, then -r2), resumes from the last checkpoint, in the same MLflow run, and logs every epoch once. With a
spot notice first (a double of the cloud's metadata service), the loop checkpoints until the node goes and the
flow provisions the replacement cluster before the loss."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from gpuflow.cluster.backends.local import NODES_FILE, LocalBackend
from gpuflow.cluster.util.processes import stop_sessions
from tests.loops import STEPPED_LOOP
from tests.support.processes import processes_of
from tests.support.runs import flow_logs, mlflow_run_of

pytestmark = pytest.mark.full

EPOCHS = 10  # the first loss comes after 3 checkpoints, the next 2 checkpoints after the resume


def two_nodes(spec, **compute):
    return spec.model_copy(update={
        "train": spec.train.model_copy(update={"epochs": EPOCHS}),
        "compute": spec.compute.model_copy(update={"num_nodes": 2, "workers_per_node": 1, "num_workers": 2, **compute}),
        "tracking": spec.tracking.model_copy(update={"register_model": False}),
    })


class NodeKiller(threading.Thread):
    """Once `after` checkpoints exist, SIGKILLs a part of the running local cluster: each of `losses` in turn, the
    next once the resumed run has checkpointed twice more."""

    def __init__(self, home: Path, *losses: str, after: int = 3):
        super().__init__(daemon=True)
        self.home, self.losses, self.after = home, losses, after
        self.killed: list[str] = []

    def checkpoints(self) -> int:
        return len(list(self.home.glob("checkpoints/*/checkpoint_*")))

    def run(self):
        deadline = time.monotonic() + 600
        target = self.after
        while len(self.killed) < len(self.losses) and time.monotonic() < deadline:
            clusters = [s for s in LocalBackend().status() if s.status == "UP"]
            if self.checkpoints() >= target and clusters:
                record = LocalBackend().record(clusters[0].name)
                nodes = Path(record["temp_dir"]) / NODES_FILE
                if nodes.exists():
                    self.kill(self.losses[len(self.killed)], record, json.loads(nodes.read_text()))
                    target = self.checkpoints() + 2  # the next loss after the resumed run checkpointed again
            time.sleep(0.2)

    def kill(self, what: str, record, nodes):
        if what == "worker node":
            [worker] = [node for node in nodes if not node["head"]]
            os.kill(worker["raylet"], signal.SIGKILL)
        else:  # the whole cluster, head included: every process of its session
            stop_sessions([record["session"]])
        self.killed.append(what)


def epochs_logged(spec, run) -> list[int]:
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy"))


def test_a_lost_node_is_relaunched_and_training_resumes_in_the_same_run(prefect_server, digits_spec, gpuflow_home):
    """One run loses a worker node, then, once resumed, its whole cluster: each loss is relaunched and resumed."""
    from gpuflow.flows.experiment import run_experiment

    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.notify import add_webhook
    from tests.support.servers import the_messages, webhook_receiver

    spec = two_nodes(digits_spec)
    killer = NodeKiller(gpuflow_home, "worker node", "whole cluster")
    with webhook_receiver() as (url, messages):
        add_webhook("recoveries", url)
        killer.start()
        state = run_experiment(spec.model_copy(update={"notify": NotifySpec(block="recoveries")}), return_state=True)
        assert killer.killed == ["worker node", "whole cluster"]
        assert state.is_completed(), state.message
        _, run = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
        # a message per recovery: a completed run says nothing unless notify.completed asks
        sent = the_messages(messages, ["recovered", "recovered"], run.info.run_id,
                            str(state.state_details.flow_run_id))
    assert all("relaunched" in message["reason"] for message in sent), sent

    assert run.info.status == "FINISHED"
    assert run.data.metrics["recoveries"] == 2
    assert run.data.metrics["lost_compute_seconds"] >= 0 and run.data.metrics["recovery_seconds"] > 0
    logged = epochs_logged(spec, run)
    # Each epoch exactly once: those the lost controller had not logged yet come from Ray Train's checkpoint record.
    assert logged == list(range(EPOCHS)), "each epoch logged exactly once"
    logs = flow_logs(state.state_details.flow_run_id)
    # (a lost attempt's error quotes the end of its log, resume line included: the epochs, not the lines, count)
    resumed = sorted({int(epoch) for epoch in re.findall(r"resuming at epoch (\d+)", logs)})
    # from a checkpoint each time, not from scratch, and the second from further on than the first
    assert len(resumed) == 2 and 1 <= resumed[0], logs[-3000:]
    print(f"\n[worker node, then whole cluster lost] recovery {run.data.metrics['recovery_seconds']:.1f}s (loss → "
          f"first resumed epoch), lost compute {run.data.metrics['lost_compute_seconds']:.1f}s")
    assert LocalBackend().status() == [] and processes_of(gpuflow_home) == []


def test_more_losses_than_allowed_fail_the_run_as_preempted(prefect_server, digits_spec, gpuflow_home):
    from gpuflow.flows.experiment import run_experiment

    spec = two_nodes(digits_spec, max_recoveries=0)  # the first loss is one too many: one launch, not two
    killer = NodeKiller(gpuflow_home, "worker node")
    killer.start()
    state = run_experiment(spec, return_state=True)
    assert state.is_failed() and "max_recoveries=0" in state.message, state.message

    _, run = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
    assert (run.info.status, run.data.tags["stopped_by"]) == ("FAILED", "preempted")
    assert run.data.metrics["recoveries"] == 1
    assert list(gpuflow_home.glob("checkpoints/*/checkpoint_*/checkpoint.pt")), "checkpoints kept"
    assert LocalBackend().status() == [] and processes_of(gpuflow_home) == []


LEAD_S = 30  # GCP's and Azure's notice; AWS gives two minutes
STEP_PACE_S = 2.0  # ~23 steps an epoch of digits on 2 workers: ~46 s, longer than the notice's lead
NOTICE_AT_STEP = 2


def test_a_spot_notice_checkpoints_and_starts_the_replacement_before_the_node_goes(prefect_server, digits_spec,
                                                                                    gpuflow_home, monkeypatch):
    """A notice 30 s before a worker node of a 2-node run is killed: the replacement cluster (-r1) is provisioned
    before the node goes, the run resumes on it mid-epoch from a checkpoint written after the notice, redoes at most
    the one step in flight (a checkpoint at every step while noticed), and logs each epoch once."""
    from gpuflow.cluster.protocol import PREEMPTION_NOTICE_TAG
    from gpuflow.flows.experiment import run_experiment
    from tests.support.interruption import Interruption
    from tests.support.metadata_double import metadata_double

    started = time.monotonic()
    step_log = gpuflow_home / "steps.log"
    spec = two_nodes(digits_spec)
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={
        "epochs": 1, "loop": STEPPED_LOOP,
        "params": {**spec.train.params, "step_pace_s": STEP_PACE_S, "step_log": str(step_log)}})})
    with metadata_double("aws") as double:
        monkeypatch.setenv("GPUFLOW_METADATA_URL", double.url)
        killer = Interruption(gpuflow_home, step_log, at_step=NOTICE_AT_STEP, double=double, lead_s=LEAD_S)
        killer.start()
        state = run_experiment(spec, return_state=True)
        killer.join(timeout=5)
    assert killer.killed_at, "the notice was given and the node killed"
    assert state.is_completed(), state.message
    _, run = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
    assert run.info.status == "FINISHED" and run.data.metrics["recoveries"] == 1
    assert "aws takes node" in run.data.tags[PREEMPTION_NOTICE_TAG]
    assert epochs_logged(spec, run) == [0], "each epoch logged exactly once"

    # the replacement was asked for on the notice, before the loss: the resume did not wait for a provision
    [(name, replacement)] = killer.others_at_kill.items()
    assert name.endswith("-r1") and replacement["launched_at"] < killer.killed_at, killer.others_at_kill
    logs = flow_logs(state.state_details.flow_run_id)
    assert "notice: replacement cluster provisioning" in logs, logs[-3000:]
    figures = killer.measured(logs, workers=2)
    assert figures["resumed_step"] is not None, logs[-3000:]
    assert killer.noticed_at < figures["checkpoint_written_at"], "resumed from a checkpoint written after the notice"
    assert figures["steps_redone"] <= 1, f"at most the step in flight is trained again (one step between checkpoints)"
    assert LocalBackend().status() == [] and processes_of(gpuflow_home) == []
    print(f"\n[spot notice] replacement {replacement['status']} at the loss (asked for "
          f"{killer.killed_at - replacement['launched_at']:.1f}s before); resumed at step {figures['resumed_step']}, "
          f"{figures['steps_redone']} step(s) redone, recovery {figures['recovery_s']:.1f}s (loss → first step); "
          f"test wall {time.monotonic() - started:.0f}s")
