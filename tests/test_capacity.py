"""When GPUs are scarce: the spec's options (SkyPilot fails over from one to the next), a bounded wait when none has
capacity, and the spot → on-demand fallback; the whole flow on the SkyPilot double, which fails as SkyPilot does.
Prices come from the test catalog (aws L4: $0.2628/h spot, $0.8048/h on-demand) or from the options' own rates."""

import shutil

import pytest
import yaml
from prefect.client.orchestration import get_client

from gpuflow.cluster.backends.skypilot import SkyPilotBackend
from gpuflow.cluster.cost.spend import run_costs
from gpuflow.cluster.spec import SpecError, parse_spec
from gpuflow.flows.experiment import run_experiment
from gpuflow.tasks.compute import NO_CAPACITY
from tests.support.repo import A_LOOP, REPO
from tests.support.runs import flow_logs, mlflow_run_of, task_runs
from tests.support.sky_double import FakeSky
from tests.test_cost import CATALOG, point_skypilot_at
from tests.test_skypilot import spec_on_the_double

TWO_OPTIONS = [
    {"infra": "aws", "accelerators": "H100:1", "hourly_rate_usd": 9.0},
    {"infra": "lambda", "accelerators": "A100:1", "hourly_rate_usd": 3.0},
]


@pytest.fixture
def sky_prices(tmp_path, monkeypatch):
    """SkyPilot's price catalog, the test's copy (tests/data/skypilot-catalog)."""
    root = tmp_path / "sky-runtime"
    shutil.copytree(CATALOG / "v8", root / ".sky" / "catalogs" / "v8")
    point_skypilot_at(root, monkeypatch)


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    """A kubeconfig with one context, my-context, whose server nothing answers: validate and plan only read it."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "my-context",
                "clusters": [{"name": "lab", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "me", "user": {"token": "unused"}}],
                "contexts": [{"name": "my-context", "context": {"cluster": "lab", "user": "me"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


def spec_file(folder, gpuflow_home, compute: dict) -> str:
    """A spec on this machine's stores (counted as shared), for `gpuflow validate` and `gpuflow plan`."""
    path = folder / "spec.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **A_LOOP,
                "workdir": str(REPO),
                "compute": {"backend": "skypilot", **compute},
                "limits": {"max_runtime_minutes": 30},
                "tracking": {"uri": f"sqlite:///{gpuflow_home}/mlflow.db"},
                "storage": {"checkpoints": str(gpuflow_home / "checkpoints")},
            }
        )
    )
    return str(path)


@pytest.fixture
def capacity_flow(monkeypatch, gpuflow_home, prefect_server):
    """Runs the real flow on the SkyPilot double with the given compute and limits; stores on this machine count as
    shared. Returns the flow's state, its MLflow run, its log and what SkyPilot still lists."""
    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))

    def run(compute: dict, limits: dict = None, **double):
        fake = FakeSky(**double)
        monkeypatch.setattr("gpuflow.cluster.backends.skypilot.load_sdk", lambda: fake)
        monkeypatch.setattr("gpuflow.flows.capacity.waiting.RETRY_S", 1.0)
        spec = spec_on_the_double(gpuflow_home, compute, {"max_queue_minutes": 0.1, **(limits or {})})
        state = run_experiment(spec, return_state=True)
        flow_run_id = state.state_details.flow_run_id
        client, mlflow_run = mlflow_run_of(spec.tracking_uri, flow_run_id, spec.experiment_name)
        return state, client, mlflow_run, flow_logs(flow_run_id), SkyPilotBackend(fake).status()

    return run


