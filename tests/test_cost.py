"""Prices from SkyPilot's own catalog code (a few real catalog rows), budget refusals, the MLflow ledger, idle GPUs."""

import shutil
import sys
import threading
import time

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from gpuflow.cluster.cost.budget import BudgetExceeded, check_budget, check_run_budget
from gpuflow.cluster.cost.idle_gpu import idle_gpu_check, idle_verdict
from gpuflow.cluster.cost.pricing import CatalogMissing, Estimate, PriceUnknown, hourly_cost
from gpuflow.cluster.cost.spend import parse_since, run_costs, start_of_today_utc
from gpuflow.cluster.run.lifecycle import Lifecycle
from gpuflow.cluster.run.limits import Watchdog, cost_check
from gpuflow.cluster.run.meter import Meter
from gpuflow.cluster.spec import parse_spec
from tests.support.repo import A_LOOP, DIGITS_DATA, REPO

CATALOG = REPO / "tests" / "data" / "skypilot-catalog"
CATALOG_MODULES = ("sky.catalog.aws_catalog", "sky.catalog.lambda_catalog")


def point_skypilot_at(folder, monkeypatch):
    """SkyPilot reads <SKY_RUNTIME_DIR>/.sky/catalogs/v8/; its catalog modules bind their files at import."""
    from sky.catalog import common

    monkeypatch.setenv("SKY_RUNTIME_DIR", str(folder))
    monkeypatch.setattr(common, "_ABSOLUTE_VERSIONED_CATALOG_DIR", str(folder / ".sky" / "catalogs" / "v8"))
    for module in CATALOG_MODULES:
        monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.fixture
def sky_catalog(tmp_path, monkeypatch):
    root = tmp_path / "sky-runtime"
    shutil.copytree(CATALOG / "v8", root / ".sky" / "catalogs" / "v8")
    point_skypilot_at(root, monkeypatch)
    return root


def sky_spec(**compute):
    return parse_spec(
        {
            **A_LOOP,
            "workdir": str(REPO),
            "compute": {"backend": "skypilot", **compute},
            "tracking": {"uri": "http://127.0.0.1:1"},  # never contacted: no daily budget in these tests
            "storage": {"checkpoints": "s3://bucket/ckpt"},
            "data": DIGITS_DATA,
        }
    )


# -- prices from the catalog ------------------------------------------------------------------------


def test_on_demand_price_is_the_cheapest_instance_times_nodes(sky_catalog):
    estimate = hourly_cost(sky_spec(accelerators="L4:1", cloud="aws", num_nodes=2))
    assert (estimate.cloud, estimate.instance_type, estimate.source) == ("aws", "g6.xlarge", "catalog")
    assert estimate.per_node_hourly_usd == pytest.approx(0.8048)
    assert estimate.hourly_usd == pytest.approx(2 * 0.8048)
    assert estimate.gpus_per_node == 1


def test_spot_price_and_region(sky_catalog):
    anywhere = hourly_cost(sky_spec(accelerators="L4:1", cloud="aws", use_spot=True))
    assert anywhere.use_spot and anywhere.hourly_usd == pytest.approx(0.2628)  # us-east-2, the cheapest zone
    in_region = hourly_cost(sky_spec(accelerators="L4:1", infra="aws/us-east-1", use_spot=True))
    assert (in_region.region, in_region.hourly_usd) == ("us-east-1", pytest.approx(0.4102))


def test_a_list_of_accelerators_is_budgeted_at_its_dearest_option_each_at_its_cheapest_cloud(sky_catalog):
    h100 = hourly_cost(sky_spec(accelerators="H100:8", cloud="lambda"))
    assert (h100.instance_type, h100.hourly_usd) == ("gpu_8x_h100_sxm5", pytest.approx(23.92))
    l4 = hourly_cost(sky_spec(accelerators="L4:1"))
    assert l4.cloud == "aws" and l4.hourly_usd < h100.hourly_usd
    # SkyPilot tries the list in order: the H100s may well be what launches, so they set the budget's price
    either = hourly_cost(sky_spec(accelerators=["L4:1", "H100:8"]))
    assert (either.accelerators, either.hourly_usd) == ("H100:8", pytest.approx(23.92))


