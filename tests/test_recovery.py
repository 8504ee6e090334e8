"""A lost node mid-training (real local Ray cluster, its raylet SIGKILLed): the flow relaunches the cluster (as
<name>-r1), resumes from the last checkpoint, in the same MLflow run, and logs every epoch once. (A whole cluster lost,
head included, is the deadline run's spot preemption: tests/test_deadline_on_ray.py.) With a
spot notice first (a double of the cloud's metadata service), the loop checkpoints until the node goes and the
flow provisions the replacement cluster before the loss. An elastic run (num_workers: [min, max]) trains on without
the node instead."""

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
from gpuflow.cluster.util.ray_internals import SNAPSHOT_FILE
from tests.loops import STEPPED_LOOP
from tests.support.processes import processes_of
from tests.support.runs import flow_logs, mlflow_run_of

pytestmark = pytest.mark.full

EPOCHS = 6  # the loss comes after 3 checkpoints


def two_nodes(spec, **compute):
    return spec.model_copy(
        update={
            "train": spec.train.model_copy(update={"epochs": EPOCHS}),
            "compute": spec.compute.model_copy(
                update={"num_nodes": 2, "workers_per_node": 1, "num_workers": 2, **compute}
            ),
            "tracking": spec.tracking.model_copy(update={"register_model": False}),
        }
    )


class NodeKiller(threading.Thread):
    """Once `after` checkpoints are registered, SIGKILLs a part of the running local cluster: `what` (its worker
    node's raylet, or the whole cluster)."""

    def __init__(self, home: Path, what: str, after: int = 3):
        super().__init__(daemon=True)
        self.home, self.what, self.after = home, what, after
        self.killed: list[str] = []
        self.killed_at: list[float] = []

    def checkpoints(self) -> int:
        """Those Ray Train registered (its snapshot lists them), not the folders: a folder is there as soon as rank 0
        uploaded it, before every rank reported the epoch, and a loss then takes the whole epoch with it. A snapshot
        being rewritten counts as none yet: the next look reads it whole."""
        try:
            return sum(
                len(json.loads(snapshot.read_text())["checkpoint_results"])
                for snapshot in self.home.glob(f"checkpoints/*/{SNAPSHOT_FILE}")
            )
        except (OSError, ValueError, KeyError):
            return 0

    def run(self):
        deadline = time.monotonic() + 600
        while not self.killed and time.monotonic() < deadline:
            clusters = [s for s in LocalBackend().status() if s.status == "UP"]
            if self.checkpoints() >= self.after and clusters:
                record = LocalBackend().record(clusters[0].name)
                nodes = Path(record["temp_dir"]) / NODES_FILE
                if nodes.exists():
                    self.kill(self.what, record, json.loads(nodes.read_text()))
            time.sleep(0.2)

    def kill(self, what: str, record, nodes):
        if what == "worker node":
            [worker] = [node for node in nodes if not node["head"]]
            os.kill(worker["raylet"], signal.SIGKILL)
        else:  # the whole cluster, head included: every process of its session
            stop_sessions([record["session"]])
        self.killed.append(what)
        self.killed_at.append(time.time())


def epochs_logged(spec, run) -> list[int]:
    client = MlflowClient(tracking_uri=spec.tracking_uri)
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy"))


def test_a_lost_node_is_relaunched_and_training_resumes_in_the_same_run(prefect_server, digits_spec, gpuflow_home):
    """A run loses a worker node: the cluster is relaunched, the run resumed, and its webhook told."""
    from gpuflow.cluster.spec.notifying import NotifySpec
    from gpuflow.flows.experiment import run_experiment
    from gpuflow.flows.run_messages import add_webhook
    from tests.support.servers import the_messages, webhook_receiver

    spec = two_nodes(digits_spec)
    killer = NodeKiller(gpuflow_home, "worker node")
    with webhook_receiver() as (url, messages):
        add_webhook("recoveries", url)
        killer.start()
        state = run_experiment(spec.model_copy(update={"notify": NotifySpec(block="recoveries")}), return_state=True)
        assert killer.killed == ["worker node"]
        assert state.is_completed(), state.message
        _, run = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
        # a message per recovery: a completed run says nothing unless notify.completed asks
        sent = the_messages(messages, ["recovered"], run.info.run_id, str(state.state_details.flow_run_id))
    assert all("relaunched" in message["reason"] for message in sent), sent

    assert run.info.status == "FINISHED"
    assert run.data.metrics["recoveries"] == 1
    assert run.data.metrics["lost_compute_seconds"] >= 0 and run.data.metrics["recovery_seconds"] > 0
    logged = epochs_logged(spec, run)
    # Each epoch exactly once: those the lost controller had not logged yet come from Ray Train's checkpoint record.
    assert logged == list(range(EPOCHS)), "each epoch logged exactly once"
    logs = flow_logs(state.state_details.flow_run_id)
    # (a lost attempt's error quotes the end of its log, resume line included: the epochs, not the lines, count)
    resumed = sorted({int(epoch) for epoch in re.findall(r"resuming at epoch (\d+)", logs)})
    assert len(resumed) == 1 and 1 <= resumed[0], logs[-3000:]  # from a checkpoint, not from scratch
    print(
        f"\n[worker node lost] recovery {run.data.metrics['recovery_seconds']:.1f}s (loss → "
        f"first resumed epoch), lost compute {run.data.metrics['lost_compute_seconds']:.1f}s"
    )
    assert LocalBackend().status() == [] and processes_of(gpuflow_home) == []


