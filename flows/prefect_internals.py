"""Prefect's private and internal APIs that gpuflow uses, all here: read against Prefect 3.8 (pyproject: >=3.8,<3.9).

None of them is in Prefect's documented API; each is here because that Prefect has no public way to do it. On a
Prefect upgrade, check these first.

    start_api_server        how Prefect 3.8 starts its temporary ("ephemeral") API server in a process of its own:
                            uvicorn of the server's app factory `prefect.server.api.server:create_app` (server
                            internals), from the folder Prefect is installed in, with its private
                            settings PREFECT__SERVER_EPHEMERAL and PREFECT__SERVER_FINAL. gpuflow starts it itself so
                            that `gpuflow run` does not import Prefect's server package
                            (flows/local_stack/temporary_api.py).
    refresh_settings        prefect.context.refresh_global_settings_context: Prefect reads its settings once into a
                            module global; after PREFECT_API_URL changes in os.environ, this makes every thread's
                            client use the new server (flows/local_stack/temporary_api.py).
    ensure_logging_setup    prefect.logging.configuration.ensure_logging_setup: Prefect configures its logging (its
                            console handler) on first use; `gpuflow run` needs that handler now, to put its filter on
                            it (flows/cli/console.py).
    end_without_heartbeat_wait
                            prefect.flow_engine._send_heartbeats: a sync flow run's end joins its heartbeat thread,
                            which sleeps in one-second steps before it sees the stop: up to a second (half on average)
                            after every run. Prefect's async engine does not join it; the sync one is made not to.
    quiet_on_broken_pipe    rich.console.Console.on_broken_pipe, of the console of each of Prefect's console handlers
                            (prefect.logging.handlers.PrefectConsoleHandler): rich ends the process (SystemExit(1))
                            when its output's reader is gone. A served flow run's output goes to its runner: a
                            runner killed -9 took its runs with it at their next log line. They go quiet instead.
    extra_logger_handlers   the handlers of Prefect's `prefect.extra` logger (logging.yml): what Prefect gives each
                            logger of its extra-loggers setting, for a process that set Prefect up before gpuflow
                            named its loggers there (flows/run_logs.py).

Nothing of Prefect is imported with this module, only inside its functions: the command line loads it for every
command, and `gpuflow run` must start fast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path


def start_api_server(listener: socket.socket, settings_env: dict[str, str]) -> subprocess.Popen:
    """Prefect's API server (its UI off) on `listener`, a bound socket that uvicorn inherits (it listens on it once
    the app is loaded); `settings_env`: this process's Prefect settings, for the server's."""
    app_dir = Path(importlib.util.find_spec("prefect").origin).parents[1]  # found, not imported: it may not be yet
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(app_dir),
            "--factory",
            "prefect.server.api.server:create_app",
            "--fd",
            str(listener.fileno()),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        env={
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            # a server of this process (or of the warm stack) alone: its usage reports say nothing of a team's, and
            # offline each start logs an ERROR on the user's console ("Failed to send telemetry"); unless the user says
            "PREFECT_SERVER_ANALYTICS_ENABLED": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
            **settings_env,
        },
        pass_fds=(listener.fileno(),),
    )


def refresh_settings() -> None:
    """Makes this process's Prefect settings (every thread's client) read os.environ again."""
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()


def ensure_logging_setup() -> None:
    """Configures Prefect's logging in this process now, if it is not yet."""
    from prefect.logging.configuration import ensure_logging_setup as ensure

    ensure()


def extra_logger_handlers() -> list:
    """The handlers Prefect attaches to each of its extra loggers (the API's, which sends to the current run)."""
    import logging

    ensure_logging_setup()
    return list(logging.getLogger("prefect.extra").handlers)


def end_without_heartbeat_wait() -> None:
    """A flow run of this process ends without waiting for its heartbeat thread to wake (it stops by itself, as after
    an async flow run). Idempotent."""
    import functools

    from prefect import flow_engine

    if not isinstance(flow_engine._send_heartbeats, functools.partial):
        flow_engine._send_heartbeats = functools.partial(flow_engine._send_heartbeats, join_on_exit=False)


def quiet_on_broken_pipe() -> None:
    """This process's Prefect console handlers, when their output's reader is gone, write nowhere from then on (as
    rich does before it ends the process) and the process goes on. Idempotent."""
    import logging
    import types

    from prefect.logging.handlers import PrefectConsoleHandler

    def go_quiet(console) -> None:
        console.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in {1, 2, getattr(console.file, "fileno", lambda: 1)()}:  # each of this process's on a pipe that broke
            with contextlib.suppress(OSError, ValueError):
                if reader_gone(fd):
                    os.dup2(devnull, fd)
        os.close(devnull)

    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        handler.console.on_broken_pipe = types.MethodType(go_quiet, handler.console)


def reader_gone(fd: int) -> bool:
    """Whether `fd` is a pipe whose reading end is closed (poll reports POLLERR on its writing end)."""
    import select
    import stat

    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))
