"""A run's work key: one digest of everything that decides what its training produces, and the lookups of a
finished run by it.

The key is a sha256 of these inputs, each in for the reason given; whatever is not listed is out.

    in   code                the workdir's tree at the run's commit (git's own hash of it: every file the loop can
                             import from the workdir, its helpers too, not the loop's file alone) and a sha256 of the
                             recorded uncommitted diff (source/uncommitted.diff: changes and untracked files)
    in   data                per split (data.train, data.validation): lineage's digest of the Parquet footers, plus
                             each file's path, size and modification time: a value rewritten in place can leave the
                             footers as they were, never the file's time
    in   train.loop          which function trains
    in   train.params        its hyper-parameters, the seed among them (the spec has no seed field of its own)
    in   train.epochs        how long it trains (out of the continuation key: a run with fewer epochs is a start)
    in   train.batch_size    and train.lr: the optimisation itself
    in   precision           fp32, bf16 or fp16: other numbers
    in   compute.num_workers and compute.min_workers: the world size splits the data and sums the gradients
    in   sweep               a sweep trains other trials than one run does
    in   envs                the job's environment variables: the loop can read them
    in   setup               on a cloud node it installs what the job runs with, which this machine cannot see
    in   packages            torch, ray and gpuflow's versions here, and Python's
    in   key_version         a change to this recipe makes keys that match no run keyed the old way
    out  name, tracking      where the run is recorded, not what it learns
    out  limits, profile     when it stops early (then it is not FINISHED) and what it traces
    out  notify, secrets     whom it tells; credentials
    out  storage             where its checkpoints go and how many stay
    out  compute (the rest)  backend, nodes, accelerators, spot, places, recoveries: where it runs, not what it learns
    out  workdir, data.generate  their content is in (the code, the data's digests), not their names

No key, and the reason instead (a made-up key would be worse: another run could match it): no git repository,
uncommitted changes too large to record or not diffable, the loop's module outside the workdir, no data section
(the loop reads its own data), data that cannot be read. Files git ignores are not in the code's digest.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from dataclasses import dataclass
from pathlib import Path

from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_GIT_DIRTY

from gpuflow.cluster.lineage import git, parquet_dataset
from gpuflow.cluster.protocol import (
    DIFF_TOO_LARGE_TAG,
    WORK_KEY_MISSING_TAG,
    WORK_KEY_TAG,
    WORK_KEY_WITHOUT_EPOCHS_TAG,
)
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.usercode import module_file

KEY_VERSION = 1
PACKAGES = ("torch", "ray", "gpuflow")
EPOCHS = "train.epochs"
CONTINUATION_CANDIDATES = 100  # the newest finished runs of a continuation key looked at


@dataclass(frozen=True)
class WorkKey:
    """A run's work key and its continuation key (the same without train.epochs); both None, and why, when the
    run's inputs cannot be digested."""

    key: str | None
    without_epochs: str | None
    missing: str | None = None

    def tags(self) -> dict[str, str]:
        if self.key is None:
            return {WORK_KEY_MISSING_TAG: self.missing or "unknown"}
        return {WORK_KEY_TAG: self.key, WORK_KEY_WITHOUT_EPOCHS_TAG: self.without_epochs}


class Undigestible(Exception):
    """An input of the run that has no digest: why."""


def work_key(spec: ExperimentSpec, source: dict[str, str], diff: bytes) -> WorkKey:
    """The spec's work key. `source` and `diff` are what the run records of its code (lineage.source_tags and
    uncommitted_changes): the key reads the workdir's tree from git, the data's footers, and nothing else."""
    try:
        inputs = work_inputs(spec, source, diff)
    except Undigestible as why:
        return WorkKey(None, None, str(why))
    return WorkKey(digest(inputs), digest({name: value for name, value in inputs.items() if name != EPOCHS}))


def digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def work_inputs(spec: ExperimentSpec, source: dict[str, str], diff: bytes) -> dict:
    """What goes into the key, by name (the module's docstring says why each)."""
    spec = spec.anchored()
    compute = spec.compute
    return {
        "key_version": KEY_VERSION,
        "code": code_digest(spec, source, diff),
        "data": data_digests(spec),
        **train_inputs(spec.train),
        "precision": spec.precision,
        "compute.num_workers": compute.num_workers,
        "compute.min_workers": compute.min_workers,
        "sweep": spec.sweep.model_dump(mode="json") if spec.sweep else None,
        "envs": spec.envs,
        "setup": spec.setup,
        "packages": package_versions(),
    }


