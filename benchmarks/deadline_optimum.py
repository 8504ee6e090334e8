"""The omniscient bound of a run with a deadline: the cheapest schedule over a spot trace that knows its future.

An exact dynamic program over (step, progress in steps, mode), the mode being idle or a spot or on-demand instance
with the changeover steps it still has to go; the model is `benchmarks/deadline_sim.py`'s (Wu et al., "Can't Be
Late", NSDI '24, solve it as an integer program). Vectorized with numpy over the start points: one array of
(start point, progress) a mode, one step at a time. Costs and spot steps are packed in one number (cost × 1024 +
1023 − spot steps) so that a plain minimum takes the cheapest schedule and, of those, the one with the most spot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACK = 1024  # more than the progress steps of any run simulated here


@dataclass(frozen=True)
class Optimum:
    cost_steps: np.ndarray  # per start point: billed steps, each at its price (spot 1), inf where infeasible
    spot_steps: np.ndarray  # per start point: productive steps on spot


def omniscient(
    available: np.ndarray, *, compute_steps: int, changeover_steps: int, on_demand_price: int, spot_price: int = 1
) -> Optimum:
    """`available`: (start points, steps) of spot-can-be-had; the deadline is the last step. Prices a step are
    integers so that the packed numbers stay exact; cost_steps is in their unit."""
    starts, steps = available.shape
    if compute_steps >= PACK:
        raise ValueError(f"compute_steps {compute_steps} >= {PACK}: the packing would overflow")
    inf = np.inf
    width = compute_steps + 1
    spot_tick = spot_price * PACK - 1  # a productive spot step: its price, and one more spot step
    phases = changeover_steps  # index j: j changeover steps still to go after this one (0: running)
    idle = np.full((starts, width), inf)
    idle[:, 0] = (PACK - 1) * 1.0
    spot = [np.full((starts, width), inf) for _ in range(phases)] if phases else [np.full((starts, width), inf)]
    od = [np.full((starts, width), inf) for _ in range(len(spot))]
    for t in range(steps):
        gone = ~available[:, t]
        best = idle.copy()
        for state in (*spot, *od):
            np.minimum(best, state, out=best)
        spot, od = (
            _advance(spot, best, spot_price * PACK, spot_tick),
            _advance(od, best, on_demand_price * PACK, on_demand_price * PACK),
        )
        for state in spot:
            state[gone] = inf
        idle = best
    final = idle[:, compute_steps].copy()
    for state in (*spot, *od):
        np.minimum(final, state[:, compute_steps], out=final)
    feasible = np.isfinite(final)
    packed = np.where(feasible, final, 0).astype(np.int64)
    spot_steps = np.where(feasible, PACK - 1 - packed % PACK, 0)
    return Optimum(np.where(feasible, packed // PACK, inf), spot_steps)


def _advance(chain: list[np.ndarray], best: np.ndarray, waiting: float, running: float) -> list[np.ndarray]:
    """One step of an instance type: launch from anything (the first changeover step), changeover steps counted
    down, a running instance one step of progress further (the done column stays done)."""
    phases = len(chain)
    launched = best + waiting
    new = [None] * phases
    top = phases - 1
    for j in range(phases):
        candidates = []
        if j == top and phases > 1:
            candidates.append(launched)
        if j + 1 < phases:
            candidates.append(chain[j + 1] + waiting)
        if j == 0:
            moved = np.full_like(best, np.inf)
            moved[:, 1:] = chain[0][:, :-1] + running
            candidates.append(moved)
            if phases == 1:
                candidates.append(launched)
        new[j] = candidates[0] if len(candidates) == 1 else np.minimum.reduce(candidates)
    return new
