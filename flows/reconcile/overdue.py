"""A reaper pass asked for by whoever talks to a team's Prefect server, when none ran within the reaper's schedule.

    ask_for_a_pass_if_overdue()      # `gpuflow run`, `status` and `quota list` call it; a serve runs one as it starts

The scheduled pass runs only while some `gpuflow serve` (or a worker of the reaper's pool) is up: with the team's
only serve killed, a dead run would keep its records (flow run Running, MLflow run RUNNING, its quota slot) until
someone ran a pass by hand. So the next gpuflow command against that server starts one in the background, in a
process of its own, when the last pass is older than the schedule's interval. One asker at a time decides (a
one-slot limit that decays, never released: for DECIDE_S no other asker starts a second pass, and by then the
pass's own flow run says a pass is recent); the pass itself is the reaper flow, as scheduled.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

from gpuflow.cluster.config import overdue_pass_mode, state_dir
from gpuflow.flows.deployments import REAPER

log = logging.getLogger(__name__)

DEFAULT_EVERY_S = 600.0  # prefect.yaml's schedule of reap-clusters, where the server has no such deployment
DECIDE = "gpuflow-reaper-ask"
DECIDE_S = 120.0  # longer than a pass takes to start and record its flow run


def ask_for_a_pass_if_overdue() -> str | None:
    """Starts a reaper pass in the background when the Prefect server this process uses (a team's: PREFECT_API_URL
    set) has none within the reaper's interval; returns the pass's log file, or None. Never fails its caller."""
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    if not api_url or overdue_pass_mode() == "never":  # a run on its own temporary API: no team's records to keep
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            if not overdue(client, datetime.now(timezone.utc)) or not decided_here(client):
                return None
        return start_pass(api_url)
    except Exception as exc:
        log.warning(f"could not ask for a reaper pass: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def overdue(client, now: datetime) -> bool:
    """Whether the last reaper pass on this server started longer ago than its schedule's interval (or never). Only a
    pass that started counts: the server compares coalesce(start_time, expected_start_time), so without is_null_ the
    schedule's next runs, made ahead and left Scheduled when every serve is killed, would count as recent."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    since = now - timedelta(seconds=interval_s(client))
    recent = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[REAPER])),
        flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since, is_null_=False)),
        sort=FlowRunSort.START_TIME_DESC,
        limit=1,
    )
    return not recent


def interval_s(client) -> float:
    """The reaper deployment's schedule on this server (what a serve registered), else prefect.yaml's."""
    try:
        deployment = client.read_deployment_by_name(f"{REAPER}/{REAPER}")
        return float(deployment.schedules[0].schedule.interval.total_seconds())
    except Exception:  # not deployed here, or not on an interval
        return DEFAULT_EVERY_S


def decided_here(client) -> bool:
    """Takes the one-slot limit that lets one asker start the pass, left to decay; False when another asker has it."""
    from gpuflow.flows.reconcile.turns import take_a_turn

    return take_a_turn(client, DECIDE, DECIDE_S)


def start_pass(api_url: str) -> str:
    """`python -m gpuflow.flows.reaper` against `api_url`, detached (it outlives a command that ends first)."""
    logs = state_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / f"reaper-pass-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{os.getpid()}.log"
    with open(log_file, "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "gpuflow.flows.reaper"],
            env={**os.environ, "PREFECT_API_URL": api_url},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"gpuflow: no reaper pass on this server within its schedule: one runs now (log: {log_file})", flush=True)
    return str(log_file)
