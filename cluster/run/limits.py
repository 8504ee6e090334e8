"""The run's limits as stop checks, and the watchdog thread that polls them: one code for the flow and the cluster.

A check returns None, or (reason, detail) once its limit is reached: reason is what MLflow's `stopped_by` tag says.
The flow enforces them while it lives; the job on the cluster enforces them too, so a job whose flow is gone
still cannot run past `limits.max_runtime_minutes` or `limits.max_cost_usd`.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable

Check = Callable[[], "tuple[str, str] | None"]


def deadline_check(max_runtime_minutes: float, started: float | Callable[[], float | None]) -> Check:
    """Fires when max_runtime_minutes have passed since `started` (the job's start; a callable: None until then)."""
    limit_s = max_runtime_minutes * 60
    started_at = started if callable(started) else lambda: started

    def check():
        start = started_at()
        if start is None:
            return None
        elapsed = time.time() - start
        if elapsed >= limit_s:
            return "timeout", (
                f"stopped by timeout: the job ran {elapsed / 60:.1f} min, "
                f"limits.max_runtime_minutes is {max_runtime_minutes:g}"
            )
        return None

    return check


def cost_check(max_cost_usd: float | None, hourly_usd: Callable[[], float], requested_at: float) -> Check:
    """Fires when the cluster's bill since `requested_at` (the provision request) reaches max_cost_usd.

    `hourly_usd` is read at each poll: the price changes once the cluster has launched and its real price is known."""

    def check():
        rate = hourly_usd()
        if max_cost_usd is None or rate <= 0:
            return None
        spent = rate * (time.time() - requested_at) / 3600
        if spent >= max_cost_usd:
            return "budget", f"stopped by budget: ${spent:.2f} spent of max_cost_usd={max_cost_usd:.2f} (${rate:.4g}/h)"
        return None

    return check


class Watchdog(threading.Thread):
    """Polls stop checks; the first that fires is handed to `stop(reason, detail)`, once, and the watch ends.
    It runs in the context of the thread that made it: what it logs belongs to that thread's run."""

    def __init__(
        self,
        checks: list[Check],
        stop: Callable[[str, str], object],
        interval_s: float = 1.0,
        name: str = "gpuflow-watchdog",
    ):
        super().__init__(daemon=True, name=name)
        self.checks, self.stop, self.interval_s = list(checks), stop, interval_s
        self._done = threading.Event()
        self._context = contextvars.copy_context()

    def run(self) -> None:
        self._context.run(self._watch)

    def _watch(self) -> None:
        while self.checks and not self._done.wait(self.interval_s):
            for check in self.checks:
                verdict = check()
                if verdict:
                    self.stop(*verdict)
                    return

    def finish(self) -> None:
        self._done.set()

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