def test_the_first_option_without_capacity_the_second_launches_and_prices_the_run(capacity_flow):
    state, _, mlflow_run, logs, left = capacity_flow({"options": TWO_OPTIONS}, no_capacity=["H100"])
    assert state.is_completed(), state.message
    tags, metrics = mlflow_run.data.tags, mlflow_run.data.metrics
    assert mlflow_run.info.status == "FINISHED"
    assert tags["gpuflow.option"] == "2: lambda A100:1 on-demand"
    assert (tags["gpuflow.launched.accelerators"], tags["gpuflow.launched.spot"]) == ("A100:1", "false")
    assert tags["gpuflow.price_source"] == "compute.options.1.hourly_rate_usd"
    assert metrics["hourly_cost_usd"] == 3.0 and metrics["attempt_hourly_usd"] == 3.0  # metered as the second
    assert metrics["cost_usd"] == pytest.approx(3.0 * metrics["cluster_hours"])
    assert "launched option 2: lambda A100:1 on-demand" in logs
    assert left == []


def test_no_capacity_anywhere_waits_the_bound_then_fails_naming_each_option(capacity_flow):
    state, _, mlflow_run, logs, left = capacity_flow({"options": TWO_OPTIONS}, no_capacity=["H100", "A100"])
    assert state.is_failed()
    message = state.message + logs
    assert "limits.max_queue_minutes: no capacity for" in logs
    for option in (
        "option 1 (aws H100:1 on-demand): Failed to acquire resources",
        "option 2 (lambda A100:1 on-demand): Failed to acquire resources",
    ):
        assert option in message
    assert "waiting for one of 2 option(s)" in logs  # said in the console while it waited
    with get_client(sync_client=True) as client:
        names = [s.name for s in client.read_flow_run_states(state.state_details.flow_run_id)]
    assert "Waiting for capacity" in names  # and in the Prefect state
    # each try's answer is the provision task's result, not its failure: no red task per try while it waits
    tries = [run.state_name for run in task_runs(state.state_details.flow_run_id, "provision")]
    assert len(tries) >= 2 and set(tries) == {NO_CAPACITY}, tries
    assert mlflow_run.info.status == "FAILED"  # not stuck RUNNING
    assert mlflow_run.data.metrics["cost_usd"] < 0.01  # the wait is not billed: no cluster existed
    assert left == []


def test_two_preemptions_then_an_on_demand_relaunch_completes_each_attempt_costed(capacity_flow, sky_prices):
    state, client, mlflow_run, logs, left = capacity_flow(
        {"accelerators": "L4:1", "infra": "aws", "use_spot": True, "spot_fallback_after": 2, "max_recoveries": 3},
        preempt_spot=2,
        job_s=1.0,
    )
    assert state.is_completed(), state.message
    run_id, metrics, tags = mlflow_run.info.run_id, mlflow_run.data.metrics, mlflow_run.data.tags
    assert mlflow_run.info.status == "FINISHED" and metrics["recoveries"] == 2  # one MLflow run for all three
    hourly = [m.value for m in sorted(client.get_metric_history(run_id, "attempt_hourly_usd"), key=lambda m: m.step)]
    assert hourly == [pytest.approx(0.2628), pytest.approx(0.2628), pytest.approx(0.8048)]  # spot, spot, on-demand
    costs = client.get_metric_history(run_id, "attempt_cost_usd")
    assert len(costs) == 3 and metrics["cost_usd"] == pytest.approx(sum(m.value for m in costs))
    assert tags["gpuflow.option"] == "1: aws L4:1 on-demand" and tags["spot"] == "false"
    assert "relaunching on-demand" in logs
    [row] = [row for row in run_costs(f"sqlite:///{client.tracking_uri.split('///')[-1]}", 0) if row.run_id == run_id]
    assert row.cost_usd == pytest.approx(sum(m.value for m in costs))  # `gpuflow cost` adds the attempts up
    assert left == []


