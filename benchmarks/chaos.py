"""Chaos soak: N short runs, each struck by a fault drawn from a seed, while reconciler passes run side by side; then
one more pass, and every run must end true in all five of its records.

    python benchmarks/chaos.py --runs 4 --seed 1 [--overlap 2] [--no-serve] [--converge-s 120] [--keep]
                               [--passes 3] [--pass-every-s 20] [--users-every-s 30]

Starts a real Prefect server and a real MLflow server on 127.0.0.1 (sqlite; in a temp dir of its own, with its own
GPUFLOW_HOME and PREFECT_HOME), `gpuflow quota set local 2`, a webhook block pointing at a receiver that counts
messages per flow run, and `gpuflow serve` of run-experiment. It runs N tiny runs of the plain Ray Train loop (8
epochs of a second, one worker, no data), OVERLAP at a time: through `gpuflow run` in a session of its own, and
every other run through the served deployment. Each run gets a fault from the table in benchmarks/chaos_faults.py
(`random.Random(seed)`), applied at a random moment of it; meanwhile benchmarks/chaos_watch.py runs the passes, a
user's commands and the quota's sampled invariants. Then the reaper's pass (`reap_clusters`, local backend)
and, up to --converge-s, the invariants (benchmarks/chaos_checks.py): every flow run final, no MLflow run RUNNING,
no cluster nor process of the soak left, no quota slot held, one message per bad end. Prints and records a row; exits
1 on any violated invariant, naming the run and its records. Everything it started is stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.chaos_checks import Check, check, check_plan  # noqa: E402
from benchmarks.chaos_faults import (  # noqa: E402
    NOT_YET,
    Run,
    done,
    draw,
    launch,
    soak_overrides,
    stop,
    strike,
    unpin_all,
)
from benchmarks.chaos_stack import Stack  # noqa: E402
from benchmarks.chaos_watch import Beside  # noqa: E402
from gpuflow.cluster.run.liveness import HEARTBEAT_LATE_S, NEVER_BEGUN_S  # noqa: E402

QUOTA = 2
RUN_BOUND_S = 300  # a run still going after this is killed and counted as hung
LEASE_LAPSE_S = 20  # the runs' orphan grace (12 s) and a margin: a dead run's MLflow lease reads stale to the reaper


@dataclass
class Soak:
    runs: list[Run]
    check: Check
    converge_s: float | None  # None: did not converge within the bound
    reaper_output: str

    @property
    def passed(self) -> bool:
        return not self.check.violations

    def faults(self) -> str:
        counts = collections.Counter(run.fault["name"] for run in self.runs)
        return ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))

    def report(self) -> str:
        lines = [run.describe() for run in self.runs]
        if self.check.violations:
            lines += ["", "violated:"] + [f"  {violation}" for violation in self.check.violations]
            named = {run_id for run_id in self.check.records if any(run_id in v for v in self.check.violations)}
            by_id = {run.flow_run_id: run for run in self.runs}
            for run_id in sorted(named):
                lines.append(
                    f"  records of flow run {run_id}"
                    + (
                        f" (run {by_id[run_id].index}, fault {by_id[run_id].fault['name']})"
                        if run_id in by_id
                        else " (not one the soak launched)"
                    )
                )
                lines += [f"    {key}: {value}" for key, value in self.check.records[run_id].items()]
        return "\n".join(lines)


def soak(
    runs: int,
    seed: int,
    overlap: int = 2,
    serve: bool = True,
    converge_bound_s: float = 120,
    root: Path | None = None,
    keep: bool = False,
    say=print,
    beside: dict | None = None,
) -> Soak:
    """`beside`: Beside's passes, every_s and users_every_s (benchmarks/chaos_watch.py), while the runs go."""
    plan = draw(random.Random(seed), runs, serve)
    stack = Stack(root)
    say(f"[chaos] {runs} runs, seed {seed}, in {stack.root}: " + ", ".join(r.fault["name"] for r in plan))
    try:
        stack.start(QUOTA, soak_overrides(stack) if any(r.via == "serve" for r in plan) else None)
        with Beside(stack, QUOTA, **(beside or {})) as watch:
            drive(plan, stack, overlap, say)
            stack.stop_serve()  # its runs are over; a serve process carries the soak's GPUFLOW_HOME too
            time.sleep(until_judged(plan))
        done_passes, failed_passes = watch.pass_lines()
        say(
            f"[chaos] beside the runs: {done_passes} passes ({failed_passes} failed: a server down), "
            f"{watch.user_commands} user commands, {watch.samples} samples of the quota's invariants"
        )
        reaped_at = time.monotonic()
        reaper_output = reap(stack)
        said = [
            line.split(" - ", 1)[-1].strip()
            for line in reaper_output.splitlines()
            if any(word in line for word in ("Crashed", "closed", "down ", "quota ", "exited"))
        ]
        say("[chaos] reaper: " + (" | ".join(said) or "nothing to do"))
        while True:
            found = check(stack)
            check_plan(plan, found)
            found.violations += watch.violations
            found.figures.update({"passes beside": done_passes, "quota samples": watch.samples})
            converged = time.monotonic() - reaped_at
            if not found.violations or converged > converge_bound_s:
                break
            time.sleep(3)
        return Soak(plan, found, converged if not found.violations else None, reaper_output)
    finally:
        clean_up(plan, stack)
        stack.close(keep=keep)


