"""Finishing a run by its deadline at the lowest cost: which instance to be on now (spot, on-demand or none).

The model and the policies are those of Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under
Deadlines" (NSDI '24): C(t) the compute still needed, R(t) the time left to the deadline, d the changeover delay of a
switch (provision, setup, checkpoint reload and the progress lost since the last checkpoint: the clock runs and the
new instance bills, but no progress is made). On-demand is always there; spot comes and goes.

- Greedy, what SkyPilot's managed jobs do: spot whenever it can be had, wait otherwise, until the safety net.
- Uniform Progress, the paper's: track the line from (0, 0) to (R(0), C(0)); behind and idle, go on-demand; spot
  whenever it can be had (and stay on it until preempted); leave on-demand for spot only when ahead by two
  changeovers (hysteresis); the safety net on top.
- On-demand only, the bound a deadline's cost is checked against.

The safety net (every policy): once R(t) <= C(t) + 2d, idle or on on-demand, go on-demand and stay to the end; a
spot instance already running keeps running (one changeover's slack is left for its preemption). That is what
guarantees the deadline, provided R(0) >= C(0) + d (`feasibility`).

Pure functions of a frozen `Situation`, so that the flow and `benchmarks/deadline_spot.py` call the same code.
Progress is the run's own: C(t) comes from the compute done and the fraction of the run's steps done, so that a
misestimated C(0) corrects itself as the run goes (C(0) alone is used only before any progress is measured).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Mode(enum.Enum):
    """What the run is on now (a preempted spot instance is IDLE)."""

    IDLE = "idle"
    SPOT = "spot"
    ON_DEMAND = "on_demand"


class Decision(enum.Enum):
    """What to be on for the next step; WAIT holds nothing (and pays nothing)."""

    WAIT = "wait"
    SPOT = "spot"
    ON_DEMAND = "on_demand"


@dataclass(frozen=True, slots=True)
class Situation:
    """The run's situation as its flow (or the simulator) sees it at one decision."""

    deadline_s: float  # R(0): from the run's start to its deadline
    time_left_s: float  # R(t)
    compute_estimate_s: float  # C(0) as predicted before the run (from history or the spec)
    compute_done_s: float  # productive compute so far (changeovers and redone work excluded)
    fraction_done: float | None  # the run's steps (or epochs) done / its total; None where not measured
    changeover_s: float  # d
    mode: Mode
    spot_available: bool  # can a spot instance be had now
    step_s: float = 0.0  # the decision step: time left rounds down, time needed up, to it (0: no rounding)

    @property
    def elapsed_s(self) -> float:
        return self.deadline_s - self.time_left_s

    @property
    def compute_total_s(self) -> float:
        """C(0) as the run's progress measures it: the compute done over the fraction it is of the run."""
        if self.fraction_done and self.fraction_done > 0 and self.compute_done_s > 0:
            return self.compute_done_s / min(self.fraction_done, 1.0)
        return max(self.compute_estimate_s, self.compute_done_s)

    @property
    def compute_left_s(self) -> float:
        """C(t)."""
        if self.fraction_done is not None and self.fraction_done >= 1.0:
            return 0.0
        return max(self.compute_total_s - self.compute_done_s, 0.0)


@dataclass(frozen=True)
class Choice:
    decision: Decision
    reason: str


def _down(seconds: float, step_s: float) -> float:
    return math.floor(seconds / step_s + 1e-9) * step_s if step_s > 0 else seconds


def _up(seconds: float, step_s: float) -> float:
    return math.ceil(seconds / step_s - 1e-9) * step_s if step_s > 0 else seconds


def safety_net(s: Situation) -> bool:
    """R(t) <= C(t) + 2d, rounded to the decision step against the run: from here on-demand, to the end."""
    return _up(s.compute_left_s + 2 * s.changeover_s, s.step_s) >= _down(s.time_left_s, s.step_s)


def expected_progress_s(s: Situation, at_elapsed_s: float) -> float:
    """ep(t) = t * C(0) / R(0): where uniform progress would have the run by then."""
    return at_elapsed_s * s.compute_total_s / s.deadline_s if s.deadline_s > 0 else s.compute_total_s


def kept_by_every_policy(s: Situation) -> Choice | None:
    """The rules every policy keeps, in their order: thrifty (done: hold nothing), exploitation (on spot: stay until
    preempted; also within the last changeover's slack, where a switch could only lose time) and the safety net.
    None where none of them decides."""
    if s.compute_left_s <= 0:
        return Choice(Decision.WAIT, "done")
    if s.mode is Mode.SPOT:
        return Choice(Decision.SPOT, "on spot: stay until preempted")
    if safety_net(s):
        return Choice(Decision.ON_DEMAND, "safety net: R <= C + 2d, on-demand to the end")
    return None


def greedy(s: Situation) -> Choice:
    """SkyPilot's managed jobs: spot whenever it can be had, else wait, until the safety net."""
    if kept := kept_by_every_policy(s):
        return kept
    if s.spot_available:
        return Choice(Decision.SPOT, "spot, if it can be had")
    return Choice(Decision.WAIT, "no spot: wait")


def uniform_progress(s: Situation) -> Choice:
    """The paper's Uniform Progress, with its hysteresis and the safety net."""
    if kept := kept_by_every_policy(s):
        return kept
    progress_s = s.compute_done_s
    if s.spot_available:
        ahead_s = progress_s - expected_progress_s(s, s.elapsed_s + 2 * s.changeover_s)
        if s.mode is Mode.ON_DEMAND and ahead_s < 0:
            return Choice(Decision.ON_DEMAND, "on on-demand, not ahead by two changeovers: stay")
        return Choice(Decision.SPOT, "spot, if it can be had")
    if s.mode is Mode.ON_DEMAND:
        return Choice(Decision.ON_DEMAND, "on on-demand, no spot: stay")
    if progress_s < expected_progress_s(s, s.elapsed_s):
        return Choice(Decision.ON_DEMAND, "behind uniform progress, no spot: on-demand")
    return Choice(Decision.WAIT, "ahead of uniform progress: wait for spot")


def on_demand_only(s: Situation) -> Choice:
    if s.compute_left_s <= 0:
        return Choice(Decision.WAIT, "done")
    return Choice(Decision.ON_DEMAND, "on-demand only")


POLICIES = {"greedy": greedy, "uniform_progress": uniform_progress, "on_demand": on_demand_only}


@dataclass(frozen=True)
class Feasibility:
    """Whether on-demand alone finishes by the deadline, checked before the run (at validate, in `gpuflow plan`)."""

    feasible: bool
    slack_s: float  # time to the deadline less what on-demand needs (negative: infeasible)
    earliest_finish_s: float  # from now, on on-demand at once: the earliest deadline that can be met
    on_demand_hours: float  # billed hours of the on-demand bound (its cost at the on-demand price)
    reason: str


def feasibility(compute_s: float, changeover_s: float, time_to_deadline_s: float) -> Feasibility:
    """On-demand at once needs one changeover and then C(0); any deadline before that is refused."""
    needed_s = compute_s + changeover_s
    slack_s = time_to_deadline_s - needed_s
    if slack_s < 0:
        reason = f"infeasible: on-demand alone needs {needed_s / 3600:.2f} h, the deadline is in"
        reason += f" {time_to_deadline_s / 3600:.2f} h"
    else:
        reason = f"feasible: {slack_s / 3600:.2f} h of slack over on-demand alone"
    return Feasibility(slack_s >= 0, slack_s, needed_s, needed_s / 3600, reason)
