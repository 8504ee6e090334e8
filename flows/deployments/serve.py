"""Serves gpuflow's deployments (prefect.yaml) from this machine: no work pool, no worker; Ctrl-C stops it.

    gpuflow serve                                  # run-experiment, nightly-digits and reap-clusters
    gpuflow serve --only run-experiment --set tracking.uri=http://127.0.0.1:5000 --limit 1

Several machines may serve the same deployments (each polls the server for their runs), if they serve the same
thing: each serve registers them anew, and the last one's entrypoint and default spec would be every serve's, so a
serve of another project (or of other `--set`s) is refused while another serve polls them. Stopping one pauses only
the deployments no other serve still polls: a schedule keeps firing while anyone serves it, and one that nobody
serves is paused rather than left to pile up late runs that would all start at once when a serve comes back.
"""

from __future__ import annotations

import json
import os
import time

from prefect import serve as prefect_serve

from gpuflow.cluster.protocol import SERVE_OVERRIDES_ENV
from gpuflow.flows.deployments import REAPER
from gpuflow.flows.deployments.deploy import runner_deployments

SETTLE_S = 3.0  # for this serve's own last poll to reach the server's record


def serve(overrides: list[str] = (), only: list[str] = (), limit: int | None = 1) -> None:
    """Blocks, polling the Prefect server (PREFECT_API_URL) for runs of these deployments, scheduled or from the UI."""
    deployments = runner_deployments(overrides, only)
    refuse_a_takeover(deployments)
    # The runs this process starts inherit it: a form_policy compares a run with the spec as served here.
    os.environ[SERVE_OVERRIDES_ENV] = json.dumps(list(overrides))
    reap_on_start(deployments)
    # limit=1 by default: two experiments at once would fight over the same machine's CPUs.
    try:
        prefect_serve(*deployments, limit=limit, pause_on_shutdown=False)
    finally:
        pause_unless_served_elsewhere([f"{d.flow_name}/{d.name}" for d in deployments])


class ServedElsewhere(RuntimeError):
    """A deployment another serve polls now, with another entrypoint or default spec than this serve's."""


def refuse_a_takeover(deployments: list) -> None:
    """Raises ServedElsewhere, naming what differs, for a deployment that another serve polls with other code or
    another default spec: registered again from here, its runs would start from this serve's files and spec on every
    serve, where that serve's may not exist."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from gpuflow.cluster.spec.form_policy import differences
    from gpuflow.flows.deployments.trigger import not_served

    with get_client(sync_client=True) as client:
        for ours in deployments:
            name = f"{ours.flow_name}/{ours.name}"
            try:
                theirs = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            differs = []
            if ours.entrypoint != theirs.entrypoint:
                differs.append(f"its entrypoint is {theirs.entrypoint!r}, this serve's {ours.entrypoint!r}")
            if fields := differences(theirs.parameters, ours.parameters):
                differs.append(f"its default parameters differ in {', '.join(fields)}")
            if differs and not_served(theirs) is None:
                raise ServedElsewhere(
                    f"deployment {name} is served now by another serve, from another setup: {'; '.join(differs)}. "
                    "Serve it from the same project and --set's, or stop that serve first (a killed one reads as "
                    "serving for a minute after its last poll)"
                )


def reap_on_start(deployments: list) -> str | None:
    """Registers the reaper (when served here) and asks for one pass now, which this serve runs first: what the last
    serve on this machine left behind is reconciled at once, not at the next interval. Returns the flow run's id."""
    from prefect.client.orchestration import get_client

    from gpuflow.flows.deployments.known_servers import forgetful_server

    with get_client(sync_client=True) as client:
        if warning := forgetful_server(client):
            print(f"gpuflow serve: warning: {warning}", flush=True)
    reaper = next((d for d in deployments if d.name == REAPER), None)
    if reaper is None:
        return None
    deployment_id = reaper.apply()  # prefect_serve registers it again: same schedule, the run made here is kept
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment_id, tags=["serve-start"])
    print(f"gpuflow serve: a reaper pass first ({flow_run.name})", flush=True)
    return str(flow_run.id)


def pause_unless_served_elsewhere(names: list[str]) -> list[str]:
    """Pauses the deployments whose last poll does not move within two poll intervals; returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_RUNNER_POLL_FREQUENCY

    wait_s = 2 * PREFECT_RUNNER_POLL_FREQUENCY.value() + SETTLE_S
    print(
        f"gpuflow serve: stopped; pausing the schedules no other serve polls (checking for {wait_s:.0f} s)", flush=True
    )
    with get_client(sync_client=True) as client:
        time.sleep(SETTLE_S)
        before = {name: client.read_deployment_by_name(name).last_polled for name in names}
        time.sleep(wait_s - SETTLE_S)
        paused = []
        for name in names:
            deployment = client.read_deployment_by_name(name)
            if deployment.last_polled == before[name]:
                client.pause_deployment(deployment.id)
                paused.append(name)
    served = sorted(set(names) - set(paused))
    print(
        f"gpuflow serve: paused {', '.join(paused) or 'none'}"
        + (f"; still served elsewhere: {', '.join(served)}" if served else ""),
        flush=True,
    )
    return paused


if __name__ == "__main__":
    serve()