def test_plan_shows_the_options_in_order_with_their_prices_and_the_budget_estimate(
    tmp_path, capsys, gpuflow_home, monkeypatch, kubeconfig
):
    from gpuflow.flows.cli import main

    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))
    spec = spec_file(
        tmp_path,
        gpuflow_home,
        {
            "spot_fallback_after": 2,
            "options": [
                {"infra": "k8s/my-context", "accelerators": "A100:1", "hourly_rate_usd": 1.5},
                {"infra": "k8s/my-context", "accelerators": "H100:1", "use_spot": True, "hourly_rate_usd": 4.0},
            ],
        },
    )
    assert main(["plan", spec]) == 0
    shown = capsys.readouterr().out
    first = shown.index("# option 1: k8s/my-context A100:1 on-demand: 1 × node (A100:1, on-demand): $1.5/h")
    second = shown.index("# option 2: k8s/my-context H100:1 spot: 1 × node (H100:1, spot): $4/h")
    fallback = shown.index("# option 2 (spot fallback): k8s/my-context H100:1 on-demand")
    assert first < second < fallback
    assert "[compute.options.0.hourly_rate_usd]" in shown
    assert "# budget estimate (the dearest option that may launch): 1 × node (H100:1, spot" in shown
    assert "at most $2.00 in limits.max_runtime_minutes=30" in shown
    assert "tries the options in order" in shown
    assert "- infra: kubernetes/my-context" in shown  # the task SkyPilot gets names the context


def test_a_kubernetes_context_is_checked_against_the_kubeconfig(
    tmp_path, capsys, gpuflow_home, monkeypatch, kubeconfig
):
    """The context of k8s/<context> (or kubernetes/<context>) must be in the kubeconfig SkyPilot reads; no
    server is contacted (the kubeconfig's answers nowhere)."""
    from gpuflow.flows.cli import main

    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))
    known = spec_file(
        tmp_path,
        gpuflow_home,
        {"options": [{"infra": "kubernetes/my-context", "accelerators": "L4:1", "hourly_rate_usd": 2.5}]},
    )
    assert main(["validate", known]) == 0
    assert "$2.5/h in all [compute.options.0.hourly_rate_usd]" in capsys.readouterr().out
    unknown = spec_file(
        tmp_path,
        gpuflow_home,
        {
            "options": [
                {"infra": "k8s/my-context", "accelerators": "L4:1", "hourly_rate_usd": 2.5},
                {"infra": "k8s/elsewhere", "accelerators": "L4:1", "hourly_rate_usd": 2.5},
            ]
        },
    )
    for command in ("validate", "plan"):
        assert main([command, unknown]) == 2
        refused = capsys.readouterr()
        assert "compute.options.0" not in refused.err and refused.out == ""
        assert (
            f"compute.options.1.infra: 'k8s/elsewhere': no context 'elsewhere' in the kubeconfig ({kubeconfig}); "
            "it has: my-context. Name one (e.g. k8s/my-context)"
        ) in refused.err


@pytest.mark.parametrize(
    "compute, field, fix",
    [
        ({"options": [{"infra": "aws", "zone": "us-east-1a"}]}, "compute.options.0.zone", "unknown field"),
        ({"options": []}, "compute.options", "list at least one option"),
        (
            {"region": "us-east-1", "options": [{"cloud": "aws", "region": "us-west-2", "accelerators": "H100:1"}]},
            "compute.options.0.region",
            "remove compute.region",
        ),
        (
            {"accelerators": ["H100:1", "A100:1"], "options": [{"infra": "aws"}]},
            "compute.accelerators",
            "give each accelerator its own option",
        ),
        (
            {"options": [{"infra": "aws/us-east-1", "cloud": "aws", "accelerators": "H100:1"}]},
            "compute.options.0",
            "use one",
        ),
        ({"options": [{"infra": "aws", "accelerators": "H100 x8"}]}, "compute.options.0.accelerators", "'H100:8'"),
        ({"accelerators": "H100:1", "spot_fallback_after": 2}, "compute.spot_fallback_after", "use_spot: true"),
        ({"backend": "local", "options": [{"infra": "aws"}]}, "compute.options", "compute.backend: skypilot"),
    ],
)
def test_bad_options_are_refused_naming_the_field_and_the_fix(compute, field, fix):
    with pytest.raises(SpecError) as error:
        parse_spec(
            {
                **A_LOOP,
                "compute": {"backend": "skypilot", **compute},
                "tracking": {"uri": "http://127.0.0.1:1"},
                "storage": {"checkpoints": "s3://bucket/ckpt"},
            }
        )
    assert field in str(error.value) and fix in str(error.value), str(error.value)


