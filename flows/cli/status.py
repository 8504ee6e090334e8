"""`gpuflow status`: what of ours is running or waiting right now, on every backend, and what it costs so far.

    gpuflow status            # a table: run, state, cluster, GPUs, $/h, spent, lease, queue, MLflow, message
    gpuflow status --json     # the same, for scripts

Read from where each fact lives: the Prefect server (the runs, their state, their place in a quota's queue), each
backend (the clusters), and each run's MLflow run (its price, its start, its lease as the reaper judges it). A
cluster of ours whose run is over or gone is listed too: the reaper downs it at its next pass; so is a run that ended
with its message not delivered (the reaper's pass tries again).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from gpuflow.cluster.backends import flow_run_id_of
from gpuflow.cluster.cost.spend import HOURLY_METRIC
from gpuflow.cluster.protocol import (
    FLOW_RUN_TAG,
    GRACE_TAG,
    NOTIFIED_TAG,
    NOTIFY_FAILED_TAG,
    RENEWED_TAG,
    triggered_by,
)
from gpuflow.cluster.run.lease import stale
from gpuflow.cluster.run.liveness import age_s
from gpuflow.cluster.run.mlflow_run import at_most_one_try
from gpuflow.flows.cli.console import clock
from gpuflow.flows.deployments.known_servers import TRACKING_TAG_PREFIX
from gpuflow.flows.quota.pools import WAIT_TAG_PREFIX, WAITING, every_flow_run, need_of, waiting_runs
from gpuflow.flows.reconcile.dead_runs import found_dead
from gpuflow.flows.reconcile.lapsed import DEFAULT_GRACE_S
from gpuflow.flows.reconcile.overdue import ask_for_a_pass_if_overdue
from gpuflow.flows.reconcile.sources import clusters_of, tracking_uris_or_local

LIVE_STATES = ["RUNNING", "PENDING", "CANCELLING"]
UNCLAIMED = "no serve or worker has picked it up"  # a Scheduled (or Late) run whose time has come
PICKUP_S = 30  # a serve polls every 10 s (PREFECT_RUNNER_POLL_FREQUENCY): a run due for less is not unclaimed yet


@dataclass
class RunStatus:
    flow_run: str
    flow_run_id: str
    state: str
    backend: str | None = None
    cluster: str | None = None
    gpus: str | None = None
    hourly_usd: float | None = None
    spent_usd: float | None = None
    lease: str | None = None  # "alive" or "lapsed", and the age of its last renewal
    queue: str | None = None  # "2 of 3 in aws-h100" while waiting for the quota
    mlflow: str | None = None
    message: str | None = None  # the run's end message, when its webhook did not get it
    triggered_by: str | None = None  # the MLflow user that `gpuflow run --deployment` verified


def add_parser(commands, name: str) -> None:
    command = commands.add_parser(name, help="runs going or waiting now, their clusters and what they cost so far")
    command.add_argument("--json", action="store_true", help="one JSON list, for scripts")


def run(args: argparse.Namespace) -> int:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from gpuflow.flows.local_stack.stack import read_stack

    configured = PREFECT_API_URL.value()  # a team's server: the warm stack's is this machine's alone
    api_url = configured or (read_stack() or {}).get("api_url")
    if not api_url:  # each `gpuflow run` had a temporary API of its own, gone with it
        with clusters_of({"local"}) as found:
            rows = add_clusters([], found)
        if not args.json:
            print("no Prefect server (PREFECT_API_URL) nor warm stack: this machine's clusters only")
    else:
        with temporary_settings({PREFECT_API_URL: api_url}):
            if configured:
                ask_for_a_pass_if_overdue()
            rows = status()
    print(json.dumps([asdict(row) for row in rows], indent=2) if args.json else table(rows))
    return 0


def status(now: float | None = None) -> list[RunStatus]:
    """The live runs (and the ended ones whose message is owed), each with its records; a tracking server that does
    not answer at once is said to be down rather than waited for (MLflow's client retries for minutes)."""
    with at_most_one_try():
        return read_status(now)


def read_status(now: float | None = None) -> list[RunStatus]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    now = now or time.time()
    with get_client(sync_client=True) as client:
        runs = every_flow_run(
            client,
            flow_filter=FlowFilter(name=FlowFilterName(any_=["run-experiment"])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=LIVE_STATES))),
        )
        due = every_flow_run(  # started from the UI or `--deployment`, or scheduled, with nothing to run it
            client,
            flow_filter=FlowFilter(name=FlowFilterName(any_=["run-experiment"])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["SCHEDULED"])),
                expected_start_time=FlowRunFilterExpectedStartTime(before_=datetime.fromtimestamp(now, timezone.utc)),
            ),
        )
        queues = {
            pool: [str(run.id) for run in waiting_runs(pool, client)]
            for pool in {
                tag.removeprefix(WAIT_TAG_PREFIX) for run in runs for tag in run.tags if tag.startswith(WAIT_TAG_PREFIX)
            }
        }
    rows = [row_of(run) for run in runs]
    for row in rows:
        for pool, queue in queues.items():
            if row.flow_run_id in queue and row.state == WAITING:
                row.queue = f"{queue.index(row.flow_run_id) + 1} of {len(queue)} in {pool}"
    add_mlflow_facts(rows, runs, now)
    uris = tracking_uris_or_local()
    with clusters_of({row.backend or "local" for row in rows} | {"local"}) as found:
        rows += add_clusters(rows, found)
        dead = found_dead(found, uris, now)
    for row in rows:
        if row.flow_run_id in dead:
            row.state, row.queue = f"dead, not yet marked Crashed: {dead[row.flow_run_id]}", None
    for run in due:  # how long each has waited, and why
        waited = age_s(now, run.expected_start_time.timestamp())
        why = UNCLAIMED if waited >= PICKUP_S else "not picked up yet"
        rows.append(row_of(run, queue=f"due {clock(waited)} ago: {why}"))
    return rows + add_unsaid(rows, uris, now)


