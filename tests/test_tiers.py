"""The suite's own checks (tests/support/tiers.py), each shown catching a deliberate fault in its own pytest session."""

import json
import re

import psutil
import pytest

from tests.support.repo import REPO

INNER_CONFTEST = """
import pytest


@pytest.fixture
def mlflow_url():  # named as the real fixture that starts an MLflow server: the tier check goes by the name
    return "http://127.0.0.1:1"
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    """Runs a pytest session of its own (a subprocess) with the suite's plugin; returns (exit code, output)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("CI", raising=False)
    pytester.makeconftest(INNER_CONFTEST)

    def run(source: str, *args: str) -> tuple[int, str]:
        pytester.makepyfile(test_inner=source)
        result = pytester.runpytest_subprocess(
            "-p", "tests.support.tiers", "-p", "no:cacheprovider", "-o", "leftover_grace_s=2", "-rs", *args, timeout=300
        )
        return result.ret, result.stdout.str() + result.stderr.str()

    return run


def test_a_process_a_test_leaves_running_fails_the_session_and_is_named(inner):
    returncode, output = inner("""
import subprocess

def test_leaks_a_process():
    subprocess.Popen(["sleep", "600"], start_new_session=True)  # its own session: outlives the test's process group
""")
    assert returncode == 1, output
    [pid] = re.findall(r"left running: pid (\d+) 'sleep'", output)
    assert "GPUFLOW_HOME=" in output  # which test's folder it came from
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE


def test_a_process_stopped_by_its_test_passes(inner):
    returncode, output = inner("""
import subprocess

def test_stops_what_it_starts():
    process = subprocess.Popen(["sleep", "600"], start_new_session=True)
    process.kill()
    process.wait()
""")
    assert returncode == 0, output
    assert "left running" not in output


def test_a_file_written_inside_the_repository_fails_the_session(inner):
    returncode, output = inner(f"""
from pathlib import Path

def test_writes_in_the_repo(tmp_path):
    Path({str(REPO / "tests" / "written-by-a-test.tmp")!r}).write_text("x")
""")
    (REPO / "tests" / "written-by-a-test.tmp").unlink(missing_ok=True)
    assert returncode == 1, output
    assert "written inside the repository: tests/written-by-a-test.tmp" in output


@pytest.mark.cluster  # it starts a Ray cluster (in the inner session), on purpose
def test_a_test_that_starts_a_ray_cluster_without_a_tier_marker_fails_naming_it(inner):
    returncode, output = inner(
        """
import pytest
import ray

def test_unmarked_ray():
    ray.init(num_cpus=1, include_dashboard=False, configure_logging=False)
    ray.shutdown()

def test_unmarked_server(mlflow_url):
    pass

@pytest.mark.full
def test_marked_server(mlflow_url):
    pass
""",
        "--full",
    )
    assert returncode == 1, output
    assert re.search(r"test_unmarked_ray starts a Ray cluster but carries no tier marker", output), output
    assert re.search(r"test_unmarked_server starts an MLflow server but carries no tier marker", output), output
    assert "test_marked_server starts" not in output
    assert "2 errors" in output  # a teardown error each, for the two unmarked tests


def test_the_quick_tier_leaves_out_the_whole_matrix(inner):
    source = """
import pytest

def test_quick():
    pass

@pytest.mark.slurm
def test_on_slurm():
    pass
"""
    returncode, output = inner(source)
    assert returncode == 0 and "1 passed, 1 deselected" in output, output
    returncode, output = inner(source, "--full")
    assert "test_on_slurm PASSED" in output or "2 passed" in output, output


def test_a_missing_component_skips_saying_how_to_enable_it_and_fails_in_ci(inner, monkeypatch):
    source = """
from tests.support.tiers import require

def test_needs_a_thing():
    require(False, "the thing", "apt-get install thing")
"""
    returncode, output = inner(source)
    assert returncode == 0 and "the thing is missing; to enable: apt-get install thing" in output, output
    monkeypatch.setenv("CI", "1")
    returncode, output = inner(source)
    assert returncode == 1 and "nothing may be skipped" in output, output


