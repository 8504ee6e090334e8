"""What a test left running, and waiting for a condition."""

import os
import time
from pathlib import Path


def alive(pids) -> list[int]:
    """The pids that are still running (zombies count as gone: they hold no resources)."""
    from gpuflow.cluster.util.processes import alive as running

    return [pid for pid in pids if running(pid)]


def processes_of(home: Path) -> list[int]:
    """Live processes started for one gpuflow home: Ray's daemons and workers and the job inherit GPUFLOW_HOME."""
    from tests.support.tiers import carrying, describe

    found = carrying("GPUFLOW_HOME", str(home), {os.getpid()})
    for process in found:
        print(describe(process))  # say what is left, for the failure message
    return [process.pid for process in found]


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.5):
    """`condition()`'s first true value, polled every `interval_s`; fails saying `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
