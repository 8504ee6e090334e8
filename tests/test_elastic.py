"""Elastic workers (compute.num_workers: [min, max]) without a cluster: the range's checks, Ray Train's budget, the
bill at a changing size, the job's line about the nodes left and the flow's check of them. The run itself (a node
killed, training on without it) is tests/test_recovery.py::test_an_elastic_run_trains_on_without_a_lost_node."""

import pytest

from gpuflow.cluster.cost.pricing import Estimate
from gpuflow.cluster.job.elastic import elastic_workers, failure_budget, worker_slot
from gpuflow.cluster.protocol import nodes_line, parse_line
from gpuflow.cluster.run.lifecycle import Lifecycle
from gpuflow.cluster.run.meter import Meter, seconds_at_sizes
from gpuflow.cluster.run.monitor import elastic_loss_check
from gpuflow.cluster.spec import SpecError, parse_spec
from gpuflow.cluster.spec.elastic import WORKER_SLOT_RESOURCE, node_losses_tolerated
from tests.support.repo import A_LOOP


def compute(**fields):
    return parse_spec({**A_LOOP, "compute": fields}).compute


def test_a_range_splits_into_the_cluster_size_and_a_minimum():
    elastic = compute(num_nodes=2, workers_per_node=1, num_workers=[1, 2])
    assert (elastic.num_workers, elastic.min_workers, elastic.workers_per_node) == (2, 1, 1)
    spread = compute(num_nodes=2, num_workers=[2, 4])  # the maximum sets workers_per_node, as a fixed count does
    assert (spread.num_workers, spread.min_workers, spread.workers_per_node) == (4, 2, 2)
    assert compute(num_nodes=2, workers_per_node=1, num_workers=[2, 2]).min_workers is None, "[n, n] is fixed"
    # what the job gets (the spec as JSON) is still elastic
    again = parse_spec(
        parse_spec({**A_LOOP, "compute": {"num_nodes": 2, "num_workers": [1, 2]}}).model_dump(mode="json")
    )
    assert (again.compute.num_workers, again.compute.min_workers) == (2, 1)


BAD_RANGES = [
    # (compute, a word of the value, a word of the fix)
    ({"num_nodes": 2, "num_workers": [3, 1]}, "[3, 1]", "[min, max]"),
    ({"num_nodes": 2, "num_workers": [0, 2]}, "[0, 2]", "at least 1"),
    ({"num_nodes": 2, "num_workers": [3, 4]}, "[3, 4]", "at most 2"),
    ({"num_workers": [1, 2]}, "one node", "num_nodes ≥ 2"),
    ({"num_nodes": 2, "num_workers": [2, 3]}, "num_workers=3", "multiple of num_nodes"),
    ({"num_nodes": 2, "num_workers": [1, 2, 3]}, "[1, 2, 3]", "at most 2 items"),
    ({"num_nodes": 2, "workers_per_node": 1, "min_workers": 3}, "min_workers=3", "[min, max]"),
]


@pytest.mark.parametrize("fields, value, fix", BAD_RANGES, ids=[str(b[0]) for b in BAD_RANGES])
def test_a_bad_range_names_the_field_the_value_and_the_fix(fields, value, fix):
    with pytest.raises(SpecError) as error:
        compute(**fields)
    message = str(error.value)
    assert "compute" in message and value in message and fix in message, message


def test_a_sweep_takes_no_range():
    with pytest.raises(SpecError, match="compute.num_workers.*fixed num_workers: 2"):
        parse_spec(
            {
                **A_LOOP,
                "compute": {"num_nodes": 2, "num_workers": [1, 2]},
                "sweep": {"parameters": {"train.lr": {"grid": [0.1, 0.2]}}, "metric": "val_accuracy"},
            }
        )


def test_ray_train_gets_the_range_a_slot_per_worker_and_a_restart_per_node_it_may_lose():
    fixed = compute(num_nodes=2, workers_per_node=1, worker_restarts=1)
    assert (elastic_workers(fixed), worker_slot(fixed)) == (2, {})
    assert failure_budget(fixed) == {"max_failures": 1, "max_preemption_failures": 0, "controller_failure_limit": 0}
    elastic = compute(num_nodes=4, workers_per_node=2, num_workers=[3, 8])
    assert node_losses_tolerated(elastic) == 2  # 3 workers need 2 of the 4 nodes
    assert (elastic_workers(elastic), worker_slot(elastic)) == ((3, 8), {WORKER_SLOT_RESOURCE: 1})
    assert failure_budget(elastic) == {"max_failures": 2, "max_preemption_failures": 2, "controller_failure_limit": 2}


def test_the_stretches_of_a_clusters_life_at_each_size():
    assert seconds_at_sizes(100, 160, 2, []) == [(60, 2)]
    assert seconds_at_sizes(100, 160, 2, [(130, 1)]) == [(30, 2), (30, 1)]
    assert seconds_at_sizes(100, 160, 4, [(150, 2), (110, 3)]) == [(10, 4), (40, 3), (10, 2)]
    assert seconds_at_sizes(100, 160, 2, [(90, 1)]) == [(60, 1)], "a resize before the cluster counts from its start"


def test_the_bill_follows_the_live_size_and_a_relaunch_is_whole_again():
    price = Estimate(
        hourly_usd=7.2, per_node_hourly_usd=3.6, num_nodes=2, use_spot=True, source="catalog", gpus_per_node=1
    )
    meter = Meter(price, requested_at=1000.0)
    assert meter.cost(ended=1000.0 + 3600)["cost_usd"] == pytest.approx(7.2), "unchanged without a resize"
    meter.resized(1, when=1000.0 + 1800)
    bill = meter.cost(ended=1000.0 + 3600)
    assert bill["cost_usd"] == pytest.approx(3.6 + 1.8) and bill["gpu_hours"] == pytest.approx(1.0 + 0.5)
    assert bill["cluster_hours"] == pytest.approx(1.0) and bill["hourly_cost_usd"] == pytest.approx(3.6)
    ended = meter.relaunched()
    assert ended["cost_usd"] > 0 and meter.live_hourly_usd() == 7.2, "the relaunched cluster is billed whole"


def test_the_jobs_line_about_the_nodes_left_moves_the_flows_bill_and_its_loss_check():
    event = parse_line("(pid=12) " + nodes_line(1, 2))
    assert (event.kind, event.value) == ("nodes", (1, 2))

    spec = parse_spec({**A_LOOP, "compute": {"num_nodes": 3, "workers_per_node": 1, "num_workers": [2, 3]}})
    life = Lifecycle("gpuflow-x", down=lambda name: None, meter=Meter(Estimate(3.0, 1.0, 3, False, "catalog")))
    check = elastic_loss_check(spec, life)
    assert check() is None
    life.nodes_alive(2, 3)
    assert check() is None and life.meter.live_hourly_usd() == pytest.approx(2.0), "2 of 3 nodes: trains on"
    life.nodes_alive(1, 3)
    reason, why = check()
    assert reason == "lost" and "1 of 3 nodes left" in why and "minimum of 2" in why
