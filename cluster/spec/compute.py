"""The spec's compute section: what a run runs on. Nodes and workers per node (or an elastic range of workers),
accelerators, the places to run (options) and spot, the recoveries from a lost cluster and the restarts of crashed
workers.

    compute: {backend: skypilot, num_nodes: 2, workers_per_node: 8, accelerators: 'H100:8', use_spot: true}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictInt, ValidationError, field_validator, model_validator

from gpuflow.cluster.spec import elastic
from gpuflow.cluster.spec import fields as checks
from gpuflow.cluster.spec.fields import Amount, Count, Strict, no_problem
from gpuflow.cluster.spec.options import ACCELERATOR, ComputeOption, options_problems


class ComputeSpec(Strict):
    backend: Literal["local", "skypilot"] = Field(
        "local", description="'local': a Ray cluster on this machine; 'skypilot': a cloud cluster."
    )
    num_nodes: Count(1, 512) = Field(1, description="Machines in the cluster.")
    workers_per_node: Count(1, 64) = Field(2, description="Ray Train workers on each node.")
    num_workers: Count(1, 512 * 64) | Annotated[list[StrictInt], Field(min_length=2, max_length=2)] | None = Field(
        None,
        description="Total workers; if set, must equal num_nodes × workers_per_node, or sets workers_per_node. "
        "A range [min, max] trains elastically: a lost node leaves the run on the workers left, down to min, instead "
        "of a relaunch (docs/spot.md).",
    )
    min_workers: Count(1, 512 * 64) | None = Field(
        None, description="Set by num_workers: [min, max]; unset: a fixed size."
    )
    cpus_per_worker: Amount(le=1024) = Field(1, description="CPUs reserved for each worker.")
    accelerators: (
        Annotated[str, Field(max_length=64)]
        | Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=32)]
        | None
    ) = Field(None, description="GPUs per node in SkyPilot form, e.g. 'H100:8' or ['H100:1', 'A100:1'].")
    use_gpu: StrictBool | None = Field(None, description="Train on GPUs; defaults to true when accelerators are set.")
    use_spot: StrictBool = Field(False, description="Use spot instances (cheaper, may be preempted).")
    infra: Annotated[str, Field(max_length=200)] | None = Field(
        None, description="SkyPilot infra, e.g. 'aws', 'aws/us-east-1', 'slurm/mycluster'."
    )
    quota: Annotated[str, no_problem(checks.quota_name_problem)] | None = Field(
        None,
        description="The team's GPU quota the run counts against (gpuflow quota set NAME N); default: "
        "cloud-accelerator, e.g. aws-h100, or 'local'.",
    )
    cloud: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="Cloud name, e.g. 'aws', 'gcp' (or use infra)."
    )
    region: Annotated[str, Field(max_length=64)] | None = Field(None, description="Cloud region, e.g. 'us-east-1'.")
    disk_size_gb: Count(10, 65_536) | None = Field(None, description="Boot disk per node in GB.")
    memory_gb_per_node: Amount(le=65_536) | None = Field(
        None, description="Memory per node in GB; the cloud's default when unset."
    )
    max_hourly_cost_usd: Amount(le=100_000) | None = Field(
        None, description="Only consider instances up to this price per hour (per node)."
    )
    max_recoveries: Count(0, 100) = Field(
        3,
        description="Times a lost cluster (spot preemption, a node gone) is relaunched and training resumed from "
        "the last checkpoint, in the same MLflow run; past it the run ends FAILED with stopped_by=preempted.",
    )
    options: Annotated[list[ComputeOption], Field(max_length=32)] | None = Field(
        None,
        description="Places to run in order of preference (SkyPilot fails over from one to the next), each "
        "with any of infra, cloud, region, accelerators, use_spot, hourly_rate_usd; the fields above are their "
        "defaults. Unset: the fields above say the one place.",
    )
    any_of: StrictBool = Field(
        False,
        description="Let SkyPilot pick the cheapest option that has capacity, "
        "instead of trying them in the listed order.",
    )
    spot_fallback_after: Count(1, 100) | None = Field(
        None,
        description="After this many losses of a spot cluster (preemptions, or no spot capacity), relaunch "
        "on-demand, once the budget allows its price. Unset: stay on spot.",
    )
    worker_restarts: Count(0, 100) = Field(
        0,
        description="Times Ray Train restarts a crashed worker group from the last checkpoint on a cluster that is "
        "still whole (a bug in the loop fails the same way again: keep 0 unless failures are transient).",
    )

    @field_validator("accelerators")
    @classmethod
    def _accelerators(cls, value):
        for item in [value] if isinstance(value, str) else value or []:
            if not ACCELERATOR.match(item):
                raise ValueError(f"{item!r} is not an accelerator; write e.g. 'H100:8' or 'A10G:1'")
        return value

    @model_validator(mode="after")
    def _topology(self):
        if problem := elastic.split_range(self):
            raise ValueError(problem)
        if self.num_workers is not None and self.num_workers != self.num_nodes * self.workers_per_node:
            if self.num_workers % self.num_nodes:
                raise ValueError(
                    f"num_workers={self.num_workers} does not split evenly over num_nodes={self.num_nodes}; "
                    "use a multiple of num_nodes"
                )
            object.__setattr__(self, "workers_per_node", self.num_workers // self.num_nodes)
        object.__setattr__(self, "num_workers", self.num_nodes * self.workers_per_node)
        if problem := elastic.range_problem(self):
            raise ValueError(problem)
        problems = options_problems(self)
        if problems:  # one error per problem, each at its own field
            raise ValidationError.from_exception_data(
                "ComputeSpec",
                [
                    {
                        "type": "value_error",
                        "loc": tuple(field.split(".")[1:]),
                        "input": None,
                        "ctx": {"error": problem},
                    }
                    for field, problem in problems
                ],
            )
        if self.use_gpu is None:
            object.__setattr__(
                self, "use_gpu", bool(self.accelerators or any(o.accelerators for o in self.options or []))
            )
        if self.backend == "local" and (self.accelerators or self.use_gpu or self.use_spot):
            raise ValueError(
                "the local backend trains on this machine's CPU; remove accelerators/use_gpu/use_spot "
                "or set compute.backend: skypilot"
            )
        if self.use_gpu and not (self.accelerators or self.options and all(o.accelerators for o in self.options)):
            raise ValueError(
                "use_gpu is true but no accelerators are requested; set compute.accelerators, e.g. 'H100:1'"
            )
        return self
