"""Bad specs fail before any cluster exists, with the field, the bad value and the fix."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuflow.cluster.spec import ExperimentSpec, SpecError, check_entrypoints, check_spec, load_spec, parse_spec
from tests.support.repo import A_LOOP, REPO

DIGITS = REPO / "experiments" / "digits.yaml"

BAD_SPECS = [
    # (overrides, field named in the message, a word of the fix or the value)
    ({"name": "Digits MLP"}, "name", "lowercase"),
    ({"name": 7}, "name", "7"),
    ({"colour": "blue"}, "colour", "unknown field"),
    ({"train": {"loop": "experiments.digits"}}, "train.loop", "module:function"),
    ({"train": {"loop": "not a path:fn"}}, "train.loop", "module:function"),
    ({"train": {"epochs": 0}}, "train.epochs", "greater than or equal to 1"),
    ({"train": {"epochs": "ten"}}, "train.epochs", "ten"),
    ({"train": {"lr": -0.1}}, "train.lr", "greater than 0"),
    ({"train": {"batch_size": 2.5}}, "train.batch_size", "2.5"),
    ({"train": {"learning_rate": 0.1}}, "train.learning_rate", "unknown field"),
    ({"data": {"generate": "write"}}, "data.generate", "module:function"),
    ({"compute": {"num_nodes": 0}}, "compute.num_nodes", "greater than or equal to 1"),
    ({"compute": {"workers_per_node": 0}}, "compute.workers_per_node", "greater than or equal to 1"),
    ({"compute": {"backend": "kubernetes"}}, "compute.backend", "'local' or 'skypilot'"),
    ({"compute": {"num_nodes": 2, "num_workers": 3}}, "compute", "multiple of num_nodes"),
    ({"compute": {"accelerators": "H100:8"}}, "compute", "backend: skypilot"),
    ({"compute": {"backend": "skypilot", "accelerators": "H100 x8"}}, "compute.accelerators", "H100:8"),
    ({"compute": {"cpus_per_worker": 0}}, "compute.cpus_per_worker", "greater than 0"),
    ({"compute": {"gpus": 1}}, "compute.gpus", "unknown field"),
    ({"precision": "fp8"}, "precision", "'fp32', 'bf16' or 'fp16'"),
    ({"limits": {"max_runtime_minutes": 0}}, "limits.max_runtime_minutes", "greater than 0"),
    ({"limits": {"max_cost_usd": -5}}, "limits.max_cost_usd", "greater than 0"),
    ({"limits": {"idle_minutes_to_autostop": 0}}, "limits.idle_minutes_to_autostop", "greater than or equal to 1"),
    ({"storage": {"num_to_keep": 0}}, "storage.num_to_keep", "greater than or equal to 1"),
    ({"tracking": {"uri": 5, "experiment": []}}, "tracking.uri", "5"),
    ({"compute": {"backend": "skypilot", "accelerators": "H100:1"}}, "tracking.uri", "mlflow server"),
]


@pytest.mark.parametrize("fields, field, fix", BAD_SPECS, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_SPECS)])
def test_bad_spec_names_field_and_fix(fields, field, fix):
    with pytest.raises(SpecError) as error:
        parse_spec({**A_LOOP, **fields})
    message = str(error.value)
    assert field in message and fix in message, message


def test_the_shipped_spec_is_valid():
    spec = load_spec(DIGITS)
    assert spec.compute.num_workers == 2 and spec.compute.backend == "local"
    assert check_spec(spec) == []


def test_overrides_apply_and_are_validated():
    spec = load_spec(DIGITS, ["train.lr=0.01", "compute.num_workers=4"])
    assert spec.train.lr == 0.01
    assert (spec.compute.num_workers, spec.compute.workers_per_node) == (4, 4)
    with pytest.raises(SpecError, match="train.lr"):
        load_spec(DIGITS, ["train.lr=-1"])
    with pytest.raises(SpecError, match="field.path=value"):
        load_spec(DIGITS, ["train.lr"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML") as refused:
        load_spec(tmp_path / "bad.yaml")
    assert "in line 1, column" in str(refused.value) and "<unicode string>" not in str(refused.value), refused.value
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="mapping"):
        load_spec(tmp_path / "list.yaml")


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"train": {"loop": "experiments.nope:train_loop"}}, "train.loop"),
        ({"train": {"loop": "experiments.digits:no_such_loop"}}, "train.loop"),
        ({"data": {"train": "t.parquet", "generate": "experiments.digits:missing"}}, "data.generate"),
        ({"data": {"train": "/nonexistent/train.parquet"}}, "data.train"),
        ({"data": {"train": str(REPO / "README.md"), "validation": "/nonexistent/val.parquet"}}, "data.validation"),
        ({"train": {"loop": "experiments.digits:write_parquet"}}, "train.loop"),  # a function, but not a loop
        ({"workdir": "/nonexistent-folder"}, "workdir"),
        ({"secrets": ["GPUFLOW_TEST_UNSET_TOKEN"]}, "secrets[0]"),
    ],
)
def test_checks_beyond_the_model(fields, field):
    spec = parse_spec({**A_LOOP, "workdir": str(REPO), **fields})
    problems = check_spec(spec)
    assert any(problem.startswith(field) for problem in problems), problems
    if "nope" in str(fields):  # a module that is not there: the fix, too
        assert any("dotted path under the workdir" in problem for problem in problems), problems


def test_unreadable_data_file_is_refused(tmp_path):
    junk = tmp_path / "train.parquet"
    junk.write_text("not parquet")
    problems = check_spec(
        parse_spec({**A_LOOP, "workdir": str(REPO), "data": {"train": str(junk), "validation": None}})
    )
    assert any("data.train" in p and "Parquet" in p for p in problems), problems


@pytest.mark.parametrize("field", ["train", "validation"])
def test_data_without_rows_is_refused(tmp_path, field):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, no_rows, no_files = tmp_path / "rows.parquet", tmp_path / "no_rows.parquet", tmp_path / "empty"
    pq.write_table(pa.table({"x": [1.0]}), rows)
    pq.write_table(pa.table({"x": pa.array([], pa.float64())}), no_rows)
    no_files.mkdir()
    for empty, what in ((no_files, "holds no Parquet files"), (no_rows, "holds no rows")):
        data = {"train": str(rows), "validation": str(rows), field: str(empty)}
        problems = check_spec(parse_spec({**A_LOOP, "workdir": str(REPO), "data": data}))
        assert any(
            p.startswith(f"data.{field}: {str(empty)!r} {what}; give a Parquet file or folder that holds rows")
            for p in problems
        ), problems
        assert not any(p.startswith("data.") and str(rows) in p for p in problems), problems


def test_skypilot_accepts_remote_stores():
    spec = ExperimentSpec.model_validate(
        {
            **A_LOOP,
            "compute": {"backend": "skypilot", "accelerators": ["H100:1", "A100:1"], "num_nodes": 2},
            "tracking": {"uri": "https://mlflow.example.com"},
            "storage": {"checkpoints": "s3://bucket/ckpt"},
            "data": {"train": "s3://bucket/train.parquet", "validation": None},
        }
    )
    assert spec.compute.use_gpu and spec.compute.num_workers == 4


def test_skypilot_refuses_data_only_this_machine_has():
    with pytest.raises(SpecError, match="data.train .* cannot read"):
        parse_spec(
            {
                **A_LOOP,
                "compute": {"backend": "skypilot", "accelerators": "H100:1"},
                "data": {"train": "d.parquet"},
                "tracking": {"uri": "https://mlflow.example.com"},
                "storage": {"checkpoints": "s3://b/c"},
            }
        )


def test_the_schema_holds_no_example(tmp_path):
    """An empty spec names what it needs; a loop that reads its own data needs no `data`."""
    with pytest.raises(SpecError) as error:
        parse_spec({})
    assert "train: required" in str(error.value) and "gpuflow init" in str(error.value)
    with pytest.raises(SpecError, match="train.loop: required"):
        parse_spec({"train": {"epochs": 3}})
    with pytest.raises(SpecError, match="data.train: required"):
        parse_spec({**A_LOOP, "data": {"validation": "v.parquet"}})
    spec = parse_spec({**A_LOOP, "workdir": str(REPO)})
    assert spec.data is None and check_spec(spec) == []
    assert ExperimentSpec.model_fields["train"].is_required() and ExperimentSpec.model_fields["data"].default is None


@pytest.mark.parametrize(
    "signature, ok",
    [
        ("config", True),
        ("config: dict", True),
        ("config, extra=1", True),
        ("*args", True),
        ("", False),
        ("config, other", False),
        ("*, config", False),
    ],
)
def test_the_loop_must_take_the_config(tmp_path, signature, ok):
    module = "userloop_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)  # imported modules are cached
    (tmp_path / f"{module}.py").write_text(f"def train_loop({signature}):\n    pass\n")
    problems = check_spec(parse_spec({"train": {"loop": f"{module}:train_loop"}, "workdir": str(tmp_path)}))
    assert (problems == []) == ok, problems
    if not ok:
        assert problems[0].startswith("train.loop:") and "def train_loop(config: dict)" in problems[0]


# -- sweeps -------------------------------------------------------------------------------------------
A_SWEEP = {
    "parameters": {"train.lr": {"grid": [0.001, 0.01]}, "train.params.hidden": {"choice": [64, 128]}},
    "metric": "val_accuracy",
    "mode": "max",
    "max_concurrent_trials": 2,
    "early_stopping": {"grace_epochs": 2},
}


def sweep_spec(train: dict | None = None, **sweep):
    return {
        "train": {"loop": "experiments.digits:train_loop", "epochs": 6, "params": {"hidden": 128}, **(train or {})},
        "sweep": {**A_SWEEP, **sweep},
    }


BAD_SWEEPS = [
    # (the sweep section's changes, the field named, a word of the fix or the value)
    ({"parameters": {"train.lr": {"grid": []}}}, "sweep.parameters.train.lr.grid", "at least 1"),
    ({"parameters": {}}, "sweep.parameters", "at least 1"),
    ({"parameters": {"train.lr": {"grid": [0.1], "choice": [0.2]}}}, "sweep.parameters.train.lr", "exactly one"),
    ({"parameters": {"train.lr": {"range": [0.1, 1]}}}, "sweep.parameters.train.lr.range", "unknown field"),
    ({"parameters": {"train.lr": {"grid": [0.01, -1]}}}, "sweep.parameters.train.lr", "-1"),
    ({"parameters": {"train.epochs": {"choice": [2, 2.5]}}}, "sweep.parameters.train.epochs", "2.5"),
    ({"parameters": {"train.lr": {"loguniform": [0, 0.1]}}}, "sweep.parameters.train.lr", "low > 0"),
    ({"parameters": {"train.lr": {"uniform": [0.1, 0.01]}}}, "sweep.parameters.train.lr", "low < high"),
    ({"parameters": {"train.loop": {"grid": ["a:b"]}}}, "sweep.parameters.train.loop", "train.params.<key>"),
    ({"parameters": {"compute.num_nodes": {"grid": [1, 2]}}}, "sweep.parameters.compute.num_nodes", "train.lr"),
    ({"parameters": {"train.params.hiden": {"grid": [64]}}}, "sweep.parameters.train.params.hiden", "hidden"),
    ({"mode": "maximize"}, "sweep.mode", "'max' or 'min'"),
    ({"metric": ""}, "sweep.metric", "at least 1"),
    ({"max_concurrent_trials": 3}, "sweep.max_concurrent_trials", "compute.num_workers=2"),
    ({"workers_per_trial": 2}, "sweep.max_concurrent_trials", "need 4 workers"),
    ({"early_stopping": {"grace_epochs": 6}}, "sweep.early_stopping.grace_epochs", "not below"),
    (
        {"early_stopping": {"grace_epochs": 2, "reduction_factor": 1}},
        "sweep.early_stopping.reduction_factor",
        "greater than 1",
    ),
    ({"max_trial_minutes": 70}, "sweep.max_trial_minutes", "raise max_runtime_minutes to 70"),
    ({"num_samples": 0}, "sweep.num_samples", "greater than or equal to 1"),
]


@pytest.mark.parametrize("sweep, field, fix", BAD_SWEEPS, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_SWEEPS)])
def test_a_bad_sweep_names_field_and_fix(sweep, field, fix):
    with pytest.raises(SpecError) as error:
        parse_spec(sweep_spec(**sweep))
    message = str(error.value)
    line = next((line for line in message.splitlines() if line.startswith(f"  - {field}:")), message)
    assert fix in line, message


def test_a_sweep_counts_its_trials_and_shares_the_cluster():
    spec = parse_spec(
        sweep_spec(
            num_samples=3,
            parameters={"train.lr": {"grid": [0.001, 0.01, 0.1]}, "train.params.hidden": {"choice": [64, 128]}},
        )
    )
    assert spec.sweep.num_trials == 9  # the grid, once per sample; a choice is drawn per sample
    assert spec.workers_per_trial == 1  # 2 workers ÷ 2 trials at a time
    assert parse_spec(sweep_spec(max_concurrent_trials=1)).workers_per_trial == 2
    assert parse_spec(A_LOOP).workers_per_trial == 2  # no sweep: the one run has the cluster


def test_the_shipped_sweep_spec_is_valid():
    spec = load_spec(REPO / "experiments" / "digits-sweep.yaml")
    assert spec.sweep.num_trials == 6 and check_spec(spec) == []


def test_plan_shows_the_trials_and_the_cost_bound(gpuflow_home, capsys):
    from gpuflow.flows.cli import main

    spec_file = REPO / "experiments" / "digits-sweep.yaml"
    assert main(["plan", str(spec_file), f"--set=workdir={REPO}", "--set", "limits.hourly_rate_usd=3"]) == 0
    shown = capsys.readouterr().out
    assert "sweep: 6 trials (3 train.lr × 2 train.params.hidden × 1 sample(s)), 2 at a time, 1 worker(s) each" in shown
    assert "train.lr: grid [0.0003, 0.002, 0.01]" in shown and "after 2 epoch(s)" in shown
    # 6 trials, 2 at a time: 3 rounds of at most 5 min, at $3/h
    assert "cost bound: 6 trials ÷ 2 at a time × 5 min = 15 min (3 rounds) × $3/h = $0.75" in shown
    assert main(["validate", str(spec_file), f"--set=workdir={REPO}", "--set", "sweep.max_trial_minutes=null"]) == 0
    assert "cost bound: limits.max_runtime_minutes" in capsys.readouterr().out


# -- the entrypoint check runs in a process of its own ----------------------------------------------------
def test_checking_a_spec_imports_nothing_of_the_loop_here():
    """The loop's torch and Ray Train are imported by the check's own process, as the job will: not by the one
    checking the spec (`gpuflow run`, a flow run in `gpuflow serve`)."""
    code = (
        "import sys; from gpuflow.cluster.spec import check_spec, load_spec; "
        f"problems = check_spec(load_spec({str(DIGITS)!r})); "
        "print(problems, sorted(m for m in ('torch', 'ray', 'experiments.digits') if m in sys.modules))"
    )
    shown = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert shown.strip() == "[] []", shown


def test_an_edited_loop_is_checked_again(tmp_path):
    (tmp_path / "edited_loop.py").write_text("def train_loop(config, other):\n    pass\n")
    spec = parse_spec({"train": {"loop": "edited_loop:train_loop"}, "workdir": str(tmp_path)})
    assert "takes (config, other)" in check_spec(spec)[0]
    assert check_entrypoints(spec) is check_entrypoints(spec)  # unchanged: the check is not run again

    (tmp_path / "edited_loop.py").write_text("def train_loop(config):\n    pass\n")
    later = time.time() + 5  # a clock that ticks coarsely must still see the edit
    os.utime(tmp_path / "edited_loop.py", (later, later))
    assert check_spec(spec) == []


def test_a_passed_check_is_reused_by_the_next_run_until_the_loop_or_an_install_changes(tmp_path):
    """Each `gpuflow run` is a new process: a check that passed is kept under GPUFLOW_HOME, and a run of the same
    loop with nothing changed imports nothing to check it. A failed check is never reused."""
    workdir, libs = tmp_path / "project", tmp_path / "libs"  # libs: a folder packages are installed into
    workdir.mkdir(), libs.mkdir()
    (libs / "helper.py").write_text("VALUE = 1\n")
    (workdir / "loop.py").write_text("import helper\ndef train_loop(config):\n    pass\n")
    spec = {"train": {"loop": "loop:train_loop"}, "workdir": str(workdir)}
    code = (
        "import json, sys; from gpuflow.cluster.spec import check_entrypoints, check_spec, parse_spec; "
        f"spec = parse_spec({spec!r}); problems = check_spec(spec); "
        "print(json.dumps([problems, check_entrypoints(spec).process is not None]))"
    )
    env = {**os.environ, "GPUFLOW_HOME": str(tmp_path / "home"), "PYTHONPATH": str(libs)}

    def a_run() -> tuple[list, bool]:
        """(the problems found, whether a check process ran) in a new process, as `gpuflow run` checks"""
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return tuple(json.loads(done.stdout.splitlines()[-1]))

    def later(path: Path) -> None:  # an edit that a coarse clock must still see
        stamp = time.time() + 5
        os.utime(path, (stamp, stamp))

    assert a_run() == ([], True)
    assert a_run() == ([], False)  # nothing changed: no check process
    later(workdir / "loop.py")
    assert a_run() == ([], True)  # the loop was edited
    assert a_run() == ([], False)
    (libs / "newly_installed.py").write_text("")
    later(libs)
    assert a_run() == ([], True)  # something was installed where the loop imports from

    (workdir / "loop.py").write_text("import helper\ndef train_loop(config, extra):\n    pass\n")
    later(workdir / "loop.py")
    for _ in range(2):  # a failure is checked again each time
        problems, checked = a_run()
        assert checked and len(problems) == 1 and "takes (config, extra)" in problems[0], problems


def test_a_loop_that_ends_the_interpreter_is_reported(tmp_path):
    (tmp_path / "exiting_loop.py").write_text("import os\nos._exit(3)\n")
    problems = check_spec(parse_spec({"train": {"loop": "exiting_loop:train_loop"}, "workdir": str(tmp_path)}))
    assert len(problems) == 1 and problems[0].startswith("train.loop:") and "exit code 3" in problems[0], problems
