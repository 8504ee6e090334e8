"""Quick tier: the deadline policy (cluster/cost/deadline.py) on short synthetic spot traces, one-hour steps, each
case one that greedy (what SkyPilot's managed jobs do) gets wrong or pays more for; and the omniscient bound
(benchmarks/deadline_optimum.py) checked against an exhaustive search."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from benchmarks.deadline_optimum import omniscient
from benchmarks.deadline_sim import simulate
from gpuflow.cluster.cost.deadline import (
    Decision,
    Mode,
    Situation,
    feasibility,
    greedy,
    on_demand_only,
    uniform_progress,
)

H = 3600.0
K = 3  # on-demand / spot price
C_H, R_H, D_H = 10, 20, 1  # compute, time to the deadline, changeover


def play(policy, trace, **changes):
    run = {"step_s": H, "compute_s": C_H * H, "deadline_s": R_H * H, "changeover_s": D_H * H, "on_demand_price": K}
    return simulate(policy, [trace], **{**run, **changes})


def situation(**changes) -> Situation:
    values = {
        "deadline_s": R_H * H,
        "time_left_s": 15 * H,
        "compute_estimate_s": C_H * H,
        "compute_done_s": 1 * H,
        "fraction_done": None,
        "changeover_s": D_H * H,
        "mode": Mode.IDLE,
        "spot_available": False,
        "step_s": H,
    }
    values.update(changes)
    if values["fraction_done"] is None:  # the run's progress, consistent with its compute done
        values["fraction_done"] = values["compute_done_s"] / (C_H * H)
    return Situation(**values)


LATE_SPOT = [False] * 10 + [True] * 10  # no spot for half the window, then spot to the end


def test_late_spot_greedy_idles_to_the_safety_net_and_pays_more_on_demand_than_uniform_progress():
    up, gr, od = play(uniform_progress, LATE_SPOT), play(greedy, LATE_SPOT), play(on_demand_only, LATE_SPOT)
    assert up.met and gr.met and od.met
    assert gr.spot_h == 0 and up.spot_h > 0
    assert up.on_demand_h < gr.on_demand_h
    best = omniscient(np.array([LATE_SPOT]), compute_steps=C_H, changeover_steps=D_H, on_demand_price=K)
    assert best.cost_steps[0] < up.cost < gr.cost <= od.cost


def test_idle_and_behind_uniform_progress_goes_on_demand_where_greedy_waits():
    behind = situation(time_left_s=14 * H, compute_done_s=1 * H)  # ep(6 h) = 3 h, done 1 h
    assert uniform_progress(behind).decision is Decision.ON_DEMAND
    assert greedy(behind).decision is Decision.WAIT
    ahead = situation(time_left_s=18 * H, compute_done_s=2 * H)  # ep(2 h) = 1 h
    assert uniform_progress(ahead).decision is Decision.WAIT


def test_hysteresis_stays_on_on_demand_until_ahead_by_two_changeovers():
    # elapsed 6 h, done 3.5 h: ahead of ep(6 h) = 3 h but not of ep(8 h) = 4 h
    near = situation(time_left_s=14 * H, compute_done_s=3.5 * H, mode=Mode.ON_DEMAND)
    assert uniform_progress(Situation(**{**_fields(near), "spot_available": True})).decision is Decision.ON_DEMAND
    assert greedy(Situation(**{**_fields(near), "spot_available": True})).decision is Decision.SPOT
    far = situation(time_left_s=14 * H, compute_done_s=4 * H, mode=Mode.ON_DEMAND)
    assert uniform_progress(Situation(**{**_fields(far), "spot_available": True})).decision is Decision.SPOT


def _fields(s: Situation) -> dict:
    return {name: getattr(s, name) for name in Situation.__slots__}


def test_the_safety_net_launches_on_demand_rather_than_spot_with_two_changeovers_left():
    # R = C + 2d: a spot launch now could be preempted after its changeover with no time left for another
    edge = situation(time_left_s=11 * H, compute_done_s=1 * H, spot_available=True)
    assert uniform_progress(edge).decision is Decision.ON_DEMAND
    assert greedy(edge).decision is Decision.ON_DEMAND
    on_spot = situation(time_left_s=10 * H, compute_done_s=1 * H, spot_available=True, mode=Mode.SPOT)
    assert uniform_progress(on_spot).decision is Decision.SPOT  # a running spot instance stays


def late(rng: random.Random) -> list[bool]:
    """Spot gone for the first 6-14 steps, then up with one outage of 1-3 steps."""
    gone, outage_at, outage = rng.randint(6, 14), rng.randint(0, 5), rng.randint(1, 3)
    trace = [False] * gone + [True] * (R_H - gone)
    trace[gone + outage_at : gone + outage_at + outage] = [False] * outage
    return trace[:R_H]


def test_when_spot_returns_late_uniform_progress_meets_every_deadline_and_costs_less_than_greedy():
    rng = random.Random(52)
    traces = [late(rng) for _ in range(40)]
    up = [play(uniform_progress, trace) for trace in traces]
    gr = [play(greedy, trace) for trace in traces]
    assert all(outcome.met for outcome in up + gr)
    assert sum(o.cost for o in up) < 0.95 * sum(o.cost for o in gr)
    assert sum(o.spot_h for o in up) > sum(o.spot_h for o in gr)
    best = omniscient(np.array(traces), compute_steps=C_H, changeover_steps=D_H, on_demand_price=K)
    assert all(bound <= outcome.cost + 1e-9 for bound, outcome in zip(best.cost_steps, up, strict=True))


@pytest.mark.parametrize("error", [-0.2, 0.2])
def test_a_misestimated_compute_is_corrected_by_the_measured_progress(error):
    told = C_H * (1 + error) * H
    up = play(uniform_progress, LATE_SPOT, compute_estimate_s=told)
    assert up.met and up.cost < play(greedy, LATE_SPOT).cost
    if error < 0:  # by C(0) alone, the run looks done at 8 h of its 10 and waits past its deadline
        assert not play(uniform_progress, LATE_SPOT, compute_estimate_s=told, measured=False).met


def test_feasibility_refuses_a_deadline_on_demand_cannot_meet_and_names_the_earliest():
    tight = feasibility(compute_s=48 * H, changeover_s=0.2 * H, time_to_deadline_s=48 * H)
    assert not tight.feasible and tight.earliest_finish_s == pytest.approx(48.2 * H)
    assert tight.slack_s == pytest.approx(-0.2 * H)
    loose = feasibility(compute_s=48 * H, changeover_s=0.2 * H, time_to_deadline_s=60 * H)
    assert loose.feasible and loose.slack_s == pytest.approx(11.8 * H)


def exhaustive(trace, compute_steps, changeover_steps, price):
    """The cheapest (cost, −spot steps) over every sequence of idle / spot / on-demand choices."""
    best = None
    for choices in itertools.product(range(3), repeat=len(trace)):
        mode = over = done = cost = spot = 0
        for t, choice in enumerate(choices):
            if done >= compute_steps:
                break
            if mode == 1 and not trace[t]:
                mode = 0
            if choice == 1 and not trace[t]:
                break
            if choice != mode:
                mode, over = choice, (changeover_steps if choice else 0)
            if mode:
                cost += 1 if mode == 1 else price
                if over:
                    over -= 1
                else:
                    done, spot = done + 1, spot + (mode == 1)
        if done >= compute_steps and (best is None or (cost, -spot) < best):
            best = (cost, -spot)
    return best


def test_the_omniscient_bound_is_the_exhaustive_optimum():
    rng = np.random.default_rng(7)
    for _ in range(12):
        trace = rng.random(7) < 0.5
        compute_steps, changeover_steps = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        expected = exhaustive(trace, compute_steps, changeover_steps, K)
        got = omniscient(
            trace[None, :], compute_steps=compute_steps, changeover_steps=changeover_steps, on_demand_price=K
        )
        if expected is None:
            assert not np.isfinite(got.cost_steps[0])
        else:
            assert (got.cost_steps[0], -got.spot_steps[0]) == expected
