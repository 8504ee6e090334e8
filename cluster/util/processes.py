"""Processes by pid and by session, through psutil: is one alive, which belong to a session, stop whole sessions.

A local cluster, its jobs and Prefect's temporary API each run in a session of their own (`start_new_session`):
Ray puts each worker in a process group of its own, but all stay in the session we started.
"""

from __future__ import annotations

import os
import signal
import time

import psutil


def alive(pid: int) -> bool:
    """Running, or stopped: not gone and not a zombie (a zombie holds no resources)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def started_at(pid: int | None = None) -> float | None:
    """When the process started (this one by default), as the OS counts it: with its pid, it names one process for
    good, where a pid alone is reused once that process is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def still_the_process(pid: int, started: float | None) -> bool:
    """The process recorded as (pid, started) is still running: not gone, and not another that got its pid since.
    A record without a start time names no process for sure: never signal one on its word."""
    return started is not None and alive(pid) and started_at(pid) == started


def ours(session: int, started: float | None) -> bool:
    """A session recorded as its leader's (pid, start time) is still the one recorded: its leader alive and started
    then, or gone (no other session can take its id while one of its members lives). A leader alive with another
    start is a session that got the id since: never signalled. A record without a start time is taken at its word."""
    leader = started_at(session)
    return started is None or leader is None or leader == started


def in_session(pid: int, session: int) -> bool:
    try:
        return os.getsid(pid) == session and alive(pid)
    except OSError:
        return False


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes of a session: the process we started and all it started."""
    return [pid for pid in psutil.pids() if in_session(pid, session)]


def session_alive(session: int) -> bool:
    """Its leader (the process we started) is asked first, one process instead of every one; a session whose leader
    died is alive while any member is."""
    return in_session(session, session) or bool(session_members(session))


def stop_sessions(sessions: list[int], timeout_s: float = 10) -> list[int]:
    """SIGKILLs every process of each session and waits until they are gone; returns those still there after
    `timeout_s` (none, unless a process is not ours to kill or stuck in the kernel).

    Nothing in a throwaway local cluster needs a graceful stop: checkpoints and metrics are persisted before teardown,
    and Ray's own shutdown takes seconds. A caller inside one of the sessions (the supervisor) is spared, to go on
    killing what is forked meanwhile (Ray starts its agents seconds after the raylet); it exits last."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        members = [pid for session in sessions for pid in session_members(session) if pid != os.getpid()]
        if not members:
            return []
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)
    return members