@pytest.mark.parametrize("max_cost_usd, affordable", [(5.0, True), (0.5, False)])
def test_the_on_demand_fallback_is_checked_against_the_budget_first(sky_prices, max_cost_usd, affordable, caplog):
    """After compute.spot_fallback_after losses the relaunch goes on-demand, if spent + its price for the rest of
    limits.max_runtime_minutes fits limits.max_cost_usd; else the run stops as budget (its checkpoints kept)."""
    from gpuflow.cluster.cost.pricing import hourly_cost
    from gpuflow.cluster.run.lifecycle import Lifecycle, RunStopped
    from gpuflow.cluster.run.meter import Meter
    from gpuflow.cluster.run.record import RunRecord
    from gpuflow.flows.capacity.waiting import Capacity

    spec = parse_spec(
        {
            **A_LOOP,
            "compute": {
                "backend": "skypilot",
                "accelerators": "L4:1",
                "infra": "aws",
                "use_spot": True,
                "spot_fallback_after": 2,
            },
            "limits": {"max_runtime_minutes": 60, "max_cost_usd": max_cost_usd},
            "tracking": {"uri": "http://127.0.0.1:1"},
            "storage": {"checkpoints": "s3://bucket/ckpt"},
        }
    )
    life = Lifecycle("gpuflow-x", down=lambda name: True, meter=Meter(hourly_cost(spec)))
    life.job_started()
    capacity = Capacity(RunRecord(spec, "flow-run"), life, set_state=lambda name, message: None)
    caplog.set_level("INFO", logger="gpuflow")
    assert capacity.spot_lost("preempted") is False and capacity.launch_spec.compute.use_spot  # 1 of 2
    if affordable:
        assert capacity.spot_lost("preempted") is True
        assert (
            not capacity.launch_spec.compute.use_spot
            and "relaunching on-demand at up to $0.8048/h" in caplog.messages[-1]
        )
    else:
        with pytest.raises(RunStopped) as stopped:
            capacity.spot_lost("preempted")
        assert stopped.value.reason == life.stop_reason == "budget"
        assert "max_cost_usd=0.50" in str(stopped.value) and "checkpoints are kept" in str(stopped.value)


def test_a_spec_with_options_reads_back_the_same_after_a_json_round_trip():
    """The flow's spec reaches Prefect and the job as JSON: every field is then 'set', and must not contradict."""
    from gpuflow.cluster.spec import ExperimentSpec, parse_spec

    spec = parse_spec(
        {
            "train": {"loop": "experiments.digits:train_loop"},
            "tracking": {"uri": "http://mlflow:5000"},
            "storage": {"checkpoints": "s3://bucket/gpuflow"},
            "compute": {"backend": "skypilot", "options": [{"infra": "aws", "use_spot": True}, {"infra": "gcp"}]},
        }
    )
    again = ExperimentSpec.model_validate_json(spec.model_dump_json(), context={"on_cluster": True})
    assert again == spec


SPOT_FIELDS = {"accelerators": "L4:1", "infra": "aws", "use_spot": True, "spot_fallback_after": 2}
SPOT_OPTIONS = {
    "spot_fallback_after": 2,
    "options": [
        {"infra": "aws", "accelerators": "L4:1", "use_spot": True},
        {"infra": "aws/us-west-2", "accelerators": "L4:1", "use_spot": True},
    ],
}
A_GRID = {"parameters": {"train.lr": {"grid": [0.1, 0.01]}}, "metric": "val_accuracy", "mode": "max"}


