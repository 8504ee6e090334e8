"""Where the suite's CPU goes: `pytest -p tests.support.cpu_report` prints the CPU-seconds of each test file at the end.

On a machine with few cores the suite's wall time is its CPU time, and a test's own process shows little of it:
the work is done by the Ray clusters, servers, Slurm jobs and subprocesses it starts. Each pytest process therefore
puts itself in a cgroup of its own (cgroup v1 `cpuacct`, as root), which everything it starts inherits, and a test
is charged what the cgroup used while it ran. A session's servers are charged to the tests that run beside them.
Where no such cgroup can be made, it says so and measures nothing.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
REPORT = Path(__file__).resolve().parents[2] / "test-artifacts" / "cpu.jsonl"


class CpuAccount:
    def __init__(self, name: str):
        self.group = CPUACCT / name
        self.group.mkdir()
        try:
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.group.rmdir()
            raise

    def used_s(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        try:
            self.group.rmdir()
        except OSError:  # a process a test started still runs in it: the suite's own checks name it
            pass


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:  # the controller (or the only process): a new report
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.unlink(missing_ok=True)
    if worker is None and config.getoption("dist", "no") != "no":
        return  # pytest-xdist's controller runs no test
    try:
        config._cpu_account = CpuAccount(f"gpuflow-tests-{worker or 'main'}-{os.getpid()}")
    except OSError as error:
        print(f"cpu_report: no cpuacct cgroup ({error}); measuring nothing")


def pytest_unconfigure(config):
    account = getattr(config, "_cpu_account", None)
    if account:
        account.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    account = getattr(item.config, "_cpu_account", None)
    if account is None:
        yield
        return
    used, started = account.used_s(), time.monotonic()
    yield
    with REPORT.open("a") as report:  # one short line per write: appends from the workers do not interleave
        report.write(json.dumps({"test": item.nodeid, "cpu_s": round(account.used_s() - used, 1),
                                 "wall_s": round(time.monotonic() - started, 1)}) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    if not REPORT.exists():
        return
    rows = [json.loads(line) for line in REPORT.read_text().splitlines()]
    by_file, wall = collections.Counter(), collections.Counter()
    for row in rows:
        path = row["test"].split("::")[0]
        by_file[path] += row["cpu_s"]
        wall[path] += row["wall_s"]
    terminalreporter.section("CPU-seconds by test file")
    for path, cpu_s in by_file.most_common():
        terminalreporter.write_line(f"{cpu_s:8.0f}  {wall[path]:7.0f} s of tests  {path}")
    terminalreporter.write_line(f"{sum(by_file.values()):8.0f}  CPU-seconds in {len(rows)} tests (per test: {REPORT})")
