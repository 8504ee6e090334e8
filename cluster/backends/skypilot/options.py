"""The spec's options as SkyPilot's resources, and back: SkyPilot does the failover itself (a list of sky.Resources
is tried in order, a set is "any of", cheapest first); what launched is read from the cluster's handle
(`launched_resources`), and a launch that found no capacity anywhere (ResourcesUnavailableError, whose message
has one block per option tried) becomes NoCapacity with each option's reason."""

from __future__ import annotations

import re

from gpuflow.cluster.backends.base import NoCapacity
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.cluster.spec.options import Option, compute_options

CLOUD_ALIASES = {"k8s": "kubernetes"}
NO_SPOT = {"slurm", "kubernetes", "ssh"}  # SkyPilot drops a spot option there before it launches anything
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # SkyPilot colours its messages
FAILED_BLOCK = "\u2717 "  # SkyPilot's mark before each failed option's infra, in a ResourcesUnavailableError


def options_of(spec: ExperimentSpec) -> list[Option]:
    """The options SkyPilot is given, duplicates dropped (the spot fallback may make two options one)."""
    unique: list[Option] = []
    for option in compute_options(spec.compute):
        if not any(same_place(option, seen) for seen in unique):
            unique.append(option)
    return unique


def same_place(a: Option, b: Option) -> bool:
    return (a.infra, a.cloud, a.region, a.accelerators, a.use_spot) == (
        b.infra,
        b.cloud,
        b.region,
        b.accelerators,
        b.use_spot,
    )


def resources_for(spec: ExperimentSpec) -> list | set:
    """One sky.Resources per option: a list (tried in order) or, with compute.any_of, a set (cheapest first)."""
    import sky

    compute = spec.compute
    resources = [
        sky.Resources(
            infra=option.infra,
            cloud=sky.CLOUD_REGISTRY.from_str(option.cloud) if option.cloud else None,
            region=option.region,
            accelerators=option.accelerators,
            use_spot=option.use_spot,
            cpus=f"{compute.workers_per_node * compute.cpus_per_worker:g}+",
            memory=compute.memory_gb_per_node,
            disk_size=compute.disk_size_gb,
            max_hourly_cost=compute.max_hourly_cost_usd,
            labels={"gpuflow": "true"},
        )
        for option in options_of(spec)
    ]
    return set(resources) if compute.any_of else resources


def place_of(option: Option) -> tuple[str | None, str | None, str | None]:
    """(cloud, region, zone) an option asks for; a Slurm infra's zone is its partition."""
    if option.infra:
        parts = option.infra.split("/") + [None, None]
        cloud = parts[0].lower()
        return CLOUD_ALIASES.get(cloud, cloud), parts[1] or None, parts[2] or None
    cloud = option.cloud.lower() if option.cloud else None
    return CLOUD_ALIASES.get(cloud, cloud), option.region, None


def accelerator_of(option: Option) -> dict | None:
    if not option.accelerators:
        return None
    name, _, count = option.accelerators.partition(":")
    value = float(count or 1)
    return {name.lower(): int(value) if value.is_integer() else value}


def matches(option: Option, resources) -> bool:
    """Whether the launched (concrete) resources are what the option asked for."""
    if bool(resources.use_spot) != option.use_spot:
        return False
    wanted = accelerator_of(option)
    got = {str(k).lower(): v for k, v in (resources.accelerators or {}).items()} or None
    if wanted is not None and got != wanted:
        return False
    cloud, region, zone = place_of(option)
    return (
        (cloud is None or str(resources.cloud).lower() == cloud)
        and (region is None or resources.region == region)
        and (zone is None or resources.zone == zone)
    )


def option_launched(spec: ExperimentSpec, resources) -> Option | None:
    """The first option (in the spec's order) that the launched resources satisfy; None if none is recognised."""
    if resources is None:
        return None
    return next((option for option in options_of(spec) if matches(option, resources)), None)


def no_capacity(spec: ExperimentSpec, error: Exception) -> NoCapacity:
    """SkyPilot's ResourcesUnavailableError as NoCapacity: each option with the reason SkyPilot gave for it, or
    why it was not tried (SkyPilot drops an option it finds nothing to launch for before it launches anything)."""
    text = ANSI.sub("", str(error))
    blocks = failed_blocks(text)
    summary = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    reasons, unread = [], list(blocks)
    for option in options_of(spec):
        # one block per option tried, in the order tried: two options at one place have a block each
        found = next((block for block in unread if header_names(block[0], option)), None)
        if found:
            unread.remove(found)
        reasons.append(
            (
                f"option {option.index} ({option.describe()})",
                found[1] if found else not_tried(option) if blocks else summary,
            )
        )
    options = options_of(spec)
    return NoCapacity(
        f"no capacity in any of {len(options)} option(s): " + "; ".join(f"{what}: {why}" for what, why in reasons),
        reasons,
        spot=all(o.use_spot for o in options),
    )


def not_tried(option: Option) -> str:
    if option.use_spot and place_of(option)[0] in NO_SPOT:
        return f"not tried: {place_of(option)[0]} has no spot instances"
    if option.use_spot:
        return "not tried: SkyPilot found no spot offer for it"
    return "not tried: SkyPilot found nothing to launch for it (check the accelerator, region and `sky check`)"


def failed_blocks(text: str) -> list[tuple[str, str]]:
    """(header, reason) of each '✗ <infra> — <resources>' block of a ResourcesUnavailableError's message."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(FAILED_BLOCK):
            blocks.append((line[len(FAILED_BLOCK) :], []))
        elif blocks and line.strip():
            blocks[-1][1].append(line.strip())
    return [(header, " ".join(reason)[:500]) for header, reason in blocks]


def header_names(header: str, option: Option) -> bool:
    """Whether a block's header ('AWS (us-east-1) — (gpus=L4:1, g6.xlarge, ...)') may be the option's. It says the
    place and the GPUs, never spot or not: blocks come in the order tried, and spot where the infra has none is
    never tried."""
    lowered = header.lower()
    cloud, region, _ = place_of(option)
    if option.use_spot and cloud in NO_SPOT:
        return False
    wanted = [option.accelerators.split(":")[0] if option.accelerators else None, cloud, region]
    return all(word.lower() in lowered for word in wanted if word)


def launched_facts(spec: ExperimentSpec, resources) -> dict:
    """What the handle says launched, for the run's record: the option (index and description) and the place."""
    if resources is None:
        return {}
    option = option_launched(spec, resources)
    accelerators = ",".join(f"{k}:{v}" for k, v in (resources.accelerators or {}).items())
    return {
        "option": option.index if option else None,
        "option_text": option.describe() if option else "unmatched",
        "launched": {
            "infra": resources.infra.formatted_str(),
            "region": resources.region or "",
            "accelerators": accelerators or "CPU",
            "spot": str(bool(resources.use_spot)).lower(),
        },
    }
