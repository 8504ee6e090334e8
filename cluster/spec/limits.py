"""The spec's limits (what a run may cost, how long it may run and wait) and its profiler section."""

from __future__ import annotations

from pydantic import Field

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


class ProfileSpec(Strict):
    steps: Count(1, 1000) = Field(20, description="Training steps rank 0 records with torch.profiler (CPU and CUDA).")
    after: Count(0, 1_000_000) = Field(
        5, description="Steps to skip first, so that the trace shows warm steps, not start-up."
    )
