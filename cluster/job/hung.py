"""A hung job: no `ray.train.report` for too long (a deadlocked collective, a stuck data reader) stops the run as
`stopped_by=hung`, before it bills until limits.max_runtime_minutes.

The guard reads the run once per poll for its lease; the same read tells when the loop last reported (the newest
timestamp of the metrics it logs), on whichever node the loop runs. The watch starts at the loop's first report: a
start-up (setup, data, compiling) takes what it takes, and limits.max_runtime_minutes bounds a loop that never
reports. The limit is limits.hung_minutes when set; else it is derived from the run's own pace once two reports are
seen: DERIVED_FACTOR times the longest gap seen between reports, and never under DERIVED_FLOOR_S (start-up, a first
compile or a validation pass are slower)."""

from __future__ import annotations

import time

from gpuflow.cluster.protocol import HOURLY_METRIC, PHASE_METRIC_PREFIX

DERIVED_FACTOR = 5
DERIVED_FLOOR_S = 600
NOT_THE_LOOPS = ("system/", PHASE_METRIC_PREFIX)  # MLflow's system metrics and the flow's own figures


def last_report_ms(run) -> int | None:
    """When the loop last reported, by the run's metrics (their report timestamps, in ms), or None before any."""
    stamps = [
        metric.timestamp
        for metric in run.data._metric_objs
        if metric.key != HOURLY_METRIC and not metric.key.startswith(NOT_THE_LOOPS)
    ]
    return max(stamps, default=None)


class HungWatch:
    """A guard check: fires when the loop has not reported for the limit. `read_run` gives the guard's latest read
    of the MLflow run (None when it could not read: no judgement then)."""

    def __init__(self, read_run, hung_minutes: float | None, clock=time.time):
        self.read_run, self.limit_s, self.clock = read_run, hung_minutes and hung_minutes * 60, clock
        self.last_s = 0.0  # when the loop last reported (epoch seconds)
        self.reports_seen, self.longest_gap_s = 0, 0.0

    def limit(self) -> float | None:
        if self.limit_s:
            return self.limit_s if self.reports_seen else None
        return max(DERIVED_FLOOR_S, DERIVED_FACTOR * self.longest_gap_s) if self.reports_seen >= 2 else None

    def check(self):
        run = self.read_run()
        reported_ms = last_report_ms(run) if run else None
        if reported_ms and reported_ms / 1000 > self.last_s:
            if self.reports_seen:
                self.longest_gap_s = max(self.longest_gap_s, reported_ms / 1000 - self.last_s)
            self.last_s, self.reports_seen = reported_ms / 1000, self.reports_seen + 1
        limit_s = self.limit()
        silent_s = self.clock() - self.last_s
        if run is None or limit_s is None or silent_s < limit_s:
            return None
        how = (
            "limits.hung_minutes"
            if self.limit_s
            else f"{DERIVED_FACTOR}x the longest gap between its reports; set limits.hung_minutes to choose"
        )
        return "hung", (
            f"stopped: the loop has not reported for {silent_s / 60:.1f} min ({how}: "
            f"{limit_s / 60:.3g} min); each worker's stack is in the run's artifacts, hung/stacks.txt"
        )
