"""What a dead run's job reported and Ray Train persisted with a checkpoint, but MLflow never got.

The job logs its reports in batches, seconds behind training: killed with its flow, it takes the last ones with it,
while their checkpoints, and Ray Train's record of each checkpoint's metrics, are in storage. Before the reaper leaves
such a run closed, it logs each persisted report's metrics at its step (those the run lacks, once) and tags the last
checkpoint as the job would have."""

from __future__ import annotations

import time

from gpuflow.cluster.job.reports import read_snapshot, reports_of, step_of
from gpuflow.cluster.protocol import CHECKPOINT_TAG, CHECKPOINTS_TAG, FILLED_TAG
from gpuflow.cluster.util.ray_internals import SNAPSHOT_FILE


def fill_from_checkpoints(client, run) -> int:
    """Logs what the run's persisted checkpoints reported and the run lacks; returns how many metrics."""
    from mlflow.entities import Metric, RunTag

    folder = run.data.tags.get(CHECKPOINTS_TAG)
    if not folder or FILLED_TAG in run.data.tags:
        return 0
    snapshot = read_snapshot(f"{folder.rstrip('/')}/{SNAPSHOT_FILE}") or {}
    held: dict[str, set[int]] = {}
    metrics, now_ms = [], int(time.time() * 1000)
    for report in reports_of(snapshot):
        for key, value in report.metrics.items():
            if key not in held:
                history = client.get_metric_history(run.info.run_id, key) if key in run.data.metrics else []
                held[key] = {metric.step for metric in history}
            if report.step not in held[key]:
                held[key].add(report.step)
                metrics.append(Metric(key, value, now_ms, report.step))
    tags = [RunTag(FILLED_TAG, str(len(metrics)))]
    last = last_checkpoint(snapshot)
    if last and int(run.data.tags.get(CHECKPOINT_TAG + "_step", -1)) < last[1]:
        tags += [
            RunTag(CHECKPOINT_TAG, f"{folder.rstrip('/')}/{last[0]}"),
            RunTag(CHECKPOINT_TAG + "_step", str(last[1])),
        ]
    for start in range(0, max(len(metrics), 1), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[start : start + 1000], tags=tags if start == 0 else [])
    return len(metrics)


def last_checkpoint(snapshot: dict) -> tuple[str, int] | None:
    """The last persisted checkpoint's folder name and step (its report's epoch), if any."""
    results = snapshot.get("checkpoint_results", [])
    stepped = [(result["checkpoint_dir_name"], step_of(result.get("metrics", {}))[1]) for result in results]
    stepped = [(name, step) for name, step in stepped if step is not None]
    return max(stepped, key=lambda found: found[1]) if stepped else None
