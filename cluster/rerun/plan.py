"""A rerun, decided before anything starts: the run found, its code checked out, its data checked, the spec to run
(the recorded one, pinned to that checkout and data, then `--on` and `--set`), and what differs from the run.

The spec is pinned so that it runs what the run ran, from any folder: its workdir is the checkout (at the workdir's
place in the repository), data.train/validation the files the run recorded reading, tracking.uri the store that holds
the run (the rerun lands beside it). `--on N` keeps compute option N alone (of compute.options, or of a list of
compute.accelerators), in the order `gpuflow plan` numbers them; `--on GPU:COUNT` runs the same places on another
accelerator."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuflow.cluster.protocol import FLOW_RUN_TAG
from gpuflow.cluster.rerun import RerunRefused
from gpuflow.cluster.rerun.checks import DataCheck, data_checks, package_differences, recorded_inputs, recorded_packages
from gpuflow.cluster.rerun.find import FoundRun, find_run
from gpuflow.cluster.rerun.source import (
    Source,
    checked_against_stamp,
    checkout,
    on_allowed_refs,
    recorded_source,
    repository_here,
)
from gpuflow.cluster.spec import ExperimentSpec, SpecError, apply_override, parse_spec
from gpuflow.cluster.spec.loading import safe_load
from gpuflow.cluster.spec.options import ACCELERATOR

MAX_PACKAGES_SHOWN = 20


@dataclass
class Rerun:
    found: FoundRun
    source: Source
    folder: Path  # the checkout
    spec: ExperimentSpec
    spec_changes: list[tuple[str, object, object]]  # (field, recorded, rerun)
    data: list[DataCheck]
    packages: list[tuple[str, str | None, str | None]] | None  # None: the run recorded no package list
    verified: bool  # its code is what its flow recorded at its start (SOURCE_STAMP_PREFIX)


@dataclass(frozen=True)
class Ask:
    """What the user asked: the run, where to look for it, and how to change it."""

    run: str
    tracking_uris: Iterable[str]
    overrides: tuple[str, ...] = ()
    on: str | None = None
    allow_data_change: bool = False
    allow_unrecorded_changes: bool = False
    # the source stamp a flow run recorded (flow run id -> stamp, None where unknown); None: no Prefect API to ask
    stamp_of: Callable[[str], str | None] | None = None
    rerun_refs: tuple[str, ...] = ()  # a served deployment's: committed code those refs contain, nothing else


def prepare(ask: Ask, here: Path, cache: Path) -> Rerun:
    """Every check of the rerun, in the order that costs least: refuses (RerunRefused, SpecError) before any cluster."""
    found = find_run(ask.run, ask.tracking_uris)
    source = recorded_source(found.client, found.source)
    flow_run_id = found.source.data.tags.get(FLOW_RUN_TAG)
    stamp = ask.stamp_of(flow_run_id) if ask.stamp_of and flow_run_id else None
    source, verified = checked_against_stamp(source, stamp, found.source.info.run_id, ask.allow_unrecorded_changes)
    if ask.rerun_refs and (source.diff or source.unrecorded):
        raise RerunRefused(
            f"run {found.source.info.run_id} ran with uncommitted changes: a served deployment reruns committed "
            f"code only. Rerun it from your own tree with `gpuflow rerun {found.run_id}`, or commit the changes, "
            "run that, and rerun that run"
        )
    if source.unrecorded and not ask.allow_unrecorded_changes:
        raise RerunRefused(
            f"run {found.source.info.run_id}: {source.unrecorded}, so a rerun cannot reproduce its "
            "code exactly; --allow-unrecorded-changes reruns its commit without them"
        )
    data = data_checks(found.source)
    if any(check.changed for check in data) and not ask.allow_data_change:
        raise RerunRefused(
            "the run's data changed: "
            + "; ".join(c.describe() for c in data if c.changed)
            + "; restore it, or --allow-data-change reruns on the data as it is now"
        )
    repository = repository_here(here)
    if ask.rerun_refs:
        on_allowed_refs(repository, source.commit, ask.rerun_refs)
    folder = checkout(repository, source, cache)
    recorded = found.recorded_spec()
    spec, changes = rerun_spec(recorded, pinned(found, folder / source.workdir), ask)
    packages = recorded_packages(found.client, found.source)
    differences = None if packages is None else package_differences(packages)
    return Rerun(found, source, folder, spec, changes, data, differences, verified)


def pinned(found: FoundRun, workdir: Path) -> dict[str, str]:
    """field -> value that make the recorded spec run the recorded code and data, and log beside the run."""
    values = {"workdir": str(workdir), "tracking.uri": found.tracking_uri}
    values.update({field: uri for field, (uri, _) in recorded_inputs(found.source).items()})
    return values


def rerun_spec(recorded: dict, pins: dict[str, str], ask: Ask) -> tuple[ExperimentSpec, list]:
    raw = copy.deepcopy(recorded)
    for field, value in pins.items():
        apply_override(raw, field, value)
    if ask.on:
        move_to(raw.setdefault("compute", {}), ask.on)
    for item in ask.overrides:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise SpecError([f"--set {item!r}: write it as field.path=value, e.g. train.lr=0.01"])
        apply_override(raw, field.strip(), safe_load(value))
    return parse_spec(raw), changed_fields(recorded, raw)


def move_to(compute: dict, on: str) -> None:
    """--on N: option N alone; --on GPU:COUNT: every option on that accelerator."""
    options, accelerators = compute.get("options"), compute.get("accelerators")
    choices = options or (accelerators if isinstance(accelerators, list) else [accelerators])
    if on.isdigit():
        if not 1 <= int(on) <= len(choices):
            raise RerunRefused(
                f"--on {on}: the run had {len(choices)} compute option(s) ({describe_choices(choices)}); "
                f"give a number from 1 to {len(choices)}, or an accelerator such as 'H100:1'"
            )
        if options:
            compute["options"] = [options[int(on) - 1]]
        else:
            compute["accelerators"] = choices[int(on) - 1]
    elif ACCELERATOR.match(on):
        for option in options or []:
            option["accelerators"] = on
        if not options:
            compute["accelerators"] = on
    else:
        raise RerunRefused(
            f"--on {on!r}: give a compute option's number (1 to {len(choices)}: "
            f"{describe_choices(choices)}) or an accelerator such as 'H100:1'"
        )


def describe_choices(choices: list) -> str:
    return ", ".join(
        f"{i} = {json.dumps(choice) if isinstance(choice, dict) else choice or 'CPU'}"
        for i, choice in enumerate(choices, 1)
    )


def changed_fields(before: dict, after: dict) -> list[tuple[str, object, object]]:
    old, new = flat(before), flat(after)
    return [(key, old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def flat(raw: dict, prefix: str = "") -> dict[str, object]:
    found = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found.update(flat(value, path + "."))
        else:
            found[path] = value
    return found


def describe(rerun: Rerun) -> list[str]:
    """What the rerun runs and what differs from the run: the lines of `gpuflow rerun --dry-run`."""
    run, source = rerun.found.run, rerun.source
    lines = [f"rerun of     MLflow run {run.info.run_id} ({run.info.run_name}) in {rerun.found.tracking_uri}"]
    if rerun.found.is_trial:
        values = " ".join(f"{path}={value}" for path, value in rerun.found.trial_values.items())
        lines.append(f"             a trial of sweep run {rerun.found.source.info.run_id}: this trial alone, {values}")
    changes = f"+ its uncommitted diff ({len(source.diff):,} bytes)" if source.diff else "(no uncommitted changes)"
    lines.append(f"code         commit {source.commit} {changes}")
    if source.unrecorded:
        lines.append(f"             NOT as it ran: {source.unrecorded}")
    if rerun.verified:
        lines.append("             as its flow run recorded it at its start")
    else:  # MLflow's copy alone: whoever can edit the run could have changed it
        lines.append("             NOT verified: no record of its flow run's found here; this is MLflow's copy")
    lines.append(f"             checked out in {rerun.folder}")
    lines += [f"spec         {field}: {shown(old)} -> {shown(new)}" for field, old, new in rerun.spec_changes] or [
        "spec         as recorded"
    ]
    lines += [f"data         {check.describe()}" for check in rerun.data] or ["data         none recorded"]
    if rerun.packages is None:
        lines.append("packages     the run recorded none")
    elif not rerun.packages:
        lines.append("packages     the same as the run's")
    else:
        lines += [
            f"packages     {name}: {then or 'absent'} then, {now or 'absent'} here"
            for name, then, now in rerun.packages[:MAX_PACKAGES_SHOWN]
        ]
        more = len(rerun.packages) - MAX_PACKAGES_SHOWN
        lines.append(
            f"             ({f'and {more} more; ' if more > 0 else ''}nothing installed: this environment's "
            "packages run)"
        )
    return lines


def shown(value) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