def test_the_whole_matrix_over_its_cpu_budget_fails_naming_the_costliest_files(tmp_path, monkeypatch):
    from tests.support import cpu_report

    report = tmp_path / "cpu.jsonl"
    monkeypatch.setattr(cpu_report, "REPORT", report)
    monkeypatch.setattr(cpu_report, "PACE", tmp_path / "pace.jsonl")  # none measured: not this session's own
    rows = [
        {"test": f"tests/test_{name}.py::test_{i}", "cpu_s": cpu_s, "wall_s": 1.0}
        for name, cpu_s in (("cheap", 1.0), ("dear", 30.0), ("middling", 5.0))
        for i in range(2)
    ]
    report.write_text("".join(f"{json.dumps(row)}\n" for row in rows))

    within, text = cpu_report.check_budget(rows, budget_s=100)
    assert within and "72 CPU-seconds in 6 tests" in text and "OVER" not in text
    within, text = cpu_report.check_budget(rows, budget_s=50)
    assert not within and "OVER BUDGET by 22" in text
    costliest = [line.split()[-1] for line in text.splitlines() if line.startswith(" ")]
    assert costliest == ["tests/test_dear.py", "tests/test_middling.py", "tests/test_cheap.py"]
    monkeypatch.setattr(cpu_report, "WHOLE_MATRIX_BUDGET_CPU_S", 50)
    assert cpu_report.main(["--budget"]) == 1
    assert cpu_report.main([]) == 0  # without --budget it only reports


def test_the_budget_is_checked_at_the_reference_pace_the_controller_measured(tmp_path, monkeypatch):
    from tests.support import cpu_report

    monkeypatch.setattr(cpu_report, "REPORT", tmp_path / "cpu.jsonl")
    monkeypatch.setattr(cpu_report, "PACE", tmp_path / "pace.jsonl")
    rows = [{"test": "tests/test_dear.py::test_it", "cpu_s": 150.0, "wall_s": 1.0}]
    cpu_report.REPORT.write_text(json.dumps(rows[0]) + "\n")
    monkeypatch.setattr(cpu_report, "WHOLE_MATRIX_BUDGET_CPU_S", 100)
    assert cpu_report.main(["--budget"]) == 1  # no pace measured: the raw CPU-seconds decide

    slow = 2 * cpu_report.REFERENCE_PROBE_CPU_S  # a machine at half pace; one outlier does not move the median
    samples = [slow, slow, 10 * slow]
    cpu_report.PACE.write_text("".join(json.dumps({"probe_cpu_s": s}) + "\n" for s in samples))
    assert cpu_report.pace_of(cpu_report.read_pace()) == pytest.approx(2.0)
    assert cpu_report.main(["--budget"]) == 0
    within, text = cpu_report.check_budget(rows, budget_s=70, pace=2.0)
    assert not within and "75 at the reference pace" in text and "OVER BUDGET by 5" in text

    probe = cpu_report.probe_cpu_s()  # the probe times real work on this machine
    assert 0 < probe < 60


def test_a_server_group_is_signalled_only_while_it_is_the_servers():
    """`stop_group` signals a server's process group while the server is not reaped, or a member of its group lives;
    a group left empty after its leader was reaped may be another session's by now (pids wrap), and is left alone."""
    import os
    import signal
    import subprocess

    from tests.support.servers import ours_to_signal

    alone = subprocess.Popen(["true"], start_new_session=True)
    assert ours_to_signal(alone), "not reaped yet: its id is still its own"
    alone.wait()
    assert not ours_to_signal(alone), "reaped, no member left: its id may be anyone's"
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo started"], start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert leader.stdout.readline().strip() == b"started"
        leader.wait()
        assert ours_to_signal(leader), "its leader reaped, a member of its group lives"
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
