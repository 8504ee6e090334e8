"""A run with a deadline on real Ray: real clusters, a real job, its checkpoints and resumes, the flow deciding each
launch. Only the cloud's spot market is a double (tests/support/spot_market.py): spot at first, taken away with a
preemption that kills the spot cluster, back once the run is on on-demand. The decisions on a scripted job's log are
tests/test_deadline_run.py's; the policy's own cases tests/test_deadline.py's."""

from __future__ import annotations

import re

import pytest

from gpuflow.cluster.backends.local import LocalBackend
from gpuflow.cluster.spec import parse_spec
from gpuflow.flows.experiment import run_experiment
from tests.loops import PACED_LOOP_IN_MEMORY, WAITING_RUN_ENVS
from tests.support.processes import processes_of
from tests.support.repo import REPO
from tests.support.runs import flow_logs, mlflow_run_of
from tests.support.spot_market import SpotMarket
from tests.test_capacity import sky_prices  # noqa: F401  (a fixture)
from tests.test_deadline_run import ON_DEMAND_USD, SPOT, SPOT_USD, attempt_prices
from tests.test_recovery import NodeKiller

pytestmark = pytest.mark.full

# Chosen by running the policy's own functions over provisions of 5-20 s, job starts of 15-60 s (a job's start counts
# as training done, so a slow one makes the run look long), epochs up to 60 % slow and the loss seen after 3 or 4
# checkpoints: the loss leaves the run ahead, waiting for spot, until it is behind its pace, well before the safety net;
# on on-demand it is ahead by two changeovers a few epochs later, with epochs left to move to spot. 24 epochs, not
# 16: on a loaded machine the spot cluster beside on-demand took 25-40 s to be up, and 16 left it 30 s of training
# (the run once ended on on-demand, once moved just after its last checkpoint); 24 leave it about 50.
EPOCHS, LOST_AFTER, EPOCH_S, DEADLINE_S = 24, 4, 3.0, 600


class Preemption(NodeKiller):
    """Once LOST_AFTER checkpoints are registered, the market takes its spot back, and the whole spot cluster with it
    (every process of its session, as NodeKiller kills a cluster)."""

    def __init__(self, home, market: SpotMarket):
        super().__init__(home, "spot cluster", after=LOST_AFTER)
        self.market = market

    def kill(self, what, record, nodes):
        self.market.spot = False
        super().kill(what, record, nodes)


def test_a_deadline_run_on_ray_goes_on_demand_when_behind_and_back_to_spot_when_ahead(
    monkeypatch,
    gpuflow_home,
    prefect_server,
    sky_prices,  # noqa: F811
):
    market = SpotMarket()
    monkeypatch.setattr("gpuflow.cluster.backends.skypilot.SkyPilotBackend", market.backend)
    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))  # the stores on this machine count as shared
    monkeypatch.setattr("gpuflow.flows.capacity.waiting.RETRY_S", 2.0)  # a wait for spot tries again this often
    spec = parse_spec(
        {
            "name": "digits-deadline",
            "workdir": str(REPO),
            "train": {"loop": PACED_LOOP_IN_MEMORY, "epochs": EPOCHS, "params": {"hidden": 32, "pace_s": EPOCH_S}},
            # the market's clusters train on this machine's CPU
            "compute": {**SPOT, "backend": "skypilot", "use_gpu": False, "num_workers": 1, "max_recoveries": 2},
            "limits": {
                "finish_within_hours": DEADLINE_S / 3600,
                "changeover_minutes": 0.05,
                "max_runtime_minutes": 7,  # C(0) before the first checkpoint measures it
            },
            "tracking": {"uri": f"sqlite:///{gpuflow_home}/mlflow.db", "register_model": False},
            "storage": {"checkpoints": str(gpuflow_home / "checkpoints")},
            "envs": WAITING_RUN_ENVS,
        }
    )
    preemption = Preemption(gpuflow_home, market)
    preemption.start()
    state = run_experiment(spec, return_state=True)
    assert state.is_completed(), state.message
    assert preemption.killed == ["spot cluster"]
    flow_run_id = state.state_details.flow_run_id
    client, run = mlflow_run_of(spec.tracking_uri, flow_run_id, spec.experiment_name)
    logs = flow_logs(flow_run_id)

    assert market.launched == ["spot", "on-demand", "spot"], logs[-3000:]
    assert "deadline: behind uniform progress, no spot: on-demand: launching on-demand" in logs
    assert "launching spot beside on-demand" in logs and "leaving on-demand cluster" in logs
    assert attempt_prices(client, run) == [SPOT_USD, ON_DEMAND_USD, SPOT_USD]  # each attempt at its own price
    metrics = run.data.metrics
    assert metrics["deadline_switches"] == 2 and metrics["recoveries"] == 1  # the move back to spot is no loss
    assert metrics["spot_seconds"] > 0 and metrics["on_demand_seconds"] > 0
    assert 0 < metrics["deadline_slack_seconds"] < DEADLINE_S
    # each epoch once, resumed from a checkpoint twice (after the loss, after the move), the second further on
    epochs = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in epochs) == list(range(EPOCHS))
    resumed = sorted({int(epoch) for epoch in re.findall(r"resuming at epoch (\d+)", logs)})
    assert len(resumed) == 2 and LOST_AFTER - 1 <= resumed[0] < resumed[1], logs[-3000:]
    print(
        f"\n[deadline on Ray] spot {metrics['spot_seconds']:.0f} s, on-demand {metrics['on_demand_seconds']:.0f} s, "
        f"slack {metrics['deadline_slack_seconds']:.0f} s, resumed at epochs {resumed}"
    )
    assert run.info.status == "FINISHED"
    assert LocalBackend().status() == [] and processes_of(gpuflow_home) == []
