"""What a cluster costs: the hourly price from SkyPilot's catalog (or limits.hourly_rate_usd); the budget checks
are in cluster/cost/budget.py.

    gpuflow cost --estimate experiments/digits.yaml      # hourly price and the most a run may cost

No Prefect here: `gpuflow plan`, the validate task and the watchdog all call these plain functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpuflow.cluster.spec import ExperimentSpec, billed_sweep_minutes
from gpuflow.cluster.spec.options import Option, compute_options


class CatalogMissing(RuntimeError):
    """SkyPilot has no price catalog on this machine; without one it would try to download it."""


class PriceUnknown(ValueError):
    """No catalog row matches the requested compute."""


@dataclass(frozen=True)
class Estimate:
    """The hourly price of the whole cluster and where it came from."""

    hourly_usd: float  # all nodes together
    per_node_hourly_usd: float
    num_nodes: int
    use_spot: bool
    source: str  # "catalog", "limits.hourly_rate_usd" or "free" (local, no rate given)
    cloud: str | None = None
    region: str | None = None
    instance_type: str | None = None
    accelerators: str | None = None  # per node, e.g. "H100:8"
    gpus_per_node: float = 0

    def cost_usd(self, seconds: float) -> float:
        return self.hourly_usd * seconds / 3600

    def per_node_cost_usd(self, node_seconds: float) -> float:
        """What `node_seconds` of this cluster's nodes cost (its whole price shared evenly among its nodes)."""
        return self.hourly_usd / max(self.num_nodes, 1) * node_seconds / 3600

    def max_runtime_cost_usd(self, spec: ExperimentSpec) -> float:
        """The bill if the job runs to limits.max_runtime_minutes."""
        return self.hourly_usd * spec.limits.max_runtime_minutes / 60

    def sweep_cost_usd(self, spec: ExperimentSpec) -> float:
        """The most a sweep can cost: trials ÷ max_concurrent_trials rounds × max_trial_minutes × the price,
        never more than the limits.max_runtime_minutes bill."""
        return self.hourly_usd * billed_sweep_minutes(spec) / 60

    def describe(self) -> str:
        if self.source == "free":
            return "local cluster, no price (set limits.hourly_rate_usd to price it)"
        what = f"{self.num_nodes} × {self.instance_type or 'node'}"
        where = "/".join(filter(None, [self.cloud, self.region]))
        kind = "spot" if self.use_spot else "on-demand"
        return (
            f"{what} ({self.accelerators or 'CPU'}, {kind}{', ' + where if where else ''}): "
            f"${self.per_node_hourly_usd:.4g}/h per node, ${self.hourly_usd:.4g}/h in all [{self.source}]"
        )

    def as_dict(self) -> dict:
        return asdict(self)


UNPRICED_INFRA = {"slurm", "kubernetes", "k8s", "ssh"}
USER_RATE = "hourly_rate_usd"  # the end of every source that is the user's own rate: what launched does not change it


def hourly_cost(spec: ExperimentSpec) -> Estimate:
    """The price the budget uses: the dearest option that may launch (the on-demand ones of a spot fallback or a
    deadline too).
    SkyPilot tries the options in order, or picks among them: any may be what launches, so the run is checked
    against the dearest, then metered at the price of what launched (cluster/run/lifecycle.py)."""
    return max((estimate for _, estimate in option_prices(spec)), key=lambda estimate: estimate.hourly_usd)


def options_that_may_launch(spec: ExperimentSpec) -> list[Option]:
    options = compute_options(spec.compute)
    limits = spec.limits
    if spec.compute.spot_fallback_after is not None or limits.deadline or limits.finish_within_hours:
        options += [o for o in compute_options(spec.compute, on_demand=True) if o not in options]
    return options


def option_prices(spec: ExperimentSpec, options: list[Option] | None = None) -> list[tuple[Option, Estimate]]:
    return [(option, option_price(spec, option)) for option in options or options_that_may_launch(spec)]


def option_price(spec: ExperimentSpec, option: Option) -> Estimate:
    """One option's hourly price: its own hourly_rate_usd, else limits.hourly_rate_usd, else SkyPilot's catalog."""
    compute, nodes = spec.compute, spec.compute.num_nodes
    gpus = gpus_per_node(option.accelerators)
    rate, source = option.hourly_rate_usd, f"{option.field}.{USER_RATE}"
    if rate is None:
        rate, source = spec.limits.hourly_rate_usd, f"limits.{USER_RATE}"
    if rate is not None:
        return Estimate(
            rate, rate / nodes, nodes, option.use_spot, source, accelerators=option.accelerators, gpus_per_node=gpus
        )
    if compute.backend == "local":
        return Estimate(0.0, 0.0, nodes, False, "free")
    cloud, region = cloud_and_region(option)
    if cloud in UNPRICED_INFRA:  # machines the user already has: SkyPilot prices them at 0 and has no catalog
        return Estimate(
            0.0,
            0.0,
            nodes,
            option.use_spot,
            f"{cloud} (no price catalog: set {option.field}.{USER_RATE} or limits.{USER_RATE})",
            cloud=cloud,
            region=region,
            accelerators=option.accelerators,
            gpus_per_node=gpus,
        )
    clouds = [cloud] if cloud else catalog_clouds(option)
    for each in clouds:
        require_catalog(option, each)
    # For one option SkyPilot's optimizer picks the cheapest cloud that offers it.
    priced = [
        estimate
        for estimate in (catalog_price(spec, c, region, option.accelerators, option.use_spot) for c in clouds)
        if estimate
    ]
    if not priced:
        raise PriceUnknown(
            f"{'compute.accelerators' if option.field == 'compute' else option.field}: no instance with "
            f"{option.accelerators or 'CPU only'} ({'spot' if option.use_spot else 'on-demand'}) in the SkyPilot "
            f"catalog for {cloud or ', '.join(clouds)}{'/' + region if region else ''}; check the accelerator name "
            f"and count (`sky show-gpus`), or set {option.field}.{USER_RATE} or limits.{USER_RATE}"
        )
    return min(priced, key=lambda estimate: estimate.hourly_usd)


