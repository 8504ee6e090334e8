"""Where a run's data and code came from, as MLflow records it: the Parquet inputs as the run's datasets, the
project's git commit as its source tags, the job's installed packages as an artifact.

The source tags are read on the flow's side (the project folder is there); the datasets and the packages on the
job's (cluster/job/__main__.py), which reads the data and runs in the environment worth describing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from mlflow import MlflowClient
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.filesystem_dataset_source import FileSystemDatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag
from mlflow.types import ColSpec, Schema
from mlflow.types.schema import AnyType, Array, DataType, Object, Property
from mlflow.utils.mlflow_tags import (
    MLFLOW_DATASET_CONTEXT,
    MLFLOW_GIT_BRANCH,
    MLFLOW_GIT_COMMIT,
    MLFLOW_GIT_DIRTY,
    MLFLOW_GIT_REPO_URL,
)

from gpuflow.cluster.protocol import DIFF_TOO_LARGE_TAG, SOURCE_WORKDIR_TAG, JobEnv
from gpuflow.cluster.run.mlflow_run import artifact_repo, log_text_to

CONTEXTS = {"train": "training", "validation": "validation"}  # data.<split> -> MLflow's mlflow.data.context
PACKAGES_ARTIFACT = "environment/packages.txt"
SPEC_ARTIFACT = "spec.yaml"  # the run's whole spec, as the flow resolved it (tasks/tracking.py)
GIT_TIMEOUT_S = 5
DIFF_ARTIFACT = "source/uncommitted.diff"
MAX_DIFF_BYTES = 10 * 1024 * 1024
DIFF_TIMEOUT_S = 60  # `git add -A` reads every changed file


# -- the data ------------------------------------------------------------------------------------------------------
def parquet_dataset(uri: str, name: str | None = None):
    """An MLflow dataset describing the Parquet file or folder at `uri` (any pyarrow filesystem) from its footers
    only, never its rows: schema, row count, files.

    Its digest is a hash of the URI and, per file, its path under the URI and its footer's metadata (row groups,
    their sizes, offsets and column statistics): stable while the files stay the same, changed when one is
    rewritten, added or removed, and cheap on terabytes (one footer read per file, as counting the rows needs)."""
    import pyarrow.dataset as ds

    dataset = ds.dataset(uri, format="parquet")
    digest, rows = hashlib.sha256(uri.encode()), 0
    root = uri.split("://", 1)[-1].rstrip("/")
    for fragment in sorted(dataset.get_fragments(), key=lambda fragment: fragment.path):
        footer = fragment.metadata  # reads the file's footer only
        rows += footer.num_rows
        digest.update(fragment.path.removeprefix(root).encode())
        digest.update(json.dumps(footer.to_dict(), sort_keys=True, default=str).encode())
    return ParquetDataset(
        uri,
        name or dataset_name(uri),
        digest.hexdigest()[:10],
        mlflow_schema(dataset.schema),
        {"num_rows": rows, "num_files": len(dataset.files)},
    )


def dataset_name(uri: str) -> str:
    """The file's or folder's name without .parquet: data/train.parquet -> 'train'."""
    return Path(uri.rstrip("/")).name.removesuffix(".parquet") or uri


def mlflow_schema(schema):
    """A pyarrow schema as MLflow's column schema, which its UI shows."""
    return Schema([ColSpec(mlflow_type(field.type), field.name, required=not field.nullable) for field in schema])


def mlflow_type(arrow_type):
    import pyarrow as pa

    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return Array(mlflow_type(arrow_type.value_type))
    if pa.types.is_struct(arrow_type):
        return Object([Property(field.name, mlflow_type(field.type)) for field in arrow_type])
    # int64, uint32 and uint64 overflow MLflow's integer (int32): long
    for is_type, dtype in (
        (pa.types.is_boolean, DataType.boolean),
        (lambda t: pa.types.is_integer(t) and t.bit_width >= 32 and t != pa.int32(), DataType.long),
        (pa.types.is_integer, DataType.integer),
        (pa.types.is_float64, DataType.double),
        (pa.types.is_floating, DataType.float),
        (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), DataType.string),
        (lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t), DataType.binary),
        (pa.types.is_temporal, DataType.datetime),
    ):
        if is_type(arrow_type):
            return dtype
    return AnyType()  # decimals, maps, ...: no closer MLflow type


class ParquetDataset(MetaDataset):
    """MLflow's metadata-only dataset, with a profile (row and file counts) beside its schema."""

    def __init__(self, uri: str, name: str, digest: str, schema, profile: dict):
        self._profile = profile
        with warnings.catch_warnings():  # MLflow registers its local source twice ("" and file://), then warns
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(uri, candidate_sources=[FileSystemDatasetSource])
        super().__init__(source, name=name, digest=digest, schema=schema)

    @property
    def profile(self) -> dict:
        return self._profile

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "profile": json.dumps(self.profile)}


def dataset_inputs(uris: dict[str, str | None]) -> list:
    """The run's inputs: each Parquet location of `uris` (data.train, data.validation) with its context."""
    return [
        DatasetInput(
            parquet_dataset(uri)._to_mlflow_entity(),
            tags=[InputTag(MLFLOW_DATASET_CONTEXT, CONTEXTS.get(split, split))],
        )
        for split, uri in uris.items()
        if uri
    ]