def train_inputs(train) -> dict:
    """The train section's part of the key: what a sweep's points vary (cluster/rerun/sweep_reuse.py)."""
    return {
        "train.loop": train.loop,
        "train.params": train.params,
        EPOCHS: train.epochs,
        "train.batch_size": train.batch_size,
        "train.lr": train.lr,
    }


def code_digest(spec: ExperimentSpec, source: dict[str, str], diff: bytes) -> str:
    commit = source.get(MLFLOW_GIT_COMMIT)
    if not commit:
        raise Undigestible("the workdir is not in a git repository (or git is missing): its code has no digest")
    if DIFF_TOO_LARGE_TAG in source:
        raise Undigestible(f"its uncommitted changes were too large to record ({source[DIFF_TOO_LARGE_TAG]})")
    if source.get(MLFLOW_GIT_DIRTY) != "false" and not diff:
        raise Undigestible("git could not tell or diff its uncommitted changes")
    # the workdir's own tree: a commit that changes only files outside it leaves the key as it was
    tree = git(Path(spec.workdir), "rev-parse", f"{commit}:./")
    if not tree:
        raise Undigestible(f"git could not read the workdir's tree at commit {commit[:12]}")
    module = spec.train.loop.split(":")[0]
    found = module_file(spec.workdir, module)
    if found is None or not found.is_relative_to(spec.workdir):
        raise Undigestible(f"the loop's module {module} is not in the workdir: its code is not in the repository")
    return f"{tree} {hashlib.sha256(diff).hexdigest()}"


def data_digests(spec: ExperimentSpec) -> dict[str, str]:
    if spec.data is None:
        raise Undigestible("the spec has no data section: the loop reads data of its own, which has no digest")
    found = {}
    for split, uri in (("train", spec.data.train), ("validation", spec.data.validation)):
        if uri:
            try:
                found[split] = data_digest(uri)
            except FileNotFoundError as exc:  # the first run of a spec whose data.generate writes it
                raise Undigestible(f"data.{split} ({uri}) is not written yet: no finished run read it") from exc
            except Exception as exc:
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
                raise Undigestible(f"data.{split} ({uri}) has no digest: {why}") from exc
    return found


def data_digest(uri: str) -> str:
    """Lineage's digest of the Parquet footers, with each file's path, size and modification time."""
    import pyarrow.dataset as ds

    dataset = ds.dataset(uri, format="parquet")
    if not dataset.files:
        raise FileNotFoundError("no Parquet files")
    stamps = [f"{info.path} {info.size} {info.mtime_ns}" for info in dataset.filesystem.get_file_info(dataset.files)]
    return hashlib.sha256("\n".join([parquet_dataset(uri).digest, *sorted(stamps)]).encode()).hexdigest()


def package_versions() -> dict[str, str | None]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), **{name: version(name) for name in PACKAGES}}


# -- finding a run by its key (no flow uses these yet) ---------------------------------------------------------------
def finished_run_with_key(client, experiment_id: str, key: str):
    """The newest FINISHED run of the experiment with this work key; None if there is none."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'FINISHED' and tags.`{WORK_KEY_TAG}` = '{quoted(key)}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def run_to_continue(client, experiment_id: str, without_epochs: str, epochs: int):
    """A FINISHED run with this continuation key that trained fewer than `epochs` epochs: of those, the one that
    trained the most (the fewest left to train), the newest of them on a tie; None if there is none."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=(
            f"attributes.status = 'FINISHED' and tags.`{WORK_KEY_WITHOUT_EPOCHS_TAG}` = '{quoted(without_epochs)}'"
        ),
        order_by=["attributes.start_time DESC"],
        max_results=CONTINUATION_CANDIDATES,
    )
    shorter = [(trained, run) for run in runs if (trained := epochs_of(run)) is not None and trained < epochs]
    # max keeps the first of equals: the newest, as the runs come newest first
    return max(shorter, key=lambda pair: pair[0])[1] if shorter else None


def epochs_of(run) -> int | None:
    """The epochs a run was asked to train, from its params (RunRecord.opened logs the spec's)."""
    try:
        return int(run.data.params[EPOCHS])
    except (KeyError, ValueError):
        return None


def quoted(value: str) -> str:
    return value.replace("'", "\\'")
