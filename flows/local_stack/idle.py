"""When the warm stack has been idle its time: no run on this machine's clusters, and none on its API since.

A run waiting in the quota's queue, or training on another backend (SkyPilot), uses the stack's API though no local
cluster of it is up. Once the stack has gone its idle time without a local run, it asks its API when a run last used
it (now, for one that lives): the idle time counts from there, so the stack outlives the last run by its idle time
whenever that run ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class IdleClock:
    def __init__(self, idle_s: float, now: float):
        self.idle_s = idle_s
        self.last_busy = now

    def busy(self, now: float) -> None:
        """A local run goes (or the spare just came up: idle from when it is ready, not while it starts)."""
        self.last_busy = now

    def idle_out(self, now: float, since_api_used: Callable[[], float | None]) -> bool:
        """Whether the stack should stop now; asks its API only once idle that long by the local runs."""
        if now - self.last_busy <= self.idle_s:
            return False
        since = since_api_used()
        if since is not None:
            self.last_busy = max(self.last_busy, now - since)
        return now - self.last_busy > self.idle_s


def since_api_used(api_url: str) -> float | None:
    """Seconds since a flow run on this API was last live: 0 while one lives, judged as the reaper judges a run with
    no lease of ours (by the Prefect heartbeats its process sends or, before its first, by its state's age:
    cluster/run/liveness.py); else since the last one ended or fell silent. None: no run, or an API that does not
    answer (in use by none)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas import filters
    from prefect.client.schemas.sorting import FlowRunSort

    from gpuflow.cluster.run.liveness import age_s, beating, silent_for
    from gpuflow.flows.heartbeats import last_heartbeat

    def runs_in(states: list[str], **sort) -> list:
        state = filters.FlowRunFilterState(type=filters.FlowRunFilterStateType(any_=states))
        return client.read_flow_runs(flow_run_filter=filters.FlowRunFilter(state=state), limit=20, **sort)

    try:
        with SyncPrefectClient(api_url) as client:
            silences = []
            for run in runs_in(["PENDING", "RUNNING", "CANCELLING", "PAUSED"]):
                now, beat = time.time(), last_heartbeat(client, str(run.id))
                state_age = age_s(now, run.state.timestamp.timestamp()) if run.state else 0.0
                silences.append(silent_for(state_age, None if beat is None else age_s(now, beat)))
            ended = runs_in(["COMPLETED", "FAILED", "CANCELLED", "CRASHED"], sort=FlowRunSort.END_TIME_DESC)[:1]
    except Exception as exc:
        print(f"cannot read the runs on this API ({type(exc).__name__}: {str(exc)[:300]}): none count", flush=True)
        return None
    if any(beating(silence) for silence in silences):
        return 0.0
    silences += [age_s(time.time(), run.end_time.timestamp()) for run in ended if run.end_time]
    return min(silences, default=None)
