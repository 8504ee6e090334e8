"""The train task's progress bar in the Prefect UI, kept off the job's log stream.

Each update is a call to Prefect's API. Made from the thread that reads the job's log, a Prefect server that is down
or restarting would stall that thread for its client's retries (over a minute), and an update that fails at last
would end the training it only reports on. So the bar is drawn by a thread of its own, with the latest value only,
and a bar that cannot be drawn is skipped: training goes on without it.
"""

from __future__ import annotations

import contextvars
import threading

from prefect.artifacts import create_progress_artifact, update_progress_artifact

TELEMETRY_PREFIX = "perf/"  # the step timer's figures (cluster/telemetry.py): in each epoch's line and the summary


def metrics_line(metrics: dict, telemetry: bool = True) -> str:
    """Metrics as a person reads them, `val_accuracy=0.975 epoch=9`; without the telemetry figures on request."""
    return " ".join(f"{key}={value:.4g}" if isinstance(value, (int, float)) else f"{key}={value}"
                    for key, value in metrics.items() if telemetry or not key.startswith(TELEMETRY_PREFIX))


class ProgressBar:
    def __init__(self, description: str, logger):
        self.logger = logger
        self._percent: float | None = None
        self._changed = threading.Event()
        self._closed = False
        context = contextvars.copy_context()  # the task run's: the bar belongs to it
        self._thread = threading.Thread(target=context.run, args=(self._draw, description), daemon=True,
                                        name="gpuflow-progress")
        self._thread.start()

    def set(self, percent: float) -> None:
        self._percent = percent
        self._changed.set()

    def close(self, wait_s: float = 5.0) -> None:
        """Stops drawing once the last value set is drawn, waiting for that at most `wait_s`."""
        self._closed = True
        self._changed.set()
        self._thread.join(timeout=wait_s)

    def _draw(self, description: str) -> None:
        try:
            artifact_id, drawn = create_progress_artifact(0.0, description=description), 0.0
            while True:
                self._changed.wait()
                self._changed.clear()
                if self._percent is not None and self._percent != drawn:
                    drawn = self._percent
                    update_progress_artifact(artifact_id, drawn)
                if self._closed:
                    return
        except Exception as exc:  # Prefect's API is gone or refuses: the run goes on, its bar does not
            self.logger.warning(f"progress bar in Prefect stopped: {type(exc).__name__}: {exc}")