def test_unknown_compute_and_missing_catalog_are_clear_errors(sky_catalog, tmp_path, monkeypatch):
    with pytest.raises(PriceUnknown, match="H100:8"):
        hourly_cost(sky_spec(accelerators="H100:8", cloud="aws"))
    empty = tmp_path / "no-catalog"
    empty.mkdir()
    point_skypilot_at(empty, monkeypatch)
    with pytest.raises(CatalogMissing, match="hourly_rate_usd") as error:
        hourly_cost(sky_spec(accelerators="H100:8", cloud="lambda"))
    assert str(empty) in str(error.value)
    # a rate of the user's own needs no catalog
    assert (
        hourly_cost(
            sky_spec(accelerators="H100:8", num_nodes=2).model_copy(
                update={"limits": parse_spec({**A_LOOP, "limits": {"hourly_rate_usd": 10}}).limits}
            )
        ).per_node_hourly_usd
        == 5
    )


def test_local_backend_is_free_unless_priced():
    assert hourly_cost(parse_spec(A_LOOP)).hourly_usd == 0
    priced = hourly_cost(parse_spec({**A_LOOP, "limits": {"hourly_rate_usd": 2.5}}))
    assert (priced.hourly_usd, priced.source) == (2.5, "limits.hourly_rate_usd")


# -- refusing before launch -------------------------------------------------------------------------


def test_run_over_max_cost_is_refused_with_both_figures_and_the_fix(sky_catalog):
    spec = sky_spec(accelerators="H100:8", cloud="lambda").model_copy(
        update={"limits": parse_spec({**A_LOOP, "limits": {"max_runtime_minutes": 60, "max_cost_usd": 10}}).limits}
    )
    with pytest.raises(BudgetExceeded) as error:
        check_budget(spec)
    message = str(error.value)
    assert "$23.92" in message and "max_cost_usd=$10.00" in message
    assert "max_runtime_minutes to 25" in message  # 10 / 23.92 × 60 = 25.08
    within = spec.model_copy(update={"limits": spec.limits.model_copy(update={"max_runtime_minutes": 25})})
    assert check_budget(within).instance_type == "gpu_8x_h100_sxm5"


def test_flow_refuses_in_validate_before_any_cluster_exists(prefect_server, digits_spec, gpuflow_home):
    from gpuflow.flows.experiment import run_experiment

    spec = digits_spec.model_copy(
        update={
            "limits": digits_spec.limits.model_copy(
                update={"hourly_rate_usd": 6.0, "max_runtime_minutes": 30, "max_cost_usd": 1.0}
            )
        }
    )
    state = run_experiment(spec, return_state=True)
    assert state.is_failed()
    assert "$3.00" in state.message and "max_cost_usd=$1.00" in state.message, state.message
    assert not (gpuflow_home / "clusters").exists() or not any((gpuflow_home / "clusters").iterdir())
    store = MlflowClient(tracking_uri=spec.tracking_uri)
    assert store.search_runs([e.experiment_id for e in store.search_experiments()]) == []  # nor any MLflow run


def log_past_run(client, experiment_id, cost_usd, started_at, gpuflow=True):
    run = client.create_run(
        experiment_id, start_time=int(started_at * 1000), tags={"gpuflow.backend": "local"} if gpuflow else {}
    )
    client.log_batch(run.info.run_id, metrics=[Metric("cost_usd", cost_usd, int(started_at * 1000), 0)])
    client.set_terminated(run.info.run_id, "FINISHED", end_time=int(started_at * 1000) + 1000)
    return run.info.run_id


@pytest.fixture
def ledger(digits_spec, gpuflow_home):
    """Runs of today in two experiments, one of yesterday, one not gpuflow's: $7.50 of gpuflow runs today."""
    client = MlflowClient(tracking_uri=digits_spec.tracking_uri)
    artifacts = (gpuflow_home / "artifacts").as_uri()
    first, second = (client.create_experiment(name, artifact_location=artifacts) for name in ("exp-a", "exp-b"))
    today = start_of_today_utc()
    log_past_run(client, first, 3.0, today + 1)
    log_past_run(client, second, 4.5, today + 2)
    log_past_run(client, first, 100.0, today - 3600)  # yesterday
    log_past_run(client, second, 50.0, today + 3, gpuflow=False)  # someone else's run
    return digits_spec.tracking_uri


def test_daily_budget_counts_todays_runs_across_experiments(ledger, digits_spec, monkeypatch):
    spec = digits_spec.model_copy(
        update={"limits": digits_spec.limits.model_copy(update={"hourly_rate_usd": 6.0, "max_runtime_minutes": 30})}
    )
    monkeypatch.setenv("GPUFLOW_DAILY_BUDGET_USD", "10")
    with pytest.raises(BudgetExceeded) as error:
        check_budget(spec)
    assert "$7.50" in str(error.value) and "$3.00" in str(error.value) and "$10.50" in str(error.value)
    monkeypatch.setenv("GPUFLOW_DAILY_BUDGET_USD", "10.5")
    assert check_budget(spec).hourly_usd == 6.0


