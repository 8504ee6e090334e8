"""How long a run will take and what it will cost, predicted from past runs of the same loop on the same hardware.

    gpuflow plan experiments/digits.yaml     # "predicted wall 41 s (38–45 s) from 3 runs ...", or the bound only

The decision is pure (past runs' figures + the spec → a Prediction): cluster/cost/history.py reads the figures
from MLflow. Each past run is projected to the spec's epochs (its wall time, plus or minus its own later-epoch
time for each epoch more or fewer), and the prediction is the median of those projections, with their range.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gpuflow.cluster.cost.pricing import Estimate
from gpuflow.cluster.spec import ExperimentSpec

HISTORY_RUNS = 10  # the newest finished runs a prediction is made from


@dataclass(frozen=True)
class Identity:
    """What makes runs comparable: the same loop (its file's digest) on the same hardware."""

    loop_digest: str
    hardware: str


@dataclass(frozen=True)
class PastRun:
    """One finished run's figures, in seconds (None: not recorded)."""

    run_id: str
    name: str
    identity: Identity
    epochs: int
    wall_s: float
    provision_s: float | None = None
    first_epoch_s: float | None = None
    epoch_s: float | None = None  # the median of its epochs after the first
    teardown_s: float | None = None
    started_at: float = 0.0  # epoch seconds: the newest runs count

    def per_epoch_s(self) -> float | None:
        return self.epoch_s if self.epoch_s is not None else self.first_epoch_s

    def wall_for(self, epochs: int) -> float | None:
        """Its wall time had it trained `epochs` epochs; None when it cannot be scaled (no epoch time recorded)."""
        if epochs == self.epochs:
            return self.wall_s
        per_epoch = self.per_epoch_s()
        return None if per_epoch is None else max(0.0, self.wall_s + (epochs - self.epochs) * per_epoch)


@dataclass(frozen=True)
class Span:
    """A figure as the median of the history, with its range (min–max)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Span | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None

    def scaled(self, factor: float) -> Span:
        return Span(self.median * factor, self.low * factor, self.high * factor)


@dataclass(frozen=True)
class Prediction:
    epochs: int
    based_on: tuple[PastRun, ...] = ()
    wall: Span | None = None
    provision: Span | None = None
    first_epoch: Span | None = None
    later_epochs: Span | None = None  # all epochs after the first together
    teardown: Span | None = None
    why_bound_only: str = ""

    @property
    def known(self) -> bool:
        return self.wall is not None

    def cost(self, estimate: Estimate) -> Span | None:
        """The bill: the predicted wall time (provision to teardown, a little more than what is billed) × the price."""
        return self.wall.scaled(estimate.hourly_usd / 3600) if self.wall else None

    def cost_usd(self, estimate: Estimate) -> float | None:
        cost = self.cost(estimate)
        return cost.median if cost else None

    def lines(self, estimate: Estimate | None = None) -> list[str]:
        """What `gpuflow plan` and the validate task say."""
        if not self.known:
            return [f"prediction: no history: bound only ({self.why_bound_only})"]
        names = ", ".join(run.name for run in self.based_on)
        lines = [
            f"predicted wall time {span_text(self.wall, duration)} from {len(self.based_on)} past run(s) of this "
            f"loop on this hardware: {names}",
            "  " + ", ".join(f"{label} {span_text(span, duration)}" for label, span in self.parts() if span),
        ]
        if estimate is not None and estimate.hourly_usd > 0:
            lines.append(f"  predicted cost {span_text(self.cost(estimate), dollars)} at ${estimate.hourly_usd:.4g}/h")
        return lines

    def parts(self) -> list[tuple[str, Span | None]]:
        return [
            ("provision", self.provision),
            ("first epoch", self.first_epoch),
            (f"{self.epochs - 1} more epoch(s)", self.later_epochs if self.epochs > 1 else None),
            ("teardown", self.teardown),
        ]

    def refusal_note(self, estimate: Estimate, room_usd: float, room: str) -> str:
        """For a budget refusal: "predicted $41 (from 5 runs), budget left $30"; empty without history."""
        cost = self.cost(estimate)
        if cost is None:
            return ""
        return (
            f" (predicted {span_text(cost, dollars)} from {len(self.based_on)} past run(s), {room} "
            f"${room_usd:.2f}; the refusal is on the bound, which the run's limits enforce)"
        )


def predict(history: list[PastRun], spec: ExperimentSpec, identity: Identity, limit: int = HISTORY_RUNS) -> Prediction:
    """The spec's run predicted from the newest `limit` finished runs of the same loop on the same hardware."""
    epochs = spec.train.epochs
    if spec.sweep is not None:
        return Prediction(epochs, why_bound_only="a sweep's trials are not predicted from past runs")
    same = sorted(
        (run for run in history if run.identity == identity and run.wall_for(epochs) is not None),
        key=lambda run: run.started_at,
        reverse=True,
    )[:limit]
    if not same:
        return Prediction(
            epochs,
            why_bound_only=f"no finished run of this loop ({identity.loop_digest}) on this "
            f"hardware ({identity.hardware})",
        )
    return Prediction(
        epochs,
        tuple(same),
        wall=Span.of([run.wall_for(epochs) for run in same]),
        provision=Span.of(present(run.provision_s for run in same)),
        first_epoch=Span.of(present(run.first_epoch_s for run in same)),
        later_epochs=Span.of(
            present(None if run.per_epoch_s() is None else run.per_epoch_s() * (epochs - 1) for run in same)
        ),
        teardown=Span.of(present(run.teardown_s for run in same)),
    )


def present(values) -> list[float]:
    return [value for value in values if value is not None]


def span_text(span: Span, unit) -> str:
    low, high = unit(span.low), unit(span.high)
    if low == high:
        return unit(span.median)
    suffix = " " + high.rsplit(" ", 1)[-1] if " " in high else ""
    if suffix and low.endswith(suffix):  # "40–50 s", not "40 s–50 s"
        low = low.removesuffix(suffix)
    return f"{unit(span.median)} ({low}–{high})"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def dollars(usd: float) -> str:
    return f"${usd:.2f}" if usd >= 0.1 else f"${usd:.4f}"
