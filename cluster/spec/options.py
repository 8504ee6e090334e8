"""Where a run may run: compute.options, places in order of preference (or any of them, cheapest first), each a
cloud or infra, region, accelerator and spot or not. Without options, the single fields (compute.infra, cloud,
region, use_spot, accelerators) say one place, or one per accelerator of a list, as before.

    compute:
      options:
        - {infra: aws/us-east-1, accelerators: 'H100:1', use_spot: true}
        - {infra: slurm/lab/gpu, accelerators: 'A100:1', hourly_rate_usd: 1.2}   # no catalog price: give one
      spot_fallback_after: 2          # after 2 preemptions (or spot capacity errors), relaunch on-demand
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Annotated

from pydantic import Field, StrictBool

from gpuflow.cluster.spec.fields import Amount, Strict

ACCELERATOR = re.compile(r"^[A-Za-z0-9-]+(:\d+(\.\d+)?)?$")
PLACE_FIELDS = ("infra", "cloud", "region", "accelerators", "use_spot")


class ComputeOption(Strict):
    infra: Annotated[str, Field(max_length=200)] | None = Field(
        None, description="SkyPilot infra, e.g. 'aws/us-east-1', 'k8s/my-context', 'slurm/mycluster/gpu-partition'."
    )
    cloud: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="Cloud name, e.g. 'aws' (or use infra)."
    )
    region: Annotated[str, Field(max_length=64)] | None = Field(None, description="Cloud region, e.g. 'us-east-1'.")
    accelerators: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="GPUs per node, e.g. 'H100:8'; one per option (list several options for several)."
    )
    use_spot: StrictBool | None = Field(None, description="Spot instances; defaults to compute.use_spot.")
    hourly_rate_usd: Amount(le=100_000, ge=0) | None = Field(
        None,
        description="This option's price per hour for the whole cluster where no catalog knows it "
        "(Slurm, Kubernetes); defaults to limits.hourly_rate_usd, else SkyPilot's catalog.",
    )


@dataclass(frozen=True)
class Option:
    """One place to run, with the spec's defaults filled in; `index` counts from 1 in the spec's order."""

    index: int
    infra: str | None = None
    cloud: str | None = None
    region: str | None = None
    accelerators: str | None = None
    use_spot: bool = False
    hourly_rate_usd: float | None = None
    field: str = "compute"  # where a price or a problem of this option comes from

    def where(self) -> str:
        return self.infra or "/".join(filter(None, [self.cloud, self.region])) or "any cloud"

    def describe(self) -> str:
        return f"{self.where()} {self.accelerators or 'CPU'} {'spot' if self.use_spot else 'on-demand'}"

    def on_demand(self) -> Option:
        return replace(self, use_spot=False)


def compute_options(compute, on_demand: bool = False) -> list[Option]:
    """The run's places in order: compute.options with the single fields as defaults, else one per accelerator.
    `on_demand`: the spot fallback's places, every spot option made on-demand (duplicates dropped)."""
    if compute.options:
        found = [
            Option(
                i,
                option.infra or compute.infra,
                option.cloud or compute.cloud,
                option.region or compute.region,
                option.accelerators or single_accelerator(compute),
                compute.use_spot if option.use_spot is None else option.use_spot,
                option.hourly_rate_usd,
                f"compute.options.{i - 1}",
            )
            for i, option in enumerate(compute.options, 1)
        ]
    else:
        accelerators = compute.accelerators if isinstance(compute.accelerators, list) else [compute.accelerators]
        found = [
            Option(i, compute.infra, compute.cloud, compute.region, accelerator, compute.use_spot)
            for i, accelerator in enumerate(accelerators, 1)
        ]
    if not on_demand:
        return found
    unique: list[Option] = []
    for option in (option.on_demand() for option in found):
        if not any(replace(option, index=0, field="") == replace(seen, index=0, field="") for seen in unique):
            unique.append(option)
    return unique


def single_accelerator(compute) -> str | None:
    return compute.accelerators if isinstance(compute.accelerators, str) else None


def options_problems(compute) -> list[tuple[str, str]]:
    """(field, problem and fix) for options that cannot run as written."""
    problems = []
    if compute.options is not None:
        if compute.backend == "local":
            return [
                (
                    "compute.options",
                    "the local backend runs on this machine only; "
                    "set compute.backend: skypilot, or remove compute.options",
                )
            ]
        if not compute.options:
            return [
                (
                    "compute.options",
                    "is empty; list at least one option, e.g. [{infra: aws, accelerators: "
                    "'H100:1'}], or remove it and set compute.infra/accelerators",
                )
            ]
        if isinstance(compute.accelerators, list):
            problems.append(
                (
                    "compute.accelerators",
                    "a list of accelerators and compute.options both say where to "
                    "run; give each accelerator its own option and remove compute.accelerators",
                )
            )
        for i, option in enumerate(compute.options):
            if option.infra and (option.cloud or option.region):
                problems.append(
                    (
                        f"compute.options.{i}",
                        "gives infra and cloud/region; use one: e.g. infra: "
                        f"{option.cloud or 'aws'}/{option.region or 'us-east-1'}",
                    )
                )
            for name in PLACE_FIELDS:
                # a single field left at its default is no contradiction: not "set" by the user, whatever a spec's
                # JSON round trip (Prefect's parameters, the job's copy) says of the fields set
                mine, default = getattr(option, name), getattr(compute, name)
                if (
                    mine is not None
                    and default not in (None, type(compute).model_fields[name].default)
                    and mine != default
                ):
                    problems.append(
                        (
                            f"compute.options.{i}.{name}",
                            f"{mine!r} contradicts compute.{name}={default!r}; "
                            f"remove compute.{name} (each option says its own) or make them agree",
                        )
                    )
            if option.accelerators and not ACCELERATOR.match(option.accelerators):
                problems.append(
                    (
                        f"compute.options.{i}.accelerators",
                        f"{option.accelerators!r} is not an accelerator; write e.g. 'H100:8' or 'A10G:1'",
                    )
                )
    if compute.spot_fallback_after is not None and not any(o.use_spot for o in compute_options(compute)):
        problems.append(
            (
                "compute.spot_fallback_after",
                "no option uses spot, so there is nothing to fall back "
                "from; set use_spot: true (on compute or an option), or remove spot_fallback_after",
            )
        )
    return problems


def on_demand_spec(spec):
    """The spec of the spot fallback: every option (and compute.use_spot) on-demand, and nothing left to fall back
    from, nor a deadline to choose (a node validates the spec it is given: either without spot is refused there)."""
    compute, limits = spec.compute, spec.limits
    options = compute.options and [option.model_copy(update={"use_spot": False}) for option in compute.options]
    return spec.model_copy(
        update={
            "compute": compute.model_copy(update={"use_spot": False, "options": options, "spot_fallback_after": None}),
            "limits": limits.model_copy(update={"deadline": None, "finish_within_hours": None}),
        }
    )