def row_of(run, **more) -> RunStatus:
    """A flow run's row, from what Prefect holds of it."""
    state, backend, who = run.state.name if run.state else "?", tag_value(run, "backend:"), triggered_by(run.tags)
    return RunStatus(run.name, str(run.id), state, backend, gpus=gpus_of(run.parameters), triggered_by=who, **more)


def add_unsaid(rows: list[RunStatus], tracking_uris: list[str], now: float) -> list[RunStatus]:
    """The runs whose end message is not delivered (the reaper's pass tries again): on their row, or a row each."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from gpuflow.flows.run_messages import UNSAID_WITHIN_S

    by_id, added = {row.flow_run_id: row for row in rows}, []
    where = (
        f"tags.`{NOTIFY_FAILED_TAG}` IS NOT NULL AND tags.`{NOTIFIED_TAG}` IS NULL "
        f"AND attributes.end_time > {int((now - UNSAID_WITHIN_S) * 1000)}"
    )
    for uri in tracking_uris:
        try:
            client = MlflowClient(uri)
            experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
            found = client.search_runs(experiments, where, max_results=200) if experiments else []
        except Exception:  # a store down: its live runs already say "unreachable"
            continue
        for run in found:
            flow_run_id = run.data.tags.get(FLOW_RUN_TAG, "-")
            when, _, failure = run.data.tags[NOTIFY_FAILED_TAG].partition(" ")
            row = by_id.get(flow_run_id)
            if row is None:
                added.append(row := RunStatus(run.info.run_name or "-", flow_run_id, run.info.status))
            row.message = f"not delivered ({when}): {failure.removeprefix('notification ')}"
    return added


def tag_value(run, prefix: str) -> str | None:
    return next((tag.removeprefix(prefix) for tag in run.tags if tag.startswith(prefix)), None)


def gpus_of(parameters: dict) -> str | None:
    from gpuflow.cluster.spec import load_spec, parse_spec

    try:
        if parameters.get("spec_file"):
            spec = load_spec(parameters["spec_file"]) if Path(parameters["spec_file"]).is_file() else None
        else:
            spec = parse_spec(parameters["spec"])
    except Exception:  # a spec the run itself refuses
        return None
    return spec and need_of(spec).amount()


def add_mlflow_facts(rows: list[RunStatus], runs, now: float) -> None:
    """Price, spent so far, lease and link, from each run's MLflow run (on its own tracking server)."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    by_uri: dict[str, list[RunStatus]] = {}
    for row, run in zip(rows, runs, strict=True):
        uri = tag_value(run, TRACKING_TAG_PREFIX)
        if uri and (uri.startswith(("http://", "https://")) or Path(uri.removeprefix("sqlite:///")).is_file()):
            by_uri.setdefault(uri, []).append(row)
    for uri, group in by_uri.items():
        try:
            client = MlflowClient(uri)
            experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
            found = (
                {
                    run.data.tags.get(FLOW_RUN_TAG): run
                    for run in client.search_runs(experiments, "attributes.status = 'RUNNING'", max_results=1000)
                }
                if experiments
                else {}
            )
        except Exception as exc:  # one tracking server down: the others are still shown
            for row in group:
                row.mlflow = f"unreachable: {type(exc).__name__}"
            continue
        for row in group:
            mlflow_run = found.get(row.flow_run_id)
            if mlflow_run is None:
                continue
            tags, hourly = mlflow_run.data.tags, mlflow_run.data.metrics.get(HOURLY_METRIC)
            row.hourly_usd = hourly
            started = mlflow_run.info.start_time / 1000
            row.spent_usd = None if hourly is None else round(hourly * age_s(now, started) / 3600, 4)
            if RENEWED_TAG in tags:
                verdict = "lapsed" if stale(tags, now, DEFAULT_GRACE_S) else "alive"  # the state says dead
                row.lease = (
                    f"{verdict}, {renewed(now, float(tags[RENEWED_TAG]))} "
                    f"(grace {float(tags.get(GRACE_TAG, DEFAULT_GRACE_S)):g} s)"
                )
            base = uri if uri.startswith("http") else "http://127.0.0.1:5000"
            row.mlflow = (
                f"{base.rstrip('/')}/#/experiments/{mlflow_run.info.experiment_id}/runs/{mlflow_run.info.run_id}"
            )