# -- the code ------------------------------------------------------------------------------------------------------
def git(workdir: Path, *args: str) -> str | None:
    """A git command's output in `workdir`; None when it fails (no git, not a repository, no such remote, slow)."""
    try:
        done = subprocess.run(["git", "-C", str(workdir), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def without_credentials(url: str) -> str:
    """The remote's URL minus what would be a secret in the run: https://user:token@host/x -> https://host/x.
    An ssh user (git@host:org/repo) is no secret and stays."""
    parts = urlsplit(url)
    if not parts.scheme or "@" not in parts.netloc:
        return url
    user, host = parts.netloc.rsplit("@", 1)
    kept = "" if parts.scheme in ("http", "https") else user.split(":", 1)[0] + "@"
    return urlunsplit(parts._replace(netloc=kept + host))


def source_tags(workdir: str | Path) -> dict[str, str]:
    """MLflow's source tags for the project in `workdir`: its commit, remote, branch, and whether the tree had
    changes not committed. Empty when it is not a git repository (or git is missing)."""
    workdir = Path(workdir).expanduser().absolute()
    commit = git(workdir, "rev-parse", "HEAD")
    if not commit:
        return {}
    tags = {MLFLOW_GIT_COMMIT: commit}
    if remote := git(workdir, "remote", "get-url", "origin"):
        tags[MLFLOW_GIT_REPO_URL] = without_credentials(remote)
    if (branch := git(workdir, "rev-parse", "--abbrev-ref", "HEAD")) and branch != "HEAD":  # HEAD: detached
        tags[MLFLOW_GIT_BRANCH] = branch
    if (status := git(workdir, "status", "--porcelain")) is not None:
        tags[MLFLOW_GIT_DIRTY] = str(bool(status)).lower()
    return tags


def uncommitted_changes(workdir: str | Path, limit: int = MAX_DIFF_BYTES) -> tuple[dict[str, str], bytes]:
    """What a dirty tree's run records beyond its commit: (tags, the diff). The tags say where the workdir is in the
    repository and, past `limit`, that the diff is too large to record (then the diff is empty)."""
    workdir = Path(workdir).expanduser().absolute()
    prefix = git(workdir, "rev-parse", "--show-prefix")
    if prefix is None:
        return {}, b""
    tags = {SOURCE_WORKDIR_TAG: prefix.rstrip("/") or "."}
    if git(workdir, "status", "--porcelain") in ("", None):
        return tags, b""
    diff = uncommitted_diff(workdir, limit)
    if diff is None:
        return {**tags, DIFF_TOO_LARGE_TAG: f"over {limit} bytes"}, b""
    return tags, diff


def uncommitted_diff(workdir: Path, limit: int = MAX_DIFF_BYTES) -> bytes | None:
    """`git diff --binary HEAD` of the working tree, untracked files that git does not ignore included, as
    `git apply --binary` takes it; None when over `limit` bytes. The files are staged in an index of its own (a copy of
    the user's, whose stat data spares reading unchanged files): the user's index stays as it was."""
    index = git(workdir, "rev-parse", "--path-format=absolute", "--git-path", "index")
    with tempfile.TemporaryDirectory(prefix="gpuflow-diff-") as folder:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(folder, "index"))}
        if index and Path(index).is_file():
            shutil.copyfile(index, env["GIT_INDEX_FILE"])
        elif not git_ok(workdir, env, "read-tree", "HEAD"):
            return b""
        if not git_ok(workdir, env, "add", "-A"):
            return b""
        command = [
            "git",
            "-C",
            str(workdir),
            "-c",
            "diff.noprefix=false",
            "diff",
            "--cached",
            "--binary",
            "--no-color",
            "--no-ext-diff",
            "--no-textconv",
            "HEAD",
        ]
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as diff:
            found = diff.stdout.read(limit + 1)
            if len(found) > limit:
                diff.kill()
                return None
            diff.wait(DIFF_TIMEOUT_S)
        return found if diff.returncode == 0 else b""


def git_ok(workdir: Path, env: dict, *args: str) -> bool:
    try:
        return (
            subprocess.run(
                ["git", "-C", str(workdir), *args], env=env, capture_output=True, timeout=DIFF_TIMEOUT_S
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


# -- the environment -----------------------------------------------------------------------------------------------
def packages_text() -> str:
    """This environment's installed distributions, name==version sorted (a pip freeze without pip)."""
    found = {
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }
    header = f"# Python {platform.python_version()} on {platform.system()} {platform.machine()}"
    return "\n".join([header, *sorted(found, key=str.lower)]) + "\n"


# -- on the job's side ---------------------------------------------------------------------------------------------
def log_job_lineage(job: JobEnv, uris: dict[str, str | None]) -> None:
    """Into the flow's run (a sweep's parent run), from the job: the data it trains on, as the run's datasets, in
    one call; this environment's packages, in one more. A failure is only a warning: lineage never stops a run."""
    if not job.mlflow_run_id:
        return
    client = MlflowClient(job.tracking_uri)
    try:
        if inputs := dataset_inputs(uris):
            client.log_inputs(job.mlflow_run_id, datasets=inputs)
    except Exception as exc:
        print(f"[gpuflow] warning: the run's datasets are not in MLflow: {exc}", flush=True)
    try:
        if job.artifact_uri:  # known from the run's opening: no read of the run first
            log_text_to(artifact_repo(job.artifact_uri, job.tracking_uri), packages_text(), PACKAGES_ARTIFACT)
        else:
            client.log_text(job.mlflow_run_id, packages_text(), PACKAGES_ARTIFACT)
    except Exception as exc:
        print(f"[gpuflow] warning: the job's package list is not in MLflow: {exc}", flush=True)
