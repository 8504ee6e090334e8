"""Imports in a background thread: modules a process needs in a moment, loaded while it waits on something else
(a subprocess, a server's start, a connection). Torch, Ray Train, MLflow's stores and SkyPilot each take seconds."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from functools import partial, wraps

WAIT_S = 120.0  # an import stuck longer (a hung filesystem) must not hold back what waits on it: a run's stop
_started: set[tuple[str, ...]] = set()
_threads: list[threading.Thread] = []


def import_in_background(*modules: str, then: Callable[[], object] | None = None) -> None:
    """Starts importing `modules`, in order, then calling `then` (a first use that warms what they load), unless this
    process already started the same modules; a module that fails to import, or a `then` that fails, is left for its
    user to meet again, where the error is raised and reported. Not a daemon: an import is never cut off at
    interpreter exit."""
    if modules in _started:
        return
    _started.add(modules)

    def load():
        steps = [partial(importlib.import_module, module) for module in modules] + ([then] if then else [])
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - see above
                pass

    thread = threading.Thread(target=load, name="gpuflow-preload")
    _threads.append(thread)
    thread.start()


def finish_background_imports(timeout_s: float | None = None) -> None:
    """Waits for this process's background imports (each at most `timeout_s`). A thread that imports a package the
    preload may be loading must call this first: two threads importing modules that import each other (Ray Train's
    and Ray Tune's do) can each meet the other's half-initialized module, and Python then raises ImportError (or
    _DeadlockError) instead of deadlocking."""
    for thread in list(_threads):
        thread.join(timeout_s)


def after_background_imports(function: Callable) -> Callable:
    """`function`, made to wait for this process's background imports before it runs: for a function that imports
    what the preload may be loading (MLflow, Ray), from any thread. Declared where the function is, so that no caller
    has to remember `finish_background_imports`."""

    @wraps(function)
    def waiting(*args, **kwargs):
        if threading.current_thread() not in _threads:
            finish_background_imports(WAIT_S)
        return function(*args, **kwargs)

    return waiting
