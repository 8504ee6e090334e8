"""A `ray.train.report` as gpuflow logs it (cluster/job/tracking.py): its numbers as MLflow metric keys, its step,
its checkpoint's URI; and the reports of the checkpoints Ray Train persisted, which a resumed attempt logs again."""

from __future__ import annotations

import json
import numbers
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEP_KEYS = ("epoch", "step")  # a report's own step, in order of preference; else the report's index
KEY_NOT_ALLOWED = re.compile(r"[^\w\-. /]")


@dataclass
class Report:
    """One round of `ray.train.report`: rank 0's numbers, its step (None: use the index), its checkpoint URI."""

    index: int
    step: int | None
    metrics: dict[str, float]
    checkpoint_uri: str | None
    at_ms: int = field(default_factory=lambda: int(time.time() * 1000))


def numbers_of(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric values of a report (nested dicts flattened with '/'), as MLflow metric keys."""
    found = {}
    for key, value in metrics.items():
        name = KEY_NOT_ALLOWED.sub("_", f"{prefix}{key}")
        if isinstance(value, dict):
            found.update(numbers_of(value, name + "/"))
        elif isinstance(value, bool) or isinstance(value, str):
            continue
        elif (
            isinstance(value, numbers.Number)
            or getattr(value, "ndim", None) == 0
            or getattr(value, "shape", None) == ()
        ):
            try:
                found[name] = float(value)  # numpy scalars and 0-d tensors too
            except (TypeError, ValueError):
                continue
    return found


def step_of(metrics: dict[str, Any]) -> tuple[str | None, int | None]:
    for key in STEP_KEYS:
        value = metrics.get(key)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
            return key, int(value)
    return None, None


def uri_of(checkpoint) -> str:
    """A checkpoint's location as a URI another machine can open (s3://..., gs://..., or a local path)."""
    scheme = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs", "abfs": "abfs"}.get(checkpoint.filesystem.type_name)
    return f"{scheme}://{checkpoint.path}" if scheme else checkpoint.path


def persisted_reports(snapshot_uri: str | None) -> list[Report]:
    """The reports of every checkpoint Ray Train persisted so far (its checkpoint-manager snapshot), those with a
    step of their own: a lost controller can take the last reports with it before they reached MLflow, while their
    checkpoints are in storage and the resumed attempt starts after them. A step the run holds is skipped."""
    return reports_of(read_snapshot(snapshot_uri) or {})  # none yet (a first attempt), or unreadable: nothing to add


def reports_of(snapshot: dict) -> list[Report]:
    """The persisted reports of a snapshot read already (read_snapshot), by step."""
    reports = []
    for result in snapshot.get("checkpoint_results", []):
        step_key, step = step_of(result.get("metrics", {}))
        if step is not None:
            reports.append(
                Report(-1, step, numbers_of({k: v for k, v in result["metrics"].items() if k != step_key}), None)
            )
    return sorted(reports, key=lambda report: report.step)


def read_snapshot(snapshot_uri: str | None) -> dict | None:
    """Ray Train's checkpoint-manager snapshot (cluster/util/ray_internals.py), or None if there is none to read."""
    if not snapshot_uri:
        return None
    try:
        import pyarrow.fs as pafs

        filesystem, path = pafs.FileSystem.from_uri(
            snapshot_uri if "://" in snapshot_uri else Path(snapshot_uri).as_uri()
        )
        with filesystem.open_input_stream(path) as stream:
            return json.loads(stream.read())
    except Exception:
        return None
