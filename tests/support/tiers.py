"""The suite's two tiers and its hygiene, as a pytest plugin (loaded by tests/conftest.py).

- `pytest` is the quick tier: every test not marked for the whole matrix. `pytest --full` is the whole matrix.
- A test that starts a Ray cluster, a server, PostgreSQL, Slurm or a browser carries the marker of its tier:
  `cluster` (a real run budgeted into the quick tier) or `full` (`slurm`, `browser`, `load` and `team` imply it).
  What a test starts is seen, not declared: the processes it starts are watched while it runs, and the fixtures
  that start shared servers are known. A test that starts one and carries neither marker fails, naming what it
  started, in either tier.
- At the end of a session, a process that a test started and left running fails the session, named with the
  test's folder; so does a file a test wrote inside the repository.
- `require(ok, component, how)` skips a test whose component is missing, saying how to enable it; in CI
  (`CI` set) it fails instead, so a tier never shrinks unnoticed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
FULL_MARKERS = ("full", "slurm", "browser", "load", "team")  # these run only in the whole matrix
TIER_MARKERS = ("cluster", *FULL_MARKERS)
# Shared servers a test reaches through a fixture (started once, by whichever test asks first).
HEAVY_FIXTURES = {
    "prefect_api": "a Prefect server",
    "mlflow_url": "an MLflow server",
    "served": "gpuflow serve",
    "slurm_infra": "Slurm",
    "browser": "a browser",
    "stack": "the team stack (PostgreSQL)",
}
# What a started process is, by the name the kernel gives it (psutil's name(): the executable, not its arguments).
PROCESS_KINDS = {
    "raylet": "a Ray cluster",
    "gcs_server": "a Ray cluster",
    "postgres": "PostgreSQL",
    "slurmctld": "Slurm",
    "slurmd": "Slurm",
    "chromium": "a browser",
    "chrome": "a browser",
    "headless_shell": "a browser",
}
SESSION_ENV = "PYTEST_GPUFLOW_SESSION"  # every process the tests start inherits it: how leftovers are found
_started_now: list[str] = []  # what the running test started, as noted by the test helpers (servers, harnesses)


def started(kind: str) -> None:
    """Called by the test helpers that start a server or harness: the running test started `kind`."""
    _started_now.append(kind)


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def require(ok: bool, component: str, how: str) -> None:
    """Skip (or, in CI, fail) a test whose `component` is missing; `how` says how to enable it."""
    if ok:
        return
    message = f"{component} is missing; to enable: {how}"
    if in_ci():
        pytest.fail(f"{message} (CI runs the whole matrix: nothing may be skipped)", pytrace=False)
    pytest.skip(message)


# -- the tiers -------------------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="the whole matrix: Slurm, every fault, the team stack, the browser and the load test",
    )
    parser.addini("leftover_grace_s", "how long the session's last processes may take to exit", default="20")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: runs only in the whole matrix (pytest --full)")
    config.addinivalue_line("markers", "cluster: starts a real Ray cluster or server, budgeted into the quick tier")
    config.addinivalue_line("markers", "team: needs PostgreSQL and the team stack (whole matrix)")
    if not hasattr(config, "workerinput"):  # the controller, or the only process: a new session tag
        os.environ[SESSION_ENV] = uuid.uuid4().hex
        config._repo_before = repo_files()


def tier_of(item) -> str | None:
    marks = {mark.name for mark in item.iter_markers()}
    return next((name for name in TIER_MARKERS if name in marks), None)


def pytest_collection_modifyitems(config, items):
    if config.getoption("full"):
        return
    quick, whole = [], []
    for item in items:
        (whole if tier_of(item) in FULL_MARKERS else quick).append(item)
    if whole:
        config.hook.pytest_deselected(items=whole)
        items[:] = quick


# -- what a test starts ---------------------------------------------------------------------------------------------
class ProcessWatch(threading.Thread):
    """Watches the processes started below pytest while one test runs, and says what kinds they were."""

    def __init__(self, interval_s: float = 0.5):
        super().__init__(daemon=True, name="tiers-process-watch")
        self.me, self.interval_s = psutil.Process(), interval_s
        self.before = {p.pid for p in self.descendants()}
        self.kinds: set[str] = set()
        self.stopping = threading.Event()

    def descendants(self) -> list[psutil.Process]:
        try:
            return self.me.children(recursive=True)
        except psutil.Error:
            return []

    def look(self) -> None:
        for process in self.descendants():
            if process.pid in self.before:
                continue
            try:
                name = process.name()
            except psutil.Error:
                continue
            kind = PROCESS_KINDS.get(name) or next((k for n, k in PROCESS_KINDS.items() if name.startswith(n)), None)
            if kind:
                self.kinds.add(kind)

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.look()

    def stop(self) -> set[str]:
        self.stopping.set()
        self.join()
        self.look()
        return self.kinds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _started_now.clear()
    if tier_of(item) is None:  # a marked test may start anything: only an unmarked one is watched (the scan costs CPU)
        watch = ProcessWatch()
        watch.start()
        item._tiers_watch = watch
    yield


def what_it_starts(item) -> list[str]:
    """What the test started, seen by the watch and noted by the helpers, and the shared servers it uses."""
    kinds = set(item._tiers_watch.stop()) | set(_started_now)
    kinds |= {kind for fixture, kind in HEAVY_FIXTURES.items() if fixture in item.fixturenames}
    return sorted(kinds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or not hasattr(item, "_tiers_watch"):
        return
    kinds = what_it_starts(item)
    if kinds and tier_of(item) is None:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} starts {', '.join(kinds)} but carries no tier marker: mark it "
            "@pytest.mark.full (the whole matrix) or, if it is worth its minutes in the quick tier, "
            "@pytest.mark.cluster (tests/README.md, 'Tiers')"
        )


# -- what a session leaves -------------------------------------------------------------------------------------------
SKIPPED_IN_REPO = {".git", ".venv", "test-artifacts", ".pytest_cache", "__pycache__", "build"}


def repo_files() -> set[str]:
    """Every file in the repository, but for what a test session may leave there by design (the venv,
    test-artifacts/, caches). A new one at the end of a session was written by a test."""
    found = set()
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_IN_REPO and not name.endswith(".egg-info")]
        for name in files:
            found.add(os.path.relpath(os.path.join(folder, name), REPO))
    return found


def carrying(name: str, value: str, besides: set[int] = frozenset(), settle_s: float = 2.0) -> list[psutil.Process]:
    """Live (not zombie) processes whose environment has name=value, which everything a test starts inherits.

    A process in the middle of its exec shows no environment and no command line (the kernel fills both in only once
    the new program's memory is set up, after the parent's Popen has returned): such a process is read again until
    it shows them (`settle_s` at most), so one just started is never missed. A process that shows a command line but
    no environment (pytest-xdist's workers: setproctitle writes over it) is not ours to find."""
    found, unsure = [], []
    for process in psutil.process_iter(["pid", "ppid", "environ", "cmdline", "status"]):
        info = process.info
        if info["pid"] in besides or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if mid_exec(info):
            unsure.append(process)
        elif (info["environ"] or {}).get(name) == value:
            found.append(process)
    deadline = time.monotonic() + settle_s
    while unsure and time.monotonic() < deadline:
        time.sleep(0.05)
        again = []
        for process in unsure:
            try:
                info = process.as_dict(["pid", "ppid", "environ", "cmdline", "status"])
            except psutil.Error:
                continue  # gone
            if info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if mid_exec(info):
                again.append(process)
            elif (info["environ"] or {}).get(name) == value:
                found.append(process)
        unsure = again
    return found


def mid_exec(info: dict) -> bool:
    """A readable, empty environment and command line: a process between exec's start and the new program's
    memory (or exiting); a kernel thread (kthreadd, pid 2, and its children) shows the same and is not one."""
    return info["environ"] == {} and not info["cmdline"] and 2 not in (info["pid"], info["ppid"])


def left_running() -> list[psutil.Process]:
    """Processes of this session still alive (pytest-xdist's workers are gone by now): every one that carries the
    session's tag, and every descendant of this process whatever its environment says (a test's child stays one
    unless it double-forks)."""
    me = psutil.Process()
    mine = {me.pid} | {p.pid for p in me.parents()}
    found = carrying(SESSION_ENV, os.environ.get(SESSION_ENV), mine)
    seen = {process.pid for process in found}
    try:
        below = me.children(recursive=True)
    except psutil.Error:
        below = []
    for process in below:
        try:
            if process.pid not in seen and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            pass
    return found


def describe(process: psutil.Process) -> str:
    try:
        home = process.environ().get("GPUFLOW_HOME", "?")
        return f"pid {process.pid} {process.name()!r} ({' '.join(process.cmdline())[:160]}), GPUFLOW_HOME={home}"
    except psutil.Error:
        return f"pid {process.pid} (gone while being described)"


@pytest.hookimpl(trylast=True)  # after pytest-xdist has stopped its workers
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        return
    deadline = time.monotonic() + float(config.getini("leftover_grace_s"))
    left = left_running()
    while left and time.monotonic() < deadline:  # a test's last processes may still be exiting
        time.sleep(1)
        left = left_running()
    problems = [f"left running: {describe(process)}" for process in left]
    for process in left:  # the machine is left clean even so
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    written = sorted(repo_files() - getattr(config, "_repo_before", set()))
    problems += [f"written inside the repository: {path}" for path in written]
    if problems:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter:
            reporter.section("left behind by the tests", red=True)
            for line in problems:
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