def renewed(now: float, at: float) -> str:
    """The renewal's age; `at` is the flow's clock, which may run ahead of this machine's."""
    ahead = at - now
    return f"renewed {age_s(now, at):.0f} s ago" + (
        f" (its clock {ahead:.0f} s ahead of this one)" if ahead >= 1 else ""
    )


def add_clusters(rows: list[RunStatus], found) -> list[RunStatus]:
    """Each cluster of ours goes on its run's row; one whose run is not going gets a row of its own."""
    by_id = {row.flow_run_id.replace("-", ""): row for row in rows}
    orphans = []
    for backend, cluster in found:
        run_id = flow_run_id_of(cluster.name)
        if not run_id:
            continue
        row = by_id.get(run_id.replace("-", ""))
        if row is None:
            orphans.append(row := RunStatus("(none)", run_id, "over or gone: the reaper downs it", backend.name))
        row.cluster = f"{cluster.name} ({cluster.status})"
    return orphans


SHORT_ID = 8  # of the flow run's id: what `prefect flow-run inspect` and the Prefect UI's address start with


def table(rows: list[RunStatus]) -> str:
    if not rows:
        return "nothing running or waiting"
    columns = [
        ("run", lambda r: r.flow_run),
        ("id", lambda r: r.flow_run_id[:SHORT_ID]),  # two runs of one spec started in the same second differ here
        ("state", lambda r: r.state),
        ("by", lambda r: r.triggered_by or "-"),
        ("cluster", lambda r: r.cluster or "-"),
        ("GPUs", lambda r: r.gpus or "-"),
        ("$/h", lambda r: money(r.hourly_usd)),
        ("spent", lambda r: money(r.spent_usd)),
        ("lease", lambda r: r.lease or "-"),
        ("queue", lambda r: r.queue or "-"),
        ("MLflow", lambda r: r.mlflow or "-"),
        ("message", lambda r: r.message or "-"),
    ]
    cells = [[name for name, _ in columns]] + [[value(row) for _, value in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in cells
    )


def money(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"
