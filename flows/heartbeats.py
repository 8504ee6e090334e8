"""A flow run's Prefect heartbeats (prefect.flow-run.heartbeat, every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds
while its process lives): the facts cluster/run/liveness.py judges a run by where no lease of ours can say.

    used by the reaper's pass (flows/reconcile/dead_runs.py) and the warm stack's idle clock (flows/local_stack/)
"""

from __future__ import annotations

from datetime import datetime, timezone


def last_heartbeat(client, flow_run_id: str | None) -> float | None:
    """When the flow run's last Prefect heartbeat (prefect.flow-run.heartbeat) was sent, in the last day; None: none
    was kept. flow_run_id None: any flow run's."""
    from datetime import timedelta

    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    since = datetime.now(timezone.utc) - timedelta(days=1)
    page = client.read_events(
        EventFilter(
            occurred=EventOccurredFilter(since=since),
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]) if flow_run_id else None,
        ),
        limit=1,
    )
    return max((event.occurred.timestamp() for event in page.events), default=None)
