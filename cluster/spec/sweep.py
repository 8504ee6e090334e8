"""A sweep's arithmetic: which fields it may vary, what its trials' values make of the train section, how long and how
many rounds it takes, and what it asks that the rest of the spec cannot give."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from gpuflow.cluster.spec import fields as checks
from gpuflow.cluster.spec.fields import Amount, Count, Strict, cut

if TYPE_CHECKING:
    from gpuflow.cluster.spec.model import ExperimentSpec, TrainSpec

SWEEPABLE = ("train.lr", "train.epochs", "train.batch_size")  # and train.params.<a key train.params holds>


SweepValues = Annotated[list[Any], Field(min_length=1, max_length=1000)]


class SweepParameter(Strict):
    """How one spec field varies across trials: exactly one of grid, choice, uniform, loguniform."""

    grid: SweepValues | None = Field(None, description="Every value, each in its own trial (× the other grids).")
    choice: SweepValues | None = Field(None, description="One value drawn at random per sample.")
    uniform: Annotated[list[float], Field(min_length=2, max_length=2)] | None = Field(
        None, description="[low, high]: a number drawn uniformly per sample."
    )
    loguniform: Annotated[list[float], Field(min_length=2, max_length=2)] | None = Field(
        None, description="[low, high]: a positive number drawn uniformly on a log scale per sample."
    )

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [kind for kind in ("grid", "choice", "uniform", "loguniform") if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of grid, choice, uniform, loguniform (got {given or 'none'}), "
                "e.g. {grid: [0.001, 0.01]}"
            )
        for kind in ("uniform", "loguniform"):
            low_high = getattr(self, kind)
            if low_high and not (low_high[0] < low_high[1] and (kind == "uniform" or low_high[0] > 0)):
                raise ValueError(
                    f"{kind} {low_high} must be [low, high] with low < high"
                    + (" and low > 0" if kind == "loguniform" else "")
                )
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in ("grid", "choice", "uniform", "loguniform") if getattr(self, kind) is not None)

    def edge_values(self) -> list:
        """Every value a trial can get, or a range's two ends: what the spec's own field checks must accept."""
        return list(getattr(self, self.kind))


class EarlyStoppingSpec(Strict):
    grace_epochs: Count(1, 100_000) = Field(
        1, description="Epochs every trial runs before ASHA may stop it for trailing the others."
    )
    reduction_factor: Amount(le=100, gt=1) = Field(
        3, description="ASHA keeps about 1 in this many trials at each rung (grace_epochs × factor^k epochs)."
    )


class SweepSpec(Strict):
    """A hyper-parameter sweep: many trials (each a Ray Train run) on the one cluster, by Ray Tune."""

    parameters: Annotated[dict[str, SweepParameter], Field(min_length=1, max_length=50)] = Field(
        description="Spec field → how it varies, e.g. {'train.lr': {grid: [0.001, 0.01]}}; fields: "
        + ", ".join(SWEEPABLE)
        + ", train.params.<key>."
    )
    num_samples: Count(1, 10_000) = Field(
        1, description="Times the whole grid is repeated (choices drawn anew each time)."
    )
    metric: Annotated[str, Field(min_length=1, max_length=250)] = Field(
        description="The reported metric that ranks trials, e.g. val_accuracy."
    )
    mode: Literal["max", "min"] = Field("max", description="Whether a higher (max) or lower (min) metric is better.")
    max_concurrent_trials: Count(1, 1000) = Field(1, description="Trials running at once on the cluster.")
    workers_per_trial: Count(1, 512 * 64) | None = Field(
        None, description="Ray Train workers of each trial; defaults to compute.num_workers ÷ max_concurrent_trials."
    )
    max_trial_minutes: Amount(le=43_200) | None = Field(
        None,
        description="A trial still reporting after this long is stopped; also what `gpuflow plan` bounds "
        "the sweep's cost with. Unset: only limits.max_runtime_minutes bounds the sweep.",
    )
    early_stopping: EarlyStoppingSpec | None = Field(
        None, description="Stop trials that trail the others early (ASHA); unset: every trial runs all its epochs."
    )

    @property
    def num_trials(self) -> int:
        return math.prod(len(p.grid) for p in self.parameters.values() if p.grid is not None) * self.num_samples


def sweep_problems(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """(field, problem) for what a sweep asks that the rest of the spec cannot give: unknown fields, values the
    field refuses, a concurrency the cluster cannot hold, early stopping that could never stop anything."""
    sweep, problems = spec.sweep, []
    for path, parameter in sweep.parameters.items():
        field = f"sweep.parameters.{cut(path, 60)}"
        key = path.removeprefix("train.params.")
        if path.startswith("train.params.") and key not in spec.train.params:
            problems.append(
                (
                    field,
                    f"train.params has no {checks.shorten(key, 60)} (it has "
                    f"{', '.join(sorted(spec.train.params)) or 'none'}); give it a default there or "
                    "fix the name",
                )
            )
        elif not path.startswith("train.params.") and path not in SWEEPABLE:
            problems.append(
                (field, f"not a field a sweep can vary; use one of {', '.join(SWEEPABLE)} or train.params.<key>")
            )
        else:
            for value in parameter.edge_values():
                try:
                    trial_train(spec.train, {path: value})
                except ValidationError as exc:
                    problems.append(
                        (
                            field,
                            f"{parameter.kind} value {checks.shorten(value, 60)} is not a valid "
                            f"{path}: {cut(exc.errors()[0]['msg'], 120)}; fix or remove it",
                        )
                    )
                    break
    if spec.compute.min_workers:
        problems.append(
            (
                "compute.num_workers",
                "an elastic range [min, max] is for one training run, not a sweep's "
                f"trials; give a fixed num_workers: {spec.compute.num_workers}",
            )
        )
    workers = spec.workers_per_trial * sweep.max_concurrent_trials
    if workers > spec.compute.num_workers:
        problems.append(
            (
                "sweep.max_concurrent_trials",
                (
                    f"{sweep.max_concurrent_trials} trials × {spec.workers_per_trial} worker(s) need {workers} "
                    f"workers, the cluster has compute.num_workers={spec.compute.num_workers}; lower "
                    "max_concurrent_trials or workers_per_trial, or add workers"
                ),
            )
        )
    if sweep.max_trial_minutes and sweep_minutes(spec) > spec.limits.max_runtime_minutes:
        problems.append(
            (
                "sweep.max_trial_minutes",
                (
                    f"{sweep.num_trials} trials, {sweep.max_concurrent_trials} at a time, of up to "
                    f"{sweep.max_trial_minutes:g} min each may take {sweep_minutes(spec):g} min, but "
                    f"limits.max_runtime_minutes={spec.limits.max_runtime_minutes:g} stops the sweep before; raise "
                    f"max_runtime_minutes to {sweep_minutes(spec):g} or lower max_trial_minutes"
                ),
            )
        )
    if not problems and sweep.early_stopping and sweep.early_stopping.grace_epochs >= max_epochs(spec):
        problems.append(
            (
                "sweep.early_stopping.grace_epochs",
                (
                    f"{sweep.early_stopping.grace_epochs} is not below the trials' {max_epochs(spec)} epochs, so no "
                    "trial could stop early; lower it or remove early_stopping"
                ),
            )
        )
    return problems


def trial_train(train: TrainSpec, values: dict[str, Any]) -> TrainSpec:
    """The train section of one trial: the spec's, with the trial's values at their dotted paths (train.*)."""
    fields = train.model_dump()
    for path, value in values.items():
        *parents, leaf = path.removeprefix("train.").split(".")
        node = fields
        for part in parents:
            node = node[part]
        node[leaf] = value
    return type(train).model_validate(fields)


def sweep_rounds(spec: ExperimentSpec) -> int:
    """How many rounds of max_concurrent_trials trials the sweep runs."""
    return math.ceil(spec.sweep.num_trials / spec.sweep.max_concurrent_trials)


def sweep_minutes(spec: ExperimentSpec) -> float:
    """The longest a sweep's trials can take: its rounds, each up to max_trial_minutes (without max_trial_minutes:
    limits.max_runtime_minutes). The bill is also capped by limits.max_runtime_minutes: `billed_sweep_minutes`."""
    if not spec.sweep.max_trial_minutes:
        return spec.limits.max_runtime_minutes
    return sweep_rounds(spec) * spec.sweep.max_trial_minutes


def billed_sweep_minutes(spec: ExperimentSpec) -> float:
    """The most minutes a sweep can bill: its trials' time, capped by limits.max_runtime_minutes (it ends the job)."""
    return min(sweep_minutes(spec), spec.limits.max_runtime_minutes)


def max_epochs(spec: ExperimentSpec) -> int:
    """The most epochs any trial trains (train.epochs may be swept)."""
    varied = spec.sweep.parameters.get("train.epochs") if spec.sweep else None
    return max(varied.edge_values()) if varied else spec.train.epochs
