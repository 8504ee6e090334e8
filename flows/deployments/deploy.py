"""gpuflow's Prefect deployments, read from prefect.yaml: built for `serve`, or registered with a work pool.

gpuflow deploy                 # = prefect deploy of every deployment whose code is here, pool gpuflow-process
gpuflow deploy --pool my-pool  # another work pool (created as a process pool if missing)
gpuflow deploy --remote URL    # where workers pull the code from (default: the git remote origin)
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

from gpuflow.cluster.spec import SpecError, apply_override, parse_spec
from gpuflow.cluster.spec.loading import DuplicateKey, safe_load

PREFECT_YAML = Path("prefect.yaml")
DEFAULT_POOL = "gpuflow-process"
# Prefect anchors an interval without one at the moment it is built: every `gpuflow serve` start would move the next
# run a whole interval away, and a serve restarted more often than that would never run it.
INTERVAL_ANCHOR = datetime(2026, 1, 1, tzinfo=timezone.utc)


def declared(prefect_yaml: Path = PREFECT_YAML) -> list[dict]:
    """The `deployments:` entries of prefect.yaml, anchors resolved."""
    try:
        return safe_load(Path(prefect_yaml).read_text())["deployments"]
    except DuplicateKey as exc:  # a deployment's spec given a field twice
        raise SpecError([exc.describe(str(prefect_yaml))]) from None


def declared_entry(name: str, prefect_yaml: Path = PREFECT_YAML) -> dict | None:
    """The prefect.yaml entry of deployment `name` on this machine; None where this folder has none."""
    entries = declared(prefect_yaml) if Path(prefect_yaml).is_file() else []
    return next((entry for entry in entries if entry.get("name") == name), None)


def runnable(entries: list[dict], only: list[str] = ()) -> tuple[list[dict], list[str]]:
    """The entries to use (all, or those named in `only`), and why any others are skipped."""
    chosen, skipped = [], []
    names = {entry["name"] for entry in entries}
    for name in only:
        if name not in names:
            raise SpecError([f"deployment {name!r} is not in prefect.yaml; choose from {sorted(names)}"])
    for entry in entries:
        if only and entry["name"] not in only:
            continue
        path = entry["entrypoint"].split(":")[0]
        # a file here (this repo's flows/experiment.py), or a module of an installed package (a user's project)
        if not (Path(path).is_file() if path.endswith(".py") else importable(path)):
            skipped.append(f"{entry['name']}: {path} does not exist here yet")
            continue
        chosen.append(entry)
    return chosen, skipped


def importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def with_overrides(parameters: dict, overrides: list[str], force: bool = False) -> dict:
    """Applies `field=value` overrides to a deployment's spec parameter, and validates the result (force: a copy
    even with no overrides)."""
    if "spec" not in parameters or not (overrides or force):
        return parameters
    spec = yaml.safe_load(yaml.safe_dump(parameters["spec"]))  # a deep copy: anchors share one dict
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError([f"--set {item!r}: write it as field.path=value, e.g. train.epochs=3"])
        apply_override(spec, key.strip(), yaml.safe_load(value))
    parse_spec(spec)  # a bad override is refused here, naming the field, before anything is served
    return {**parameters, "spec": spec}


def schedules_of(entry: dict) -> list:
    from prefect.schedules import Cron, Interval

    made = []
    for schedule in entry.get("schedules") or []:
        options = {
            "timezone": schedule.get("timezone"),
            "active": schedule.get("active", True),
            "parameters": schedule.get("parameters"),
        }
        if "cron" in schedule:
            made.append(Cron(schedule["cron"], **options))
        elif "interval" in schedule:
            anchor = schedule.get("anchor_date") or INTERVAL_ANCHOR
            made.append(Interval(timedelta(seconds=schedule["interval"]), anchor_date=anchor, **options))
        else:
            raise ValueError(f"deployment {entry['name']}: only cron and interval schedules are supported here")
    return made


def runner_deployments(overrides: list[str] = (), only: list[str] = (), prefect_yaml: Path = PREFECT_YAML):
    """RunnerDeployments (flow.to_deployment) for `prefect.serve`, one per runnable entry of prefect.yaml."""
    from prefect.flows import load_flow_from_entrypoint

    entries, skipped = runnable(declared(prefect_yaml), only)
    for reason in skipped:
        print(f"gpuflow: skipping deployment {reason}", file=sys.stderr)
    deployments = []
    for entry in entries:
        flow = load_flow_from_entrypoint(entry["entrypoint"])
        deployments.append(
            flow.to_deployment(
                name=entry["name"],
                description=entry.get("description"),
                tags=entry.get("tags"),
                parameters=with_overrides(entry.get("parameters") or {}, overrides),
                schedules=schedules_of(entry),
            )
        )
    return deployments


def ensure_process_pool(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            print(f"gpuflow: created process work pool {name!r}")


def deploy(
    only: list[str] = (), pool: str = DEFAULT_POOL, prefect_yaml: Path = PREFECT_YAML, remote: str | None = None
) -> int:
    """Registers the deployments with the Prefect server (PREFECT_API_URL) through `prefect deploy`, their pull
    step at this folder's git commit and remote (origin unless `remote`)."""
    entries, skipped = runnable(declared(prefect_yaml), only)
    for reason in skipped:
        print(f"gpuflow: skipping deployment {reason}", file=sys.stderr)
    source = git_source(Path(prefect_yaml).absolute().parent, remote)
    ensure_process_pool(pool)
    command = [
        sys.executable,
        "-m",
        "prefect",
        "--no-prompt",
        "deploy",
        "--prefect-file",
        str(prefect_yaml),
        "--pool",
        pool,
    ]
    for entry in entries:
        command += ["--name", entry["name"]]
    return subprocess.call(command, env={**os.environ, **source})


def git_source(folder: Path, remote: str | None = None) -> dict[str, str]:
    """Where workers pull the code from: the remote's URL and this commit, as the pull step's variables."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD")
    url = remote or git("remote", "get-url", "origin")
    if not commit or not url:
        raise SpecError(
            [
                f"gpuflow deploy: workers pull the code from git, and {folder} has "
                f"{'no commit' if not commit else 'no remote origin'}; commit and push it, or give --remote"
            ]
        )
    if git("status", "--porcelain", "--untracked-files=no"):
        print(f"gpuflow: uncommitted changes are not deployed: workers run commit {commit[:12]}", file=sys.stderr)
    print(f"gpuflow: workers will pull {url} at {commit[:12]} (push it there first)", file=sys.stderr)
    return {"GPUFLOW_GIT_REMOTE": url, "GPUFLOW_GIT_COMMIT": commit}
