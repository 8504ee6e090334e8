"""When a loop counts as hung (cluster/job/hung.py), decided on the MLflow run the guard reads: its metrics'
report times. The real hang (a loop that stops reporting, stopped with its stacks) is in tests/test_watchdog.py."""

from mlflow.entities import Metric, Run, RunData, RunInfo

from gpuflow.cluster.job.hung import DERIVED_FLOOR_S, HungWatch


class Clock:
    now = 1_000_000.0

    def __call__(self):
        return self.now


def run_with(**stamps_s) -> Run:
    """A run as MLflow returns it, its metrics last logged at these times (seconds)."""
    info = RunInfo("r", "0", "u", "RUNNING", 0, None, "ACTIVE")
    return Run(
        info, RunData(metrics=[Metric(key.replace("__", "/"), 1.0, int(at * 1000), 0) for key, at in stamps_s.items()])
    )


def test_an_explicit_limit_counts_from_the_last_report_and_ignores_system_metrics():
    clock, seen = Clock(), {}
    watch = HungWatch(lambda: seen.get("run"), hung_minutes=1, clock=clock)
    assert watch.check() is None  # nothing read yet
    seen["run"] = run_with(system__cpu_utilization=clock.now)  # MLflow's own sampling: not the loop
    clock.now += 3600
    assert watch.check() is None, "no report yet: start-up is bounded by max_runtime_minutes"
    seen["run"] = run_with(train_loss=clock.now, system__cpu_utilization=clock.now)
    assert watch.check() is None
    clock.now += 59
    seen["run"] = run_with(train_loss=clock.now - 59, system__cpu_utilization=clock.now)
    assert watch.check() is None
    clock.now += 2
    reason, detail = watch.check()
    assert reason == "hung" and "limits.hung_minutes: 1 min" in detail and "hung/stacks.txt" in detail


def test_without_a_limit_it_derives_one_from_the_runs_pace():
    clock, seen = Clock(), {}
    watch = HungWatch(lambda: seen.get("run"), hung_minutes=None, clock=clock)
    for epoch_s in (0, 300, 240):  # reports 300 s apart at most
        clock.now += epoch_s
        seen["run"] = run_with(train_loss=clock.now)
        assert watch.check() is None
    assert watch.limit() == 5 * 300 > DERIVED_FLOOR_S
    clock.now += 5 * 300 - 1
    assert watch.check() is None
    clock.now += 2
    assert watch.check()[0] == "hung"


def test_an_unreadable_run_is_never_judged_hung():
    clock, seen = Clock(), {"run": run_with(train_loss=Clock.now)}
    watch = HungWatch(lambda: seen["run"], hung_minutes=1, clock=clock)
    watch.check()
    seen["run"], clock.now = None, clock.now + 3600  # the tracking server is down: no judgement
    assert watch.check() is None


def test_a_stack_dump_signals_a_registered_worker_and_never_a_pid_its_worker_left(tmp_path, monkeypatch):
    """A worker killed hard leaves its stack file: its pid, reused since by another process, is not signalled (the
    dump's signal would end that process); a live worker writes its stacks."""
    import os
    import subprocess
    import sys
    import time

    from gpuflow.cluster.job import stacks

    monkeypatch.setattr(stacks.tempfile, "gettempdir", lambda: str(tmp_path))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from gpuflow.cluster.job.stacks import registered_for_dumps\n"
            "registered_for_dumps('run-1'); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    bystander = subprocess.Popen(["sleep", "60"])  # a pid that a dead worker's file names, with another start
    try:
        assert worker.stdout.readline().strip() == "ready"
        for stale in (f"{bystander.pid}-1.0.txt", f"{bystander.pid}.txt"):  # another start; none recorded
            (stacks.stacks_folder("run-1") / stale).write_text("")
        dumped = stacks.dump_stacks_here("run-1")
        time.sleep(0.2)
        assert list(dumped) == [str(worker.pid)] and "<module>" in dumped[str(worker.pid)], dumped
        assert bystander.poll() is None, "the bystander was signalled"
        assert worker.poll() is None, "a dump leaves the worker training"
    finally:
        for process in (worker, bystander):
            process.kill()
            process.wait()
