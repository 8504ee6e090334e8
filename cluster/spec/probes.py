"""The checks a spec's model cannot make alone, because they need this machine: the loop imports and takes its
config, the data reads as Parquet, the checkpoint storage takes a write, the tracking server answers."""

from __future__ import annotations

import os
from pathlib import Path

from gpuflow.cluster.spec import fields as checks
from gpuflow.cluster.spec.entrypoints import entrypoint_check
from gpuflow.cluster.spec.fields import absolute_uri
from gpuflow.cluster.spec.loading import SpecError
from gpuflow.cluster.spec.model import ExperimentSpec
from gpuflow.cluster.spec.tracking_access import tracking_access_problems


def check_spec(spec: ExperimentSpec) -> list[str]:
    """What the model alone cannot check: the loop imports and takes the right arguments, the data is readable,
    the checkpoint storage is writable, the tracking server answers."""
    importing = check_entrypoints(spec)  # seconds of imports, in a process of its own: the other checks meanwhile
    generate = spec.data.generate if spec.data else None
    problems = []
    if not Path(spec.workdir).is_dir():
        problems.append(f"workdir: {spec.workdir!r} is not a folder")
    located = spec.anchored().data
    for field in ("train", "validation"):
        uri = getattr(spec.data, field) if spec.data else None
        unusable = uri and not generate and data_problem(getattr(located, field))
        if unusable:
            problems.append(f"data.{field}: {uri!r} {unusable}; give a Parquet file or folder that holds rows, "
                            "or set data.generate to a function that writes it")
    for field, secret in enumerate(spec.secrets):
        if secret not in os.environ:
            problems.append(f"secrets[{field}]: {secret!r} is not set in this environment; export it before running")
    unwritable = checks.storage_write_problem(spec.checkpoint_uri)
    if unwritable:
        problems.append(f"storage.checkpoints: {unwritable}; give a folder or bucket this machine can write")
    down = checks.tracking_server_problem(spec.tracking_uri)
    if down:
        problems.append(f"tracking.uri: {down}")
    else:
        problems += tracking_access_problems(spec.tracking_uri, spec.experiment_name, spec.name)
    return importing.problems() + problems


def check_entrypoints(spec: ExperimentSpec):
    """Starts (or finds) the check that the spec's loop and data generator import and take the right arguments."""
    entrypoints = {"train.loop": spec.train.loop, "data.generate": spec.data.generate if spec.data else None}
    return entrypoint_check(spec.workdir, {field: value for field, value in entrypoints.items() if value})


def validate_spec(spec: ExperimentSpec) -> ExperimentSpec:
    problems = check_spec(spec)
    if problems:
        raise SpecError(problems)
    return spec


def readable(uri: str) -> bool:
    return data_problem(uri) is None


def data_problem(uri: str) -> str | None:
    """None if `uri` is Parquet data with at least one row, else what it is."""
    import pyarrow.dataset as ds

    try:
        dataset = ds.dataset(absolute_uri(uri), format="parquet")
        if not dataset.files:
            return "holds no Parquet files"
        # a file's row count is in its footer; stop at the first file with rows
        if not any(fragment.count_rows() for fragment in dataset.get_fragments()):
            return "holds no rows"
    except Exception:
        return "cannot be read as Parquet"
    return None