def test_gpuflow_cost_lists_runs_and_totals(ledger, capsys):
    from gpuflow.flows.cli import main

    assert sorted(row.cost_usd for row in run_costs(ledger, start_of_today_utc())) == [3.0, 4.5]
    assert main(["cost", "--since", "2d", "--tracking-uri", ledger]) == 0
    out = capsys.readouterr().out
    assert "3 run(s): $107.50" in out and "exp-b" in out
    assert main(["cost", "--since", "soon"]) == 2
    assert parse_since("12h") == 43200 and parse_since("2w") == 1209600


# -- while it runs, and after -----------------------------------------------------------------------


def test_cost_check_fires_at_max_cost():
    rate = lambda: 3.6  # noqa: E731
    assert cost_check(0.5, rate, time.time() - 400)() is None  # $0.40
    reason, detail = cost_check(0.5, rate, time.time() - 520)()  # $0.52
    assert reason == "budget" and "$0.52 spent of max_cost_usd=0.50" in detail
    assert cost_check(None, rate, time.time() - 10**6)() is None  # no cap, no stop


def test_the_bill_of_a_run_counts_from_the_provision_request_at_the_launched_price():
    estimate = Estimate(
        hourly_usd=7.2, per_node_hourly_usd=3.6, num_nodes=2, use_spot=True, source="catalog", gpus_per_node=8
    )
    life = Lifecycle("gpuflow-x", down=lambda name: True, meter=Meter(estimate, requested_at=1000.0))
    life.launched_at = 1060.0
    life.last_output_at, life.teardown_requested_at = 1900.0, 1902.5
    metrics = life.bill(ended=2000.0)
    assert metrics["cost_usd"] == pytest.approx(2.0)
    assert metrics["cluster_hours"] == pytest.approx(1000 / 3600)
    assert metrics["gpu_hours"] == pytest.approx(16 * 1000 / 3600)
    assert metrics["idle_seconds_before_teardown"] == pytest.approx(2.5)
    assert metrics["provision_seconds"] == 60.0
    life.launched(hourly_usd=14.4)  # e.g. the dearer of two accelerator options launched
    assert life.bill(ended=life.requested_at + 3600)["cost_usd"] == pytest.approx(14.4)
    priced_by_user = Lifecycle(
        "gpuflow-y",
        down=lambda name: True,
        meter=Meter(hourly_cost(parse_spec({**A_LOOP, "limits": {"hourly_rate_usd": 2.0}}))),
    )
    priced_by_user.launched(hourly_usd=0.0)  # Slurm prices at 0: the user's own rate stands
    assert priced_by_user.meter.hourly_usd() == 2.0


def test_a_replacement_asked_for_on_a_notice_is_billed_from_its_request_and_downed_if_unused():
    """Both clusters bill from the notice to the loss; a replacement no loss came for is downed with the run."""

    class Launch:
        def wait(self):
            pass

    estimate = Estimate(hourly_usd=3.6, per_node_hourly_usd=1.8, num_nodes=2, use_spot=True, source="catalog")
    downed: list[str] = []
    life = Lifecycle("gpuflow-x", down=downed.append, meter=Meter(estimate, requested_at=time.time() - 100))
    life.launching(Launch(), "gpuflow-x-r1")  # on the notice
    life.replacements["gpuflow-x-r1"] -= 30  # asked for 30 s ago
    life.relaunching("gpuflow-x-r1")  # the loss: the run goes on on the replacement
    [lost] = life.meter.attempts
    assert lost["seconds"] == pytest.approx(100, abs=1) and life.bill()["cluster_hours"] * 3600 == pytest.approx(
        130, abs=1
    )
    life.launching(Launch(), "gpuflow-x-r2")  # a second notice, and the run ends before its loss
    life.replacements["gpuflow-x-r2"] -= 20
    life.teardown()
    assert {"gpuflow-x-r1", "gpuflow-x-r2"} <= set(downed) and "gpuflow-x" in downed
    unused = life.meter.attempts[-1]
    assert unused["option"] == "replacement, unused" and unused["seconds"] == pytest.approx(20, abs=1)
    assert life.replacements == {}


def log_utilization(client, run_id, start, step_s, values_per_gpu):
    """A GPU-utilisation series in the keys MLflow's own GPU monitor writes."""
    metrics = [
        Metric(f"system/gpu_{gpu}_utilization_percentage", value, int((start + i * step_s) * 1000), i)
        for i, values in enumerate(values_per_gpu)
        for gpu, value in enumerate(values)
    ]
    client.log_batch(run_id, metrics=metrics, synchronous=True)