@pytest.mark.parametrize(
    "compute, sweep",
    [(SPOT_FIELDS, None), (SPOT_OPTIONS, None), (SPOT_OPTIONS, A_GRID)],
    ids=["spot fields", "spot options", "a sweep on spot options"],
)
def test_every_spec_the_flow_hands_a_node_loads_there(sky_prices, compute, sweep):
    """A node loads the spec it is handed by its own rules (cluster/job/__main__.py), after the launch was paid for.
    Each spec the flow may hand one: the first launch, the relaunch after a spot loss, the spot fallback's on-demand
    relaunch, each sweep trial's, taken from the SkyPilot task as SkyPilot delivers it, loaded by the job's loader."""
    from pydantic import ValidationError

    from gpuflow.cluster.backends.skypilot import build_task
    from gpuflow.cluster.cost.pricing import hourly_cost
    from gpuflow.cluster.job.sweep import trial_spec
    from gpuflow.cluster.protocol import JobEnv
    from gpuflow.cluster.run.lifecycle import Lifecycle
    from gpuflow.cluster.run.meter import Meter
    from gpuflow.cluster.run.record import RunRecord
    from gpuflow.cluster.spec import job_spec
    from gpuflow.flows.capacity.waiting import Capacity

    spec = parse_spec(
        {
            **A_LOOP,
            "compute": {"backend": "skypilot", **compute},
            "sweep": sweep,
            "tracking": {"uri": "http://127.0.0.1:1"},
            "storage": {"checkpoints": "s3://bucket/ckpt"},
        }
    )
    capacity = Capacity(
        RunRecord(spec, "flow-run"),
        Lifecycle("gpuflow-x", down=lambda name: True, meter=Meter(hourly_cost(spec))),
        lambda *_: None,
    )
    shipped = {"first launch": capacity.launch_spec}
    assert capacity.spot_lost("preempted") is False
    shipped["relaunch after a spot loss"] = capacity.launch_spec
    assert capacity.spot_lost("preempted") is True
    shipped["the spot fallback's relaunch"] = capacity.launch_spec
    assert not shipped["the spot fallback's relaunch"].compute.use_spot
    for name, launched in list(shipped.items()):
        for lr in (sweep and A_GRID["parameters"]["train.lr"]["grid"]) or []:
            shipped[f"{name}, trial lr={lr}"] = trial_spec(launched, {"train.lr": lr})
    refused = {}
    for name, launched in shipped.items():
        task = build_task(launched, run_name="run", env={}, with_setup=False)
        try:
            job_spec(JobEnv.from_env(task.envs).spec_json).anchored()
        except ValidationError as error:
            refused[name] = str(error)
    assert len(shipped) == (9 if sweep else 3) and refused == {}


def test_no_catalog_and_no_price_is_refused_before_anything_launches(tmp_path, capsys, gpuflow_home, monkeypatch):
    """Offline, SkyPilot would try to download its catalog at launch and fail mid-run; validate and plan refuse
    first, naming the option, the price fields and how to install the catalog."""
    from gpuflow.flows.cli import main

    monkeypatch.setenv("GPUFLOW_SHARED_PATH", str(gpuflow_home))
    runtime = tmp_path / "sky-runtime"
    point_skypilot_at(runtime, monkeypatch)
    catalog = runtime / ".sky" / "catalogs" / "v8"
    unpriced = spec_file(tmp_path, gpuflow_home, {"options": [{"infra": "aws", "accelerators": "L4:1"}]})
    for command in ("validate", "plan"):
        assert main([command, unpriced]) == 2
        refused = capsys.readouterr().err
        assert (
            "compute.options.0: aws L4:1 on-demand has no price: compute.options.0.hourly_rate_usd or "
            "limits.hourly_rate_usd is unset" in refused
        )
        assert f"{catalog / 'aws' / 'vms.csv'}, {catalog / 'common' / 'accelerators.csv'}" in refused
        assert "run `sky show-gpus` once where the internet is reachable" in refused
    # the cloud's instance list alone is not enough: SkyPilot checks an accelerator's name in common/ at launch
    (catalog / "aws").mkdir(parents=True)
    shutil.copy(CATALOG / "v8" / "aws" / "vms.csv", catalog / "aws")
    assert main(["validate", unpriced]) == 2
    refused = capsys.readouterr().err
    assert "accelerators.csv" in refused and "vms.csv" not in refused
    shutil.copytree(CATALOG / "v8" / "common", catalog / "common")
    assert main(["validate", unpriced]) == 0
    assert "$0.8048/h in all [catalog]" in capsys.readouterr().out
