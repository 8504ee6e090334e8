"""A `ray.train.report` as gpuflow logs it (cluster/job/tracking.py): its numbers as MLflow metric keys, its step,
its checkpoint's URI; and the reports of the checkpoints Ray Train persisted, which a resumed attempt logs again, and
a run closed before its job logged them gets from there (`fill_from_checkpoints`); a sweep's best trial, on its parent
run (`record_best`)."""

from __future__ import annotations

import json
import numbers
import re
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuflow.cluster.protocol import BEST_RUN_TAG, CHECKPOINT_TAG, CHECKPOINTS_TAG, FILLED_TAG
from gpuflow.cluster.util.ray_internals import SNAPSHOT_FILE

MAX_METRICS_PER_CALL = 1000  # MLflow's log_batch limit
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
    """The persisted reports of a snapshot read already (read_snapshot), by step, each at its checkpoint's time."""
    reports = []
    for result in snapshot.get("checkpoint_results", []):
        step_key, step = step_of(result.get("metrics", {}))
        if step is not None:
            values = numbers_of({k: v for k, v in result["metrics"].items() if k != step_key})
            reports.append(Report(-1, step, values, None, report_time_ms(result.get("checkpoint_dir_name"))))
    return sorted(reports, key=lambda report: report.step)


def report_time_ms(checkpoint_path: str | None) -> int:
    """A report's time in MLflow: when Ray Train named its checkpoint's folder (checkpoint_<local date and time>, its
    default), so that the job's tracker and `fill_from_checkpoints` log a step with the same time, value and step,
    which MLflow keeps once; now for a report without a checkpoint, or a folder the loop named itself."""
    try:
        name = (checkpoint_path or "").rstrip("/").rsplit("/", 1)[-1]
        return int(datetime.strptime(name, "checkpoint_%Y-%m-%d_%H-%M-%S.%f").timestamp() * 1000)
    except ValueError:
        return int(time.time() * 1000)


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


# What a dying run's job reported and Ray Train persisted with a checkpoint, but MLflow never got. The job logs its
# reports in batches, seconds behind training: stopped with its flow, it takes the last ones with it, while their
# checkpoints, and Ray Train's record of each checkpoint's metrics, are in storage. Before the job's guard
# (cluster/job/guard.py) or, where the job died unwarned, the reaper leaves such a run closed, it logs each persisted
# report's metrics at its step (those the run lacks, once, at the checkpoint's time) and tags the last checkpoint as
# the job would have.
def fill_from_checkpoints(client, run) -> int:
    """Logs what the run's persisted checkpoints reported and the run lacks; returns how many metrics."""
    from mlflow.entities import Metric, RunTag

    folder = run.data.tags.get(CHECKPOINTS_TAG)
    if not folder or FILLED_TAG in run.data.tags:
        return 0
    snapshot = read_snapshot(f"{folder.rstrip('/')}/{SNAPSHOT_FILE}") or {}
    held: dict[str, set[int]] = {}
    metrics = []
    for report in reports_of(snapshot):
        for key, value in report.metrics.items():
            if key not in held:
                history = client.get_metric_history(run.info.run_id, key) if key in run.data.metrics else []
                held[key] = {metric.step for metric in history}
            if report.step not in held[key]:
                held[key].add(report.step)
                metrics.append(Metric(key, value, report.at_ms, report.step))
    tags = [RunTag(FILLED_TAG, str(len(metrics)))]
    last = last_checkpoint(snapshot)
    if last and int(run.data.tags.get(CHECKPOINT_TAG + "_step", -1)) < last[1]:
        tags += [
            RunTag(CHECKPOINT_TAG, f"{folder.rstrip('/')}/{last[0]}"),
            RunTag(CHECKPOINT_TAG + "_step", str(last[1])),
        ]
    for start in range(0, max(len(metrics), 1), MAX_METRICS_PER_CALL):
        batch = metrics[start : start + MAX_METRICS_PER_CALL]
        client.log_batch(run.info.run_id, metrics=batch, tags=tags if start == 0 else [])
    return len(metrics)


def last_checkpoint(snapshot: dict) -> tuple[str, int] | None:
    """The last persisted checkpoint's folder name and step (its report's epoch), if any."""
    results = snapshot.get("checkpoint_results", [])
    stepped = [(result["checkpoint_dir_name"], step_of(result.get("metrics", {}))[1]) for result in results]
    stepped = [(name, step) for name, step in stepped if step is not None]
    return max(stepped, key=lambda found: found[1]) if stepped else None


def record_best(client, parent_run_id: str | None, metric: str, score: float | None, outcome: dict) -> None:
    """The parent run says which trial won, with what values and score, and how the sweep went."""
    if not parent_run_id:
        return
    for path, value in outcome["best_values"].items():
        client.log_param(parent_run_id, f"best.{path}", value)
    figures = {
        f"best_{metric}": score,
        **{
            f"sweep/{key}": outcome[key]
            for key in ("trials", "reused_trials", "failed_trials", "stopped_early", "placement_groups_reserved")
        },
    }
    for key, value in figures.items():
        if value is not None:
            client.log_metric(parent_run_id, key, float(value))
    if outcome["best_run_id"]:
        client.set_tag(parent_run_id, BEST_RUN_TAG, outcome["best_run_id"])
