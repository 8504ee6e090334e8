"""A run with a deadline played against a spot availability trace, one decision a trace step, by the policies of
`gpuflow.cluster.cost.deadline` (the module the flow calls): what it ran on, what it paid, whether it finished.

The model is that of Wu et al., "Can't Be Late" (NSDI '24): a changeover (any launch, spot or on-demand, and the
relaunch after a preemption) bills for d with no progress; a spot instance is preempted at the first step its zone
has no capacity; idle costs nothing. Several zones make the multi-region version: spot can be had when any zone has
it, a launch takes the cheapest zone that has it, and a preemption comes when that zone loses it (as gpuflow's
failover does). Pure Python: the quick-tier tests (tests/test_deadline.py) run it on short synthetic traces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuflow.cluster.cost.deadline import Choice, Decision, Mode, Situation

MODE_OF = {Decision.WAIT: Mode.IDLE, Decision.SPOT: Mode.SPOT, Decision.ON_DEMAND: Mode.ON_DEMAND}


@dataclass(frozen=True)
class Outcome:
    spot_h: float  # productive hours on spot
    on_demand_h: float  # productive hours on on-demand
    spot_billed_h: float  # billed hours, changeovers included
    on_demand_billed_h: float
    cost: float  # at the prices given (spot 1, on-demand k: in spot-hours)
    finish_s: float | None  # from the start; None: not finished by the deadline
    changeovers: int

    @property
    def met(self) -> bool:
        return self.finish_s is not None


def simulate(
    policy: Callable[[Situation], Choice],
    zones: Sequence[Sequence[bool]],
    *,
    step_s: float,
    compute_s: float,
    deadline_s: float,
    changeover_s: float,
    on_demand_price: float,
    spot_prices: Sequence[float] | None = None,
    compute_estimate_s: float | None = None,
    measured: bool = True,
) -> Outcome:
    """Plays `policy` on `zones` (each a list of "spot can be had" per step, from the run's start).

    `compute_estimate_s` is the C(0) the policy is told (default: the truth); `measured` gives it the run's own
    progress (the fraction of its steps done), else it must go by C(0) minus the compute done.
    """
    prices = list(spot_prices) if spot_prices is not None else [1.0] * len(zones)
    estimate_s = compute_s if compute_estimate_s is None else compute_estimate_s
    mode, zone, overhead_s, done_s, changeovers = Mode.IDLE, -1, 0.0, 0.0, 0
    productive = {Mode.SPOT: 0.0, Mode.ON_DEMAND: 0.0}
    billed = {Mode.SPOT: 0.0, Mode.ON_DEMAND: 0.0}
    cost = 0.0
    steps = int(deadline_s // step_s + 1e-9)
    finish_s = None
    for i in range(steps):
        if done_s >= compute_s - 1e-6:
            break
        if mode is Mode.SPOT and not zones[zone][i]:  # preempted: the changeover's progress lost with it
            mode, overhead_s = Mode.IDLE, 0.0
        available = [z for z in range(len(zones)) if zones[z][i]]
        situation = Situation(
            deadline_s=deadline_s,
            time_left_s=deadline_s - i * step_s,
            compute_estimate_s=estimate_s,
            compute_done_s=done_s,
            fraction_done=done_s / compute_s if measured else None,
            changeover_s=changeover_s,
            mode=mode,
            spot_available=bool(available),
            step_s=step_s,
        )
        wanted = MODE_OF[policy(situation).decision]
        if wanted is Mode.SPOT and not available:
            wanted = Mode.IDLE  # asked for spot that cannot be had: nothing launches
        if wanted is not mode:
            mode = wanted
            if mode is not Mode.IDLE:
                overhead_s, changeovers = changeover_s, changeovers + 1
                if mode is Mode.SPOT:
                    zone = min(available, key=lambda z: prices[z])
        if mode is Mode.IDLE:
            continue
        lost_s = min(overhead_s, step_s)
        overhead_s -= lost_s
        work_s = min(step_s - lost_s, compute_s - done_s)
        done_s += work_s
        productive[mode] += work_s
        billed[mode] += lost_s + work_s
        cost += (lost_s + work_s) / 3600 * (prices[zone] if mode is Mode.SPOT else on_demand_price)
        if done_s >= compute_s - 1e-6:
            finish_s = i * step_s + lost_s + work_s
    return Outcome(
        spot_h=productive[Mode.SPOT] / 3600,
        on_demand_h=productive[Mode.ON_DEMAND] / 3600,
        spot_billed_h=billed[Mode.SPOT] / 3600,
        on_demand_billed_h=billed[Mode.ON_DEMAND] / 3600,
        cost=cost,
        finish_s=finish_s,
        changeovers=changeovers,
    )
