"""Imports in a background thread: modules a process needs in a moment, loaded while it waits on something else
(a subprocess, a server's start, a connection). Torch, Ray Train, MLflow's stores and SkyPilot each take seconds."""

from __future__ import annotations

import importlib
import threading


_started: set[tuple[str, ...]] = set()


def import_in_background(*modules: str) -> None:
    """Starts importing `modules`, in order, unless this process already started the same; a module that fails to
    import is left for its user to import again, where the error is raised and reported. Not a daemon: an import is
    never cut off at interpreter exit."""
    if modules in _started:
        return
    _started.add(modules)

    def load():
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 - see above
                pass

    threading.Thread(target=load, name="gpuflow-preload").start()