def until_judged(plan: list[Run]) -> float:
    """How long the reaper's pass must wait for every dead run to be judged dead: a lease to read stale, a flow run
    `gpuflow run` never began (an API restart as it was made) to be old enough, a served run found without its
    process (its engine died as the API restarted) to be silent long enough (cluster/run/liveness.py), and a cluster
    whose teardown failed to be free to go."""
    now = time.monotonic()
    waits = [LEASE_LAPSE_S, NEVER_BEGUN_S - (now - max(run.started for run in plan))]
    waits += [HEARTBEAT_LATE_S - (now - run.started - (run.struck_s or 0)) for run in plan if run.without_process]
    waits += [
        run.started + run.struck_s + run.fault["down_s"] + 1 - now
        for run in plan
        if run.fault["target"] == "teardown" and run.struck_s is not None
    ]
    return max(waits)


def drive(plan: list[Run], stack: Stack, overlap: int, say) -> None:
    """Launches the runs, `overlap` at a time, strikes each at its moment, and waits for each to end."""
    pending, active = list(plan), []
    while pending or active:
        while pending and len(active) < overlap:
            run = pending.pop(0)
            launch(run, stack)
            active.append(run)
        for run in list(active):
            elapsed = time.monotonic() - run.started
            if elapsed >= run.strike_at_s and (not run.applied or run.applied.startswith(NOT_YET)):
                strike(run, stack)
                if not run.applied.startswith(NOT_YET):
                    say(f"[chaos] {run.describe()}")
            if done(run, stack):
                run.ended = time.monotonic()
                active.remove(run)
                say(f"[chaos] run {run.index} over after {run.ended - run.started:.0f}s")
            elif elapsed > RUN_BOUND_S:
                stop(run)
                active.remove(run)
                say(f"[chaos] run {run.index} still going after {RUN_BOUND_S}s: killed")
        time.sleep(0.5)


def reap(stack: Stack) -> str:
    """One reconciler pass: the reaper as its deployment runs it, on the local backend."""
    done_ = subprocess.run(
        [sys.executable, "-c", "from gpuflow.flows.reaper import reap_clusters; reap_clusters(backends=['local'])"],
        cwd=stack.root,
        env=stack.client_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done_.stdout + done_.stderr
    (stack.root / "reaper.log").write_text(output)
    return output if done_.returncode == 0 else f"reaper exited {done_.returncode}:\n{output[-3000:]}"


def clean_up(plan: list[Run], stack: Stack) -> None:
    """Whatever the soak or its faults left: the runs' processes, their clusters, every process of its home."""
    from gpuflow.cluster.backends.local import LocalBackend
    from tests.support.tiers import carrying

    for run in plan:
        if run.process and run.process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(run.process.pid, signal.SIGKILL)
    stack.stop_serve()
    unpin_all(stack.home)  # a teardown fault still on
    backend = LocalBackend(root=stack.home / "clusters")
    for cluster in backend.status():
        with contextlib.suppress(Exception):
            backend.down(cluster.name)
    for process in carrying("GPUFLOW_HOME", str(stack.home), {os.getpid()}):
        with contextlib.suppress(OSError):
            process.kill()


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--overlap", type=int, default=2, help="runs going at once")
    parser.add_argument("--no-serve", action="store_true", help="every run through `gpuflow run`")
    parser.add_argument(
        "--converge-s", type=float, default=120, help="how long the invariants may take after the reaper"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, databases) for a look")
    parser.add_argument("--passes", type=int, default=3, help="reconciler passes at once while the runs go")
    parser.add_argument("--pass-every-s", type=float, default=20, help="each pass process's interval")
    parser.add_argument("--users-every-s", type=float, default=30, help="`gpuflow status` and `quota list`; 0: none")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, interrupted)  # `kill` stops it as Ctrl-C does: everything started is stopped

    from benchmarks.record import record

    beside = {"passes": args.passes, "every_s": args.pass_every_s, "users_every_s": args.users_every_s}
    result = soak(args.runs, args.seed, args.overlap, not args.no_serve, args.converge_s, keep=args.keep, beside=beside)
    print(result.report())
    figures = result.check.figures
    converged = f"{result.converge_s:.0f}" if result.converge_s is not None else f"> {args.converge_s:.0f}"
    print(
        f"[chaos] {'PASS' if result.passed else 'FAIL'}: flow runs final {figures['flow runs final']}, MLflow "
        f"RUNNING {figures['MLflow RUNNING']}, clusters left {figures['clusters left']}, processes left "
        f"{figures['processes left']}, slots held {figures['slots held']}, messages per bad end "
        f"{figures['messages per bad end']}, converged in {converged} s"
    )
    record(
        "chaos",
        {
            "runs": args.runs,
            "seed": args.seed,
            "overlap": args.overlap,
            "passes at once, every s": f"{args.passes}, {args.pass_every_s:g}",
            "faults": result.faults(),
            **figures,
            "converge s": converged,
            "result": "PASS" if result.passed else "FAIL",
        },
    )
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
