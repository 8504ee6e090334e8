"""A run's deadline (limits.deadline, or limits.finish_within_hours from its start): what the run needs, whether the
deadline can be met, and what to launch each time the run needs a cluster, by Uniform Progress (deadline.py).

    spec = resolved(spec, created_at)                     # finish_within_hours made an absolute limits.deadline
    clock = DeadlineClock.of(spec, prediction, started_at)  # None without a deadline
    checked_deadline(spec, prediction)                   # the clock, or SpecError: on-demand alone cannot meet it
    clock.choose(time.time(), progress, spot_available)  # spot, on-demand or wait, with the reason

C(0), the compute the run needs: the slowest of this loop's past runs on this hardware (its first epoch and the rest),
else limits.max_runtime_minutes, the most the run may take. d, the changeover (what a switch costs: the cluster's
provision and the job's start, the checkpoint's reload, the work redone): limits.changeover_minutes, else the
slowest past provision plus first epoch, else DEFAULT_CHANGEOVER_S for the backend. Both are taken on the safe side:
the safety net then holds when the run is slower than its history. The run decides when it has no cluster (its first
launch, after a loss, while it waits for spot) and, on on-demand, whether it is far enough ahead to go back to spot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from gpuflow.cluster.cost.deadline import Choice, Feasibility, Mode, Situation, feasibility, uniform_progress
from gpuflow.cluster.cost.predict import dollars, duration

# 0.2 h on a cloud (the NSDI '24 paper's d for VMs: boot, setup, reload); a Slurm allocation, a local Ray cluster
DEFAULT_CHANGEOVER_S = {"skypilot": 720.0, "slurm": 300.0, "local": 60.0}

SPOT_SECONDS, ON_DEMAND_SECONDS = "spot_seconds", "on_demand_seconds"  # billed on each, from the run's attempts


def resolved(spec, created_at: float):
    """The spec with limits.finish_within_hours made an absolute limits.deadline from `created_at` (the flow run's
    creation, the same on each retry of it): the deadline is then in the spec the run records."""
    hours = spec.limits.finish_within_hours
    if hours is None:
        return spec
    deadline = datetime.fromtimestamp(created_at, timezone.utc) + timedelta(hours=hours)
    limits = spec.limits.model_copy(update={"deadline": deadline, "finish_within_hours": None})
    return spec.model_copy(update={"limits": limits})


@dataclass(frozen=True)
class Progress:
    """What the run has trained: its productive compute (changeovers and redone work left out) and the fraction of
    its epochs its last checkpoint holds (None: not measured yet)."""

    compute_done_s: float = 0.0
    fraction_done: float | None = None


@dataclass(frozen=True)
class DeadlineClock:
    deadline_at: float  # epoch seconds
    started_at: float  # R(0) counts from here
    compute_s: float  # C(0)
    changeover_s: float  # d
    compute_from: str
    changeover_from: str
    field: str = "limits.deadline"

    @classmethod
    def of(cls, spec, prediction=None, started_at: float | None = None) -> DeadlineClock | None:
        now = time.time()
        limits = spec.limits
        if limits.deadline is None and limits.finish_within_hours is None:
            return None
        deadline_at = limits.deadline.timestamp() if limits.deadline else now + limits.finish_within_hours * 3600
        if prediction is not None and prediction.known and prediction.first_epoch:
            compute_s = prediction.first_epoch.high + (prediction.later_epochs.high if prediction.later_epochs else 0)
            compute_from = f"the slowest of {len(prediction.based_on)} past run(s) of this loop on this hardware"
        else:
            compute_s, compute_from = limits.max_runtime_minutes * 60, "limits.max_runtime_minutes (no history)"
        if limits.changeover_minutes is not None:
            changeover_s, changeover_from = limits.changeover_minutes * 60, "limits.changeover_minutes"
        elif prediction is not None and prediction.provision and prediction.first_epoch:
            changeover_s = prediction.provision.high + prediction.first_epoch.high
            changeover_from = "past runs' provision and first epoch"
        else:
            changeover_s = DEFAULT_CHANGEOVER_S.get(spec.compute.backend, 720.0)
            changeover_from = f"the {spec.compute.backend} default"
        field = "limits.deadline" if limits.deadline else "limits.finish_within_hours"
        return cls(deadline_at, started_at or now, compute_s, changeover_s, compute_from, changeover_from, field)

    def feasibility(self, now: float) -> Feasibility:
        return feasibility(self.compute_s, self.changeover_s, self.deadline_at - now)

    def refusal(self, now: float) -> str | None:
        """Why the deadline cannot be met even on on-demand from now, naming the earliest that can; None if it can."""
        can = self.feasibility(now)
        if can.feasible:
            return None
        left_s = self.deadline_at - now
        when = f"is {duration(left_s)} away" if left_s >= 0 else f"passed {duration(-left_s)} ago"
        return (
            f"{self.field}: {utc(self.deadline_at)} {when}, but on-demand alone needs "
            f"{duration(can.earliest_finish_s)} ({duration(self.compute_s)} of training from {self.compute_from}, "
            f"{duration(self.changeover_s)} to start from {self.changeover_from}): set it to "
            f"{utc(now + can.earliest_finish_s)} or later, or train fewer epochs"
        )

    def situation(self, now: float, progress: Progress, spot_available: bool, mode: Mode = Mode.IDLE) -> Situation:
        return Situation(
            deadline_s=max(self.deadline_at - self.started_at, 1e-9),
            time_left_s=self.deadline_at - now,
            compute_estimate_s=self.compute_s,
            compute_done_s=progress.compute_done_s,
            fraction_done=progress.fraction_done,
            changeover_s=self.changeover_s,
            mode=mode,
            spot_available=spot_available,
        )

    def choose(self, now: float, progress: Progress, spot_available: bool, mode: Mode = Mode.IDLE) -> Choice:
        """What to be on next: asked with no cluster (IDLE: the launch, a relaunch, a wait), and on on-demand with
        spot assumed there (does spot pay: ahead by two changeovers?)."""
        return uniform_progress(self.situation(now, progress, spot_available, mode))

    def lines(self, now: float, on_demand_hourly_usd: float | None = None) -> list[str]:
        """What `gpuflow plan` and the validate task say of the deadline."""
        can = self.feasibility(now)
        bound = (
            f", {dollars(can.on_demand_hours * on_demand_hourly_usd)} on-demand alone" if on_demand_hourly_usd else ""
        )
        return [
            f"deadline {utc(self.deadline_at)}, in {duration(self.deadline_at - now)}: training needs "
            f"{duration(self.compute_s)} ({self.compute_from}), a switch of cluster {duration(self.changeover_s)} "
            f"({self.changeover_from})",
            f"  {can.reason}{bound}; spot while the run keeps pace, on-demand when it falls behind or "
            "must finish (Uniform Progress)",
        ]


def checked_deadline(spec, prediction=None) -> DeadlineClock | None:
    """The spec's deadline from now, refused (SpecError, before anything starts) when on-demand alone cannot meet it;
    None without one."""
    from gpuflow.cluster.spec import SpecError

    clock = DeadlineClock.of(spec, prediction)
    if clock and (refusal := clock.refusal(time.time())):
        raise SpecError([refusal])
    return clock


def deadline_metrics(spec, attempts: list[dict], ended_at: float) -> dict[str, float]:
    """What a deadline's run records at its end: the seconds billed on spot and on-demand, the switches between
    them, and the slack left (negative: the deadline was missed)."""
    if spec.limits.deadline is None:
        return {}
    kinds = [kind_of(a["option"]) for a in attempts]
    launched = [kind for kind in kinds if kind]
    return {
        SPOT_SECONDS: sum(a["seconds"] for a, kind in zip(attempts, kinds, strict=True) if kind == "spot"),
        ON_DEMAND_SECONDS: sum(a["seconds"] for a, kind in zip(attempts, kinds, strict=True) if kind == "on-demand"),
        "deadline_switches": sum(a != b for a, b in zip(launched, launched[1:], strict=False)),
        "deadline_slack_seconds": spec.limits.deadline.timestamp() - ended_at,
    }


def kind_of(option: str) -> str | None:
    """'spot' or 'on-demand' for an attempt's option ('1: aws L4:1 spot'); None for one that never launched."""
    return next((kind for kind in ("on-demand", "spot") if option.endswith(kind)), None)


def utc(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