@pytest.fixture
def gpu_run(digits_spec, gpuflow_home):
    client = MlflowClient(tracking_uri=digits_spec.tracking_uri)
    run = client.create_run(client.create_experiment("gpu", artifact_location=(gpuflow_home / "artifacts").as_uri()))
    return client, run.info.run_id


def idle_spec(digits_spec, minimum=20.0, minutes=10.0):
    return digits_spec.model_copy(
        update={
            "limits": digits_spec.limits.model_copy(
                update={"min_gpu_utilization": minimum, "idle_gpu_minutes": minutes}
            )
        }
    )


def test_idle_gpu_stops_after_a_whole_idle_window(gpu_run, digits_spec):
    client, run_id = gpu_run
    now = time.time()
    log_utilization(client, run_id, now - 12 * 60, 60, [[3.0, 7.0]] * 12)  # 12 min at ~5%
    reason, detail = idle_gpu_check(idle_spec(digits_spec), run_id, poll_interval_s=0)()
    assert reason == "idle_gpu" and "under 20%" in detail
    assert idle_gpu_check(digits_spec, run_id, poll_interval_s=0)() is None  # the policy is off by default


def test_busy_or_briefly_idle_gpus_are_left_alone(gpu_run, digits_spec):
    client, run_id = gpu_run
    now = time.time()
    busy = [[3.0, 5.0]] * 12
    busy[8] = [90.0, 80.0]  # one busy sample 4 minutes ago
    log_utilization(client, run_id, now - 12 * 60, 60, busy)
    assert idle_gpu_check(idle_spec(digits_spec), run_id, poll_interval_s=0)() is None
    # idle for 5 minutes only: not a whole window yet
    assert idle_verdict([(now - 300 + 60 * i, 2.0) for i in range(5)], 20.0, 600, now) is None
    assert idle_verdict([], 20.0, 600, now) is None


def test_watchdog_stops_on_idle_gpu(gpu_run, digits_spec):
    client, run_id = gpu_run
    log_utilization(client, run_id, time.time() - 11 * 60, 60, [[1.0]] * 11)
    stopped = threading.Event()
    reasons = []
    watchdog = Watchdog(
        [idle_gpu_check(idle_spec(digits_spec), run_id, poll_interval_s=0)],
        lambda reason, detail: (reasons.append(reason), stopped.set()),
        interval_s=0.05,
    )
    watchdog.start()
    assert stopped.wait(60)
    watchdog.finish()
    watchdog.join(10)
    assert reasons == ["idle_gpu"]


def test_spec_budget_check_allows_exactly_the_cap():
    spec = parse_spec({**A_LOOP, "limits": {"hourly_rate_usd": 6.0, "max_runtime_minutes": 10, "max_cost_usd": 1.0}})
    check_run_budget(spec, hourly_cost(spec))  # $1.00 of $1.00


def test_runs_without_cost_are_priced_from_their_hourly_rate(digits_spec, gpuflow_home):
    client = MlflowClient(tracking_uri=digits_spec.tracking_uri)
    experiment = client.create_experiment("unfinished", artifact_location=(gpuflow_home / "artifacts").as_uri())
    tags = {"gpuflow.backend": "local"}
    started_ms = int((time.time() - 100) * 1000)
    running = client.create_run(experiment, start_time=started_ms, tags=tags).info.run_id
    client.log_metric(running, "hourly_cost_usd", 36.0)  # $1 per 100 s
    killed = client.create_run(experiment, start_time=started_ms, tags=tags).info.run_id
    client.log_metric(killed, "hourly_cost_usd", 36.0)
    client.set_terminated(killed, "KILLED", end_time=started_ms + 50_000)  # its flow died after 50 s

    rows = {row.run_id: row for row in run_costs(digits_spec.tracking_uri, time.time() - 3600)}
    assert rows[running].estimated and rows[running].cost_usd >= 1.0
    assert rows[killed].estimated and rows[killed].cost_usd == pytest.approx(0.5)


def test_clusters_without_a_catalog_cost_nothing_unless_priced():
    """Slurm, Kubernetes and SSH pools are machines the user has: no catalog, no download, price 0."""
    from gpuflow.cluster.cost.pricing import hourly_cost
    from gpuflow.cluster.spec import parse_spec

    spec = {
        **A_LOOP,
        "compute": {"backend": "skypilot", "infra": "slurm/skyci"},
        "tracking": {"uri": "http://127.0.0.1:5000"},
        "storage": {"checkpoints": "s3://b/c"},
        "data": {"train": "s3://b/t.parquet", "validation": None},
    }
    assert hourly_cost(parse_spec(spec)).hourly_usd == 0
    assert hourly_cost(parse_spec({**A_LOOP, **spec, "limits": {"hourly_rate_usd": 3.0}})).hourly_usd == 3.0
