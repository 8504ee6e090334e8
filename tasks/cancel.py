"""Notices a cancel from the Prefect UI for runs that Prefect itself will not interrupt (started by `gpuflow run`)."""

from __future__ import annotations

import threading
from typing import Callable

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType

CANCEL_STATES = (StateType.CANCELLING, StateType.CANCELLED)


class CancelWatcher(threading.Thread):
    """Polls the flow run's state while in its `with` block; on a cancel it calls `on_cancel` once."""

    def __init__(self, flow_run_id, on_cancel: Callable[[], object], interval_s: float = 2.0):
        super().__init__(daemon=True, name="gpuflow-cancel-watcher")
        self.flow_run_id, self.on_cancel, self.interval_s = flow_run_id, on_cancel, interval_s
        self._done = threading.Event()

    def run(self) -> None:
        with get_client(sync_client=True) as client:
            while not self._done.wait(self.interval_s):
                try:
                    state = client.read_flow_run(self.flow_run_id).state
                except Exception:  # the API blinked: look again next time
                    continue
                if state and state.type in CANCEL_STATES:
                    self.on_cancel()
                    return

    def finish(self) -> None:
        self._done.set()

    def __enter__(self) -> CancelWatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
