"""The code a run ran: its recorded commit checked out in a folder of its own (a clone of this repository sharing its
objects: the user's repository and worktrees stay as they are), its uncommitted diff applied. Kept for the next rerun
of the same source."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_GIT_DIRTY, MLFLOW_GIT_REPO_URL

from gpuflow.cluster.lineage import DIFF_ARTIFACT, git
from gpuflow.cluster.protocol import DIFF_TOO_LARGE_TAG, SOURCE_STAMP_PREFIX, SOURCE_WORKDIR_TAG
from gpuflow.cluster.rerun import RerunRefused

READY = ".gpuflow-rerun-ready"  # written last: a checkout without it was interrupted, and is made again


@dataclass(frozen=True)
class Source:
    """What a run recorded of its code: its commit, its uncommitted diff, its workdir inside the repository, and why
    its uncommitted changes cannot be reproduced (None: they can, or there were none)."""

    commit: str
    diff: bytes
    workdir: str
    repo_url: str | None
    unrecorded: str | None


def recorded_source(client, source_run) -> Source:
    """The source the run recorded; refuses a run that recorded no commit."""
    tags, run_id = source_run.data.tags, source_run.info.run_id
    commit = tags.get(MLFLOW_GIT_COMMIT)
    if not commit:
        raise RerunRefused(
            f"run {run_id} recorded no git commit (its workdir was not a git repository): there is "
            "no code to check out; run its spec again with gpuflow run"
        )
    diff, unrecorded = b"", None
    if tags.get(MLFLOW_GIT_DIRTY) == "true":
        if DIFF_TOO_LARGE_TAG in tags:
            unrecorded = f"its uncommitted changes were too large to record ({tags[DIFF_TOO_LARGE_TAG]})"
        else:
            try:
                diff = Path(client.download_artifacts(run_id, DIFF_ARTIFACT)).read_bytes()
            except Exception:
                unrecorded = f"it ran with uncommitted changes but has no {DIFF_ARTIFACT} (an older gpuflow's run)"
    return Source(commit, diff, tags.get(SOURCE_WORKDIR_TAG, "."), tags.get(MLFLOW_GIT_REPO_URL), unrecorded)


def source_stamp(commit: str, diff: bytes) -> str:
    """What a run's flow records of its code as it starts: its commit, and its uncommitted diff's digest if any."""
    return commit + (f"+{hashlib.sha256(diff).hexdigest()[:32]}" if diff else "")


def checked_against_stamp(source: Source, stamp: str | None, run_id: str, commit_alone: bool) -> tuple[Source, bool]:
    """The source to rerun, and whether it is what the run's flow recorded at its start (False: no record to compare
    with). Refuses code changed in MLflow since (its commit tag, or its diff artifact); with `commit_alone`
    (--allow-unrecorded-changes), a changed diff of the recorded commit gives that commit without it."""
    if stamp is None:
        return source, False
    if stamp == source_stamp(source.commit, source.diff):
        return source, True
    commit_recorded = stamp.partition("+")[0] == source.commit
    if commit_alone and commit_recorded:
        changed = f"its {DIFF_ARTIFACT} was changed since its flow run recorded it"
        return replace(source, diff=b"", unrecorded=changed), True  # its commit is the one recorded
    raise RerunRefused(
        f"run {run_id}: its code in MLflow (commit {source.commit}, {len(source.diff):,} bytes of uncommitted "
        f"diff) is not what its flow run recorded as it started ({SOURCE_STAMP_PREFIX}{stamp}): the run's "
        f"{'diff' if commit_recorded else 'commit tag'} was changed since. Nothing was run; "
        + (
            "--allow-unrecorded-changes reruns its commit without the diff"
            if commit_recorded
            else "ask the run's owner, or rerun a run whose record is intact"
        )
    )


def on_allowed_refs(repository: Path, commit: str, refs: tuple[str, ...]) -> None:
    """Refuses a commit that none of `refs` of the repository contains (a served deployment reruns only those)."""
    for ref in refs:
        contains = ["git", "-C", str(repository), "merge-base", "--is-ancestor", commit, ref]
        if subprocess.run(contains, capture_output=True).returncode == 0:
            return
    raise RerunRefused(
        f"commit {commit} is on none of the refs this deployment reruns ({', '.join(refs)}): add its branch to the "
        "deployment's form_policy.rerun_refs in prefect.yaml, or rerun it with `gpuflow rerun` from your tree"
    )


def repository_here(folder: Path) -> Path:
    top = git(folder, "rev-parse", "--show-toplevel")
    if not top:
        raise RerunRefused(f"{folder} is not in a git repository: run gpuflow rerun from a clone of the run's project")
    return Path(top)


def checkout(repository: Path, source: Source, cache: Path) -> Path:
    """A folder with the source's commit of `repository` checked out and its diff applied; reused when made before."""
    commit, diff = source.commit, source.diff
    if git(repository, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        remote = f" from {source.repo_url}" if source.repo_url else ""
        raise RerunRefused(
            f"commit {commit} (the run's code) is not in {repository}: `git fetch`{remote} the branch "
            "that has it, then rerun"
        )
    folder = cache / f"{commit[:12]}-{hashlib.sha256(diff).hexdigest()[:12]}"
    if (folder / READY).is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    # reruns of one source at once take turns: the first makes the folder, the others find it ready
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / READY).is_file():
            make_checkout(repository, commit, diff, folder)
    return folder


def make_checkout(repository: Path, commit: str, diff: bytes, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted checkout left
    run_git(folder.parent, "clone", "--quiet", "--shared", "--no-checkout", str(repository), str(folder))
    run_git(folder, "-c", "advice.detachedHead=false", "checkout", "--quiet", "--detach", commit)
    if diff:
        (folder / ".git" / "gpuflow-uncommitted.diff").write_bytes(diff)
        run_git(folder, "apply", "--binary", "--whitespace=nowarn", str(folder / ".git" / "gpuflow-uncommitted.diff"))
    (folder / ".git" / "info").mkdir(exist_ok=True)
    with open(folder / ".git" / "info" / "exclude", "a") as exclude:
        exclude.write(f"\n{READY}\n")
    (folder / READY).write_text(commit + "\n")


def run_git(folder: Path, *args: str) -> None:
    done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RerunRefused(f"git {' '.join(args[:3])} in {folder} failed: {done.stderr.strip()[-500:]}")
