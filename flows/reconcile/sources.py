"""Where a pass looks: the backends usable on this machine, and the tracking stores the runs name."""

from __future__ import annotations

import contextlib
import logging

from gpuflow.cluster.backends import Backend
from gpuflow.cluster.config import default_tracking_uri
from gpuflow.cluster.util.local_store import store_exists
from gpuflow.flows.deployments.known_servers import known_tracking_uris

log = logging.getLogger(__name__)


def available_backends(names: list[str]) -> list[Backend]:
    """The backends that can be used here; one that cannot (SkyPilot not set up) is skipped with a log line."""
    from gpuflow.cluster.backends import get_backend

    backends = []
    for name in names:
        try:
            backends.append(get_backend(name))
        except Exception as exc:  # an import error, missing credentials: skip, never stop the whole pass
            log.warning(f"reaper: skipping the {name} backend: {type(exc).__name__}: {exc}")
    return backends


def tracking_uris_or_local() -> list[str]:
    """Every tracking server the deployments and recent runs name, and this machine's store if it has one: a store
    that does not exist holds no run, and opening it would make one (in a team's serve folder, say)."""
    local = default_tracking_uri()
    try:
        uris = known_tracking_uris(local)
    except Exception as exc:  # the Prefect API down: this machine's store can still be reaped
        log.warning(f"reaper: cannot list the runs' tracking servers: {type(exc).__name__}: {str(exc)[:300]}")
        uris = [local]
    return [uri for uri in uris if store_exists(uri)]


@contextlib.contextmanager
def clusters_of(names: set[str]):
    """Every cluster the named backends usable here list, as (backend, its status); the backends closed afterwards."""
    from gpuflow.flows.reconcile.records import listed

    usable = available_backends(sorted(names))
    try:
        yield listed(usable)
    finally:
        for backend in usable:
            getattr(backend, "close", lambda: None)()
