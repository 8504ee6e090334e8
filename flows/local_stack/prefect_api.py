"""Which Prefect API a command talks to: a configured server, the warm stack's, or a temporary one started now."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuflow.flows.local_stack.temporary_api import TemporaryApi


def temporary_api_launched() -> TemporaryApi | None:
    """Prefect's temporary API, launched now when no Prefect server is configured: its seconds of start-up overlap
    this process's imports and checks, Prefect's own first where its settings allow. The warm stack's API instead,
    when one is up (`gpuflow up`); None when a server is configured."""
    from gpuflow.flows.local_stack import stack, temporary_api  # gpuflow's own: no Prefect loaded yet

    record = None if os.environ.get("PREFECT_API_URL") else stack.read_stack()
    stack_api = record["api_url"] if record and record.get("api_url") else None
    if stack_api and not temporary_api.answers(stack_api, timeout_s=2):
        stack_api = None
    early = None if stack_api or os.environ.get("PREFECT_API_URL") else temporary_api.launch_before_prefect()
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED

    configured = PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value()
    if early and (configured or early.home.resolve() != PREFECT_HOME.value().resolve()):  # a setting said otherwise
        early.stop()
        early = None
    if configured:
        return None
    if stack_api:
        temporary_api.use(stack_api)
        return None
    return early or temporary_api.launch()


def prefect_api_answers(timeout_s: float = 5) -> bool:
    """Whether the API this process uses still answers (True where none is configured: nothing to lose)."""
    from prefect.settings import PREFECT_API_URL

    from gpuflow.flows.local_stack import temporary_api

    return temporary_api.answers(PREFECT_API_URL.value(), timeout_s) if PREFECT_API_URL.value() else True


def prefect_api_up() -> bool:
    """Whether a Prefect API that runs here use answers now, started by no one for this call: a configured server,
    or the warm stack's (which this process then uses, as a run would)."""
    from prefect.settings import PREFECT_API_URL

    from gpuflow.flows.local_stack import stack, temporary_api

    if PREFECT_API_URL.value():
        return prefect_api_answers(timeout_s=2)
    record = stack.read_stack()
    if not (record and record.get("api_url") and temporary_api.answers(record["api_url"], timeout_s=2)):
        return False
    temporary_api.use(record["api_url"])
    return True


def stop_retrying_if_gone() -> None:
    """For a run being stopped (a signal, Ctrl-C) whose Prefect API no longer answers: its last calls to it (its
    Crashed state, its logs) fail at once, instead of retrying for a minute or more each (PREFECT_CLIENT_MAX_RETRIES)
    with its cluster down already. The reaper's pass records the run's end once an API answers."""
    from gpuflow.flows.prefect_internals import refresh_settings

    if not prefect_api_answers(timeout_s=1):
        os.environ["PREFECT_CLIENT_MAX_RETRIES"] = "0"
        refresh_settings()
