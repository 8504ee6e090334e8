"""Notices a cancel from the Prefect UI for runs that Prefect itself will not interrupt (started by `gpuflow run`).

A watchdog check (cluster/run/limits.py): the flow's Watchdog polls it and hands the verdict to the run's lifecycle.
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType

from gpuflow.cluster.run.limits import Check

CANCEL_STATES = (StateType.CANCELLING, StateType.CANCELLED)
CANCEL_POLL_S = 2.0


def cancel_check(flow_run_id) -> Check:
    """Fires once the flow run is Cancelling or Cancelled.

    One client serves every poll: each new one loads the system's TLS certificates, even for a plain-HTTP API, and
    the run polls every 2 s."""
    client = None

    def check():
        nonlocal client
        try:
            if client is None:
                client = get_client(sync_client=True).__enter__()
            state = client.read_flow_run(flow_run_id).state
        except Exception:  # the API blinked: look again next time, with a new client
            close_quietly(client)
            client = None
            return None
        if state and state.type in CANCEL_STATES:
            return "cancelled", "cancelled from Prefect"
        return None

    return check


def close_quietly(client) -> None:
    """Closes a client whose API may be gone."""
    if client is not None:
        try:
            client.__exit__(None, None, None)
        except Exception:
            pass