ELASTIC_EPOCHS = 4
RATE = 3.6  # limits.hourly_rate_usd of the 2-node cluster: $0.0005 a node-second


def test_an_elastic_run_trains_on_without_a_lost_node(prefect_server, digits_spec, gpuflow_home):
    """num_workers [1, 2] on 2 nodes, a worker node's raylet killed after the first checkpoint: training goes on with
    1 worker within two minutes (about 15 s on a quiet machine), no relaunch, and finishes; MLflow has `workers` 2
    then 1, the bill follows the nodes."""
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.flows.experiment import run_experiment
    from tests.loops import PACED_LOOP

    raw = digits_spec.model_dump(mode="json")
    raw["compute"].update(num_nodes=2, workers_per_node=1, num_workers=[1, 2])
    raw["train"].update(epochs=ELASTIC_EPOCHS, loop=PACED_LOOP, params={**raw["train"]["params"], "pace_s": 3})
    raw["tracking"]["register_model"] = False
    raw["limits"]["hourly_rate_usd"] = RATE
    spec = parse_spec(raw)
    killer = NodeKiller(gpuflow_home, "worker node", after=1)
    killer.start()
    state = run_experiment(spec, return_state=True)
    assert killer.killed == ["worker node"]
    assert state.is_completed(), state.message
    client, run = mlflow_run_of(spec.tracking_uri, state.state_details.flow_run_id, spec.experiment_name)
    logs = flow_logs(state.state_details.flow_run_id)
    assert "recoveries" not in run.data.metrics and "-r1" not in logs, "trained on, not relaunched"
    assert "nodes alive: 1 of 2" in logs, logs[-3000:]
    assert epochs_logged(spec, run) == list(range(ELASTIC_EPOCHS)), "each epoch logged exactly once"

    workers = sorted(client.get_metric_history(run.info.run_id, "workers"), key=lambda m: m.step)
    sizes = [int(m.value) for m in workers]
    assert sizes[0] == 2 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True), sizes
    first_small = min(m.timestamp for m in workers if m.value == 1) / 1000
    trained_on_after = first_small - killer.killed_at[0]
    assert trained_on_after < 120, "an epoch on 1 worker reported within two minutes"

    cost, hours = run.data.metrics["cost_usd"], run.data.metrics["cluster_hours"]
    assert RATE / 2 * hours < cost < RATE * hours, "billed for 2 nodes, then for 1"
    print(
        f"\n[elastic, a worker node lost] an epoch on 1 worker {trained_on_after:.1f}s after the loss; "
        f"${cost:.5f} for {hours * 3600:.0f}s (whole: ${RATE * hours:.5f})"
    )
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


def test_a_spot_notice_checkpoints_and_starts_the_replacement_before_the_node_goes(
    prefect_server, digits_spec, gpuflow_home, monkeypatch
):
    """A notice 30 s before a worker node of a 2-node run is killed: the replacement cluster (-r1) is provisioned
    before the node goes, the run resumes on it mid-epoch from a checkpoint written after the notice, redoes a step or
    two (a checkpoint at every step while noticed), not the notice's lead, and logs each epoch once."""
    from gpuflow.cluster.protocol import PREEMPTION_NOTICE_TAG
    from gpuflow.flows.experiment import run_experiment
    from tests.support.interruption import Interruption
    from tests.support.metadata_double import metadata_double

    started = time.monotonic()
    step_log = gpuflow_home / "steps.log"
    spec = two_nodes(digits_spec)
    spec = spec.model_copy(
        update={
            "train": spec.train.model_copy(
                update={
                    "epochs": 1,
                    "loop": STEPPED_LOOP,
                    "params": {**spec.train.params, "step_pace_s": STEP_PACE_S, "step_log": str(step_log)},
                }
            )
        }
    )
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
    figures = killer.measured(logs)
    assert figures["resumed_step"] is not None, logs[-3000:]
    assert killer.noticed_at < figures["checkpoint_written_at"], "resumed from a checkpoint written after the notice"
    # Redone: the step in flight, and any whose checkpoint Ray Train's controller had not registered when the node
    # went (a loaded machine delays that by a step or two). Without the notice's checkpoints: the notice's lead,
    # LEAD_S / STEP_PACE_S = 15 steps.
    assert figures["steps_redone"] <= 3, f"seconds redone, not the notice's lead: {figures['steps_redone']} steps"
    # the run's own figure counts from the notice's checkpoint too, not from the epoch's start (over 30 s)
    assert run.data.metrics["redone_seconds"] <= 5 * STEP_PACE_S, run.data.metrics
    assert LocalBackend().status() == [] and processes_of(gpuflow_home) == []
    print(
        f"\n[spot notice] replacement {replacement['status']} at the loss (asked for "
        f"{killer.killed_at - replacement['launched_at']:.1f}s before); resumed at step {figures['resumed_step']}, "
        f"{figures['steps_redone']} step(s) redone, recovery {figures['recovery_s']:.1f}s (loss → first step); "
        f"the run's redone_seconds {run.data.metrics['redone_seconds']:.1f} (measured {figures['redone_s']:.1f}), "
        f"lost_compute_seconds {run.data.metrics['lost_compute_seconds']:.1f}; "
        f"test wall {time.monotonic() - started:.0f}s"
    )
