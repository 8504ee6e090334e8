"""The one poll loop: ask until an answer comes or the time is up."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, interval_s: float = 0.1) -> T:
    """Asks `condition` every `interval_s` until it answers something true, or `timeout_s` has passed; returns its
    last answer (false on a timeout: the caller says what did not happen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = condition()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(interval_s)
