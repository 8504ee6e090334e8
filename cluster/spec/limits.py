"""The spec's limits (what a run may cost, how long it may run and wait) and its profiler section."""

from __future__ import annotations

from datetime import datetime

from pydantic import AwareDatetime, Field, field_validator

from gpuflow.cluster.spec.fields import Amount, Count, Strict


class LimitsSpec(Strict):
    max_runtime_minutes: Amount(le=43_200) = Field(
        60, description="Stop the job and tear down after this long (at most 30 days)."
    )
    max_cost_usd: Amount(le=10_000_000) | None = Field(None, description="Refuse or stop the run above this cost.")
    idle_minutes_to_autostop: Count(1, 10_080) = Field(
        10, description="A cloud cluster deletes itself after this many idle minutes."
    )
    hourly_rate_usd: Amount(le=100_000, ge=0) | None = Field(
        None, description="Price of the cluster per hour when no catalog knows it (e.g. local)."
    )
    min_gpu_utilization: Amount(le=100) | None = Field(None, description="Stop when GPU use stays below this percent.")
    idle_gpu_minutes: Amount(le=10_080) = Field(10, description="How long GPU use may stay under min_gpu_utilization.")
    hung_minutes: Amount(le=10_080) | None = Field(
        None,
        description="Stop the run (stopped_by=hung, each worker's stack saved to MLflow) when the loop has not "
        "reported for this long, counted from its first report. Unset: 5x the longest gap between its reports, at "
        "least 10 min, once it has reported twice.",
    )
    max_queue_minutes: Amount(le=10_080) = Field(
        60,
        description="Wait at most this long for the team's GPU quota, and again for capacity when no "
        "compute option has any, then fail (nothing started, nothing billed).",
    )
    orphan_grace_minutes: Amount(le=60) = Field(
        2,
        description="The job stops itself (checkpoints kept, MLflow run FAILED, stopped_by=orphaned) when the flow "
        "has not renewed its lease for this long: the flow process was killed, frozen or cut off.",
    )
    deadline: AwareDatetime | None = Field(
        None,
        description="Finish by this time, with its zone (e.g. 2026-12-24T09:00:00Z): spot while it pays, "
        "on-demand when the run must catch up (docs/deadline.md). Needs a spot option.",
    )
    finish_within_hours: Amount(le=720) | None = Field(
        None, description="Finish within this many hours of the run's start: a deadline the run fixes as it starts."
    )
    changeover_minutes: Amount(le=1440) | None = Field(
        None,
        description="What one switch of cluster costs a deadline's run (provision, setup, checkpoint reload, work "
        "redone). Unset: this loop's past provision and first epoch, else a default per backend.",
    )

    @field_validator("deadline", mode="before")
    @classmethod
    def _deadline_has_a_zone(cls, value):
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                raise ValueError(f"{value!r} is not a time; write it as 2026-12-24T09:00:00Z") from None
        if isinstance(value, datetime) and value.tzinfo is None:
            raise ValueError(
                f"{value.isoformat()!r} has no time zone; add one, e.g. {value.isoformat()}Z (UTC) or "
                f"{value.isoformat()}+01:00"
            )
        return value


class ProfileSpec(Strict):
    steps: Count(1, 1000) = Field(20, description="Training steps rank 0 records with torch.profiler (CPU and CUDA).")
    after: Count(0, 1_000_000) = Field(
        5, description="Steps to skip first, so that the trace shows warm steps, not start-up."
    )


def deadline_problems(spec) -> list[tuple[str, str]]:
    """A deadline chooses between spot and on-demand as the run goes: it needs spot to choose, and it replaces the
    fixed spot fallback. (Whether it can be met is checked against the clock at validate, not here: a node loads
    the spec later.)"""
    limits, compute = spec.limits, spec.compute
    field = "limits.deadline" if limits.deadline else "limits.finish_within_hours"
    if limits.deadline is None and limits.finish_within_hours is None:
        return []
    if limits.deadline and limits.finish_within_hours:
        return [(field, "set limits.deadline or limits.finish_within_hours, not both")]
    problems = []
    spot = [compute.use_spot if option.use_spot is None else option.use_spot for option in compute.options or []]
    if spot and not all(spot):  # SkyPilot would fail over from spot to on-demand by itself, before the deadline asks
        problems.append(
            (
                "compute.options",
                f"{field} chooses on-demand itself: give spot options only (their on-demand twins come with them)",
            )
        )
    elif not (compute.use_spot or any(spot)):
        where = "compute.backend: skypilot and " if compute.backend == "local" else ""  # the local one has no spot
        problems.append(
            (
                field,
                f"a deadline chooses between spot and on-demand as the run goes: set {where}compute.use_spot: true "
                "(or an option with use_spot: true); on-demand alone has nothing to choose",
            )
        )
    if compute.spot_fallback_after is not None:
        problems.append(
            ("compute.spot_fallback_after", f"{field} decides when to go on-demand; remove spot_fallback_after")
        )
    if spec.sweep is not None:
        problems.append((field, "a deadline is for one training run; remove it from a sweep's spec"))
    return problems
