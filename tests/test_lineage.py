"""Lineage (cluster/lineage.py): Parquet inputs described from their footers, the project's commit as MLflow's source
tags, the job's packages; on real Parquet files, real git repositories and a real MLflow store."""

import json
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from gpuflow.cluster.lineage import (
    PACKAGES_ARTIFACT,
    log_job_lineage,
    packages_text,
    parquet_dataset,
    source_tags,
    without_credentials,
)
from gpuflow.cluster.protocol import JobEnv


def table(rows: int) -> pa.Table:
    return pa.table(
        {
            "pixels": [[float(i)] * 4 for i in range(rows)],
            "label": pa.array(range(rows), pa.int64()),
            "name": [f"row-{i}" for i in range(rows)],
        }
    )


def described(uri) -> dict:
    return parquet_dataset(str(uri))._to_mlflow_entity().to_dictionary()


def test_a_parquet_file_is_described_from_its_footer(tmp_path):
    pq.write_table(table(30), tmp_path / "train.parquet")
    dataset = described(tmp_path / "train.parquet")
    assert dataset["name"] == "train" and dataset["source_type"] == "local"
    assert json.loads(dataset["source"])["uri"] == str(tmp_path / "train.parquet")
    assert json.loads(dataset["profile"]) == {"num_rows": 30, "num_files": 1}
    columns = {column["name"]: column for column in json.loads(dataset["schema"])["mlflow_colspec"]}
    assert columns["pixels"]["type"] == "array" and columns["pixels"]["items"]["type"] == "double"
    assert columns["label"]["type"] == "long" and columns["name"]["type"] == "string"


def test_a_folder_digest_is_stable_and_changes_with_a_file(tmp_path):
    folder = tmp_path / "validation"
    folder.mkdir()
    for part in range(3):
        pq.write_table(table(10), folder / f"part-{part}.parquet")
    first = described(folder)
    assert json.loads(first["profile"]) == {"num_rows": 30, "num_files": 3}
    assert described(folder)["digest"] == first["digest"]

    pq.write_table(table(11), folder / "part-1.parquet")
    assert described(folder)["digest"] != first["digest"]
    assert json.loads(described(folder)["profile"])["num_rows"] == 31
    (folder / "part-2.parquet").unlink()
    assert described(folder)["digest"] != first["digest"]


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "train.py").write_text("def train(config): pass\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "first")
    return repo


def test_source_tags_name_the_commit_and_flip_dirty_after_an_edit(repo):
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    tags = source_tags(repo)
    assert tags == {
        "mlflow.source.git.commit": head,
        "mlflow.source.git.branch": "main",
        "mlflow.source.git.dirty": "false",
    }
    (repo / "train.py").write_text("def train(config): return 1\n")
    assert source_tags(repo)["mlflow.source.git.dirty"] == "true"


def test_the_remote_is_logged_without_its_credentials(repo):
    git(repo, "remote", "add", "origin", "https://someone:ghp_secret123@github.com/team/project.git")
    tags = source_tags(repo)
    assert tags["mlflow.source.git.repoURL"] == "https://github.com/team/project.git"
    assert "secret" not in json.dumps(tags)
    assert without_credentials("ssh://git:pw@example.com/team/project.git") == "ssh://git@example.com/team/project.git"
    assert without_credentials("git@github.com:team/project.git") == "git@github.com:team/project.git"


def test_a_folder_outside_git_has_no_source_tags(tmp_path):
    assert source_tags(tmp_path) == {}


def test_the_package_list_is_this_environment(tmp_path):
    lines = packages_text().splitlines()
    assert lines[0].startswith("# Python ")
    assert any(line.startswith("mlflow==") for line in lines) and lines[1:] == sorted(lines[1:], key=str.lower)


def test_the_job_logs_datasets_with_contexts_and_packages_into_the_run(tmp_path):
    pq.write_table(table(20), tmp_path / "train.parquet")
    pq.write_table(table(5), tmp_path / "validation.parquet")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("lineage", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment).info
    job = JobEnv(tracking_uri=client.tracking_uri, mlflow_run_id=run.run_id, artifact_uri=run.artifact_uri)
    uris = {"train": str(tmp_path / "train.parquet"), "validation": str(tmp_path / "validation.parquet")}
    log_job_lineage(job, uris)
    log_job_lineage(job, uris)  # a relaunched job: the same inputs, not twice

    inputs = client.get_run(run.run_id).inputs.dataset_inputs
    contexts = {i.dataset.name: [tag.value for tag in i.tags if tag.key == "mlflow.data.context"] for i in inputs}
    assert contexts == {"train": ["training"], "validation": ["validation"]}
    rows = {i.dataset.name: json.loads(i.dataset.profile)["num_rows"] for i in inputs}
    assert rows == {"train": 20, "validation": 5}
    packages = client.download_artifacts(run.run_id, PACKAGES_ARTIFACT, str(tmp_path / "down"))
    assert "mlflow==" in open(packages).read()
