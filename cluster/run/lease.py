"""The dead man's switch: the flow renews a lease on its MLflow run while it lives; the job and the reaper read it.

The MLflow run is the one place the flow, the job on any cluster and the reaper all reach. The flow writes
`gpuflow.lease_renewed_at` (its clock, seconds) every few seconds; the job judges the lease by its own clock
(the value has not changed for a whole grace period of successful reads), so clock skew between machines
does not matter and a tracking server that is down for a while does not count as a dead flow.
"""

from __future__ import annotations

import threading
import time

from gpuflow.cluster.protocol import GRACE_TAG, RENEWED_TAG


def renew_interval_s(grace_s: float) -> float:
    """Four renewals per grace period, at most one every 30 s."""
    return max(0.5, min(30.0, grace_s / 4))


def lease_tags(grace_s: float, now: float | None = None) -> dict[str, str]:
    """The lease as the run's tags: its grace period and a renewal now. Logged with the run's other tags when it
    opens (one call), so that the keeper's first renewal waits a whole interval."""
    return {GRACE_TAG: f"{grace_s:g}", RENEWED_TAG: f"{time.time() if now is None else now:.3f}"}


class LeaseKeeper(threading.Thread):
    """The flow's side: renews the lease until `finish()` (a failed renewal is retried at the next tick).

    `taken`: the lease tags (`lease_tags`) are already in the run; else the keeper writes them first."""

    def __init__(self, client, run_id: str, grace_s: float, taken: bool = False):
        super().__init__(daemon=True, name="gpuflow-lease")
        self.client, self.run_id, self.grace_s, self.taken = client, run_id, grace_s, taken
        self._done = threading.Event()

    def renew(self) -> bool:
        try:
            self.client.set_tag(self.run_id, RENEWED_TAG, f"{time.time():.3f}")
            return True
        except Exception:  # the tracking server blinked: the grace period covers a few missed renewals
            return False

    def take(self) -> bool:
        """Writes the grace period and a first renewal, in one call."""
        from mlflow.entities import RunTag

        try:
            self.client.log_batch(
                self.run_id, tags=[RunTag(k, v) for k, v in lease_tags(self.grace_s).items()], synchronous=True
            )
            return True
        except Exception:
            return False

    def run(self) -> None:
        self.taken = self.taken or self.take()
        while not self._done.wait(renew_interval_s(self.grace_s)):
            self.taken = self.renew() if self.taken else self.take()

    def finish(self) -> None:
        self._done.set()


class LeaseWatch:
    """The job's side: `expired()` is True once the lease value stayed the same over a whole grace period
    of successful reads, measured on this machine's clock. A read that failed, or that took a quarter of the grace
    (MLflow's client retries a server that is down for minutes), starts the window again: the flow's renewals could
    not get through either, so the time the tracking server was away does not count against the flow."""

    def __init__(self, client, run_id: str, grace_s: float, clock=time.monotonic):
        self.client, self.run_id, self.grace_s, self.clock = client, run_id, grace_s, clock
        self.value: str | None = None
        self.unchanged_since = clock()
        self.reads_failed = False
        self.run = None  # the latest read of the run: the hung check reads it too (one call per poll)

    def expired(self) -> bool:
        asked = self.clock()
        try:
            self.run = self.client.get_run(self.run_id)
            value = self.run.data.tags.get(RENEWED_TAG)
        except Exception:  # cannot judge without reading: restart the window once reads work again
            self.run, self.reads_failed = None, True
            return False
        now = self.clock()
        if value != self.value or self.reads_failed or now - asked >= self.grace_s / 4:
            self.value, self.unchanged_since, self.reads_failed = value, now, False
            return False
        return now - self.unchanged_since >= self.grace_s

    def check(self):
        """As a watchdog check (cluster/run/limits.py)."""
        if self.expired():
            return "orphaned", (
                f"stopped: the flow stopped renewing its lease for {self.grace_s:g} s "
                "(flow process killed, frozen or cut off); limits.orphan_grace_minutes"
            )
        return None


def stale(tags: dict[str, str], now: float, default_grace_s: float) -> bool | None:
    """The reaper's reading of a lease from the run's tags (writer's clock): None when the run has no lease."""
    renewed = tags.get(RENEWED_TAG)
    if renewed is None:
        return None
    grace_s = float(tags.get(GRACE_TAG, default_grace_s))
    return now - float(renewed) > grace_s