def launched_price(estimate: Estimate, hourly_usd: float) -> Estimate:
    """The estimate with the price of the cluster that actually launched (the optimizer may have fallen back)."""
    return replace(
        estimate, hourly_usd=hourly_usd, per_node_hourly_usd=hourly_usd / estimate.num_nodes, source="launched"
    )


def catalog_price(
    spec: ExperimentSpec, cloud: str, region: str | None, accelerator: str | None, use_spot: bool
) -> Estimate | None:
    """One cloud's cheapest instance for one accelerator option, priced with SkyPilot's own catalog functions."""
    import sky.catalog
    from sky.utils import registry

    compute = spec.compute
    cloud_object = registry.CLOUD_REGISTRY.from_str(cloud)
    accelerators = None
    try:
        if accelerator:
            name, count = split_accelerator(accelerator)
            instance_types, _ = sky.catalog.get_instance_type_for_accelerator(
                name, count, use_spot=use_spot, region=region, clouds=cloud
            )
            if not instance_types:
                return None
            instance_type, accelerators = instance_types[0], {name: count}
        else:
            instance_type = sky.catalog.get_default_instance_type(region=region, use_spot=use_spot, clouds=cloud)
            if not instance_type:
                return None
        # GCP bills attached GPUs apart from the VM; other clouds return 0 for the accelerator part.
        per_node = cloud_object.instance_type_to_hourly_cost(instance_type, use_spot, region, None)
        if accelerators:
            per_node += cloud_object.accelerators_to_hourly_cost(accelerators, use_spot, region, None)
    except (ValueError, AssertionError):  # not offered there (e.g. spot on a cloud without spot)
        return None
    return Estimate(
        per_node * compute.num_nodes,
        per_node,
        compute.num_nodes,
        use_spot,
        "catalog",
        cloud=cloud,
        region=region,
        instance_type=instance_type,
        accelerators=accelerator,
        gpus_per_node=gpus_per_node(accelerator),
    )


def catalog_dir() -> Path:
    """Where this SkyPilot reads its catalog: ~/.sky/catalogs/<schema>/ under $SKY_RUNTIME_DIR or $HOME."""
    from sky.catalog import common

    return Path(common.get_catalog_path(""))


def catalog_clouds(option: Option) -> list[str]:
    """Clouds whose price list is on this machine (an option that names no cloud may launch on any of them)."""
    folder = catalog_dir()
    clouds = sorted(p.parent.name for p in folder.glob("*/vms.csv")) if folder.is_dir() else []
    if not clouds:
        raise CatalogMissing(missing_message(option, [folder / "<cloud>" / "vms.csv"]))
    return clouds


def catalog_files(option: Option, cloud: str) -> list[Path]:
    """What SkyPilot reads to launch the option: the cloud's instance list, and for an accelerator the
    list it checks the name against (read for every cloud, Slurm and Kubernetes included)."""
    folder = catalog_dir()
    return [folder / cloud / "vms.csv", *([folder / "common" / "accelerators.csv"] if option.accelerators else [])]


def require_catalog(option: Option, cloud: str) -> None:
    # SkyPilot downloads a missing catalog with no timeout: offline, that is a hang or a late traceback
    # (the API server's CloudError: requests error (ConnectionError)) after the run has started.
    missing = [path for path in catalog_files(option, cloud) if not path.is_file()]
    if missing:
        raise CatalogMissing(missing_message(option, missing))


def missing_message(option: Option, missing: list[Path]) -> str:
    rate = f"{option.field}.{USER_RATE} or limits.{USER_RATE}" if option.field != "compute" else f"limits.{USER_RATE}"
    return (
        f"{option.field}: {option.describe()} has no price: {rate} is unset and SkyPilot's price catalog is "
        f"not on this machine ({', '.join(map(str, missing))}). Install the catalog, which SkyPilot also reads "
        "when it launches (offline it would try to download it then, and fail): run `sky show-gpus` once where "
        f"the internet is reachable, or copy those files from ~/.sky/catalogs/{catalog_dir().name}/ of a machine "
        f"that has them to {catalog_dir()}; or set {rate} to price the option yourself"
    )


def cloud_and_region(where) -> tuple[str | None, str | None]:
    """An option's (or compute's) infra ('aws/us-east-1'), or its cloud + region."""
    if where.infra:
        cloud, _, rest = where.infra.partition("/")
        return cloud.lower(), (rest.split("/")[0] or None) if rest else None
    return (where.cloud.lower() if where.cloud else None), where.region


def accelerator_options(accelerators: str | list[str] | None) -> list[str | None]:
    if not accelerators:
        return [None]
    return [accelerators] if isinstance(accelerators, str) else list(accelerators)


def first_accelerator(accelerators: str | list[str] | None) -> str | None:
    return accelerator_options(accelerators)[0]


def split_accelerator(accelerator: str) -> tuple[str, float]:
    name, _, count = accelerator.partition(":")
    value = float(count or 1)
    return name, int(value) if value.is_integer() else value


def gpus_per_node(accelerators: str | list[str] | None) -> float:
    first = first_accelerator(accelerators)
    return split_accelerator(first)[1] if first else 0
