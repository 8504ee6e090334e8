"""A run and its reruns, linked both ways in MLflow (the rerun's gpuflow.rerun_of and description, the run's
gpuflow.rerun_by), and the comparison of the two that a rerun ends with."""

from __future__ import annotations

from gpuflow.cluster.cost.spend import COST_METRICS
from gpuflow.cluster.protocol import NOTE_TAG, PHASE_METRIC_PREFIX, RERUN_BY_TAG, RERUN_OF_TAG

EPOCH_METRIC = "perf/epoch_s"
TRAIN_SECONDS = f"{PHASE_METRIC_PREFIX}train_seconds"
COST_METRIC = "cost_usd"


def rerun_tags(client, old_run_id: str) -> dict[str, str]:
    """The new run's tags: which run it reruns, and a description (MLflow's UI shows it) linking that run."""
    old = client.get_run(old_run_id)
    link = f"[{old.info.run_name or old_run_id}](#/experiments/{old.info.experiment_id}/runs/{old_run_id})"
    return {
        RERUN_OF_TAG: old_run_id,
        NOTE_TAG: f"A rerun of MLflow run {link} (`{old_run_id}`): its commit, uncommitted changes and spec "
        f"(`gpuflow rerun {old_run_id}`).",
    }


def link_rerun(client, old_run_id: str, new_run_id: str) -> None:
    """Adds the new run to the old one's reruns: all are kept, oldest first (an MLflow tag holds 8000 characters:
    over 200 reruns)."""
    reruns = [run for run in client.get_run(old_run_id).data.tags.get(RERUN_BY_TAG, "").split(",") if run]
    if new_run_id not in reruns:
        client.set_tag(old_run_id, RERUN_BY_TAG, ",".join([*reruns, new_run_id]))


def latest_rerun(client, experiment: str, old_run_id: str) -> str | None:
    """The newest run of the experiment (by name) that reran `old_run_id`, or None."""
    found = client.get_experiment_by_name(experiment)
    runs = found and client.search_runs(
        [found.experiment_id],
        f"tags.`{RERUN_OF_TAG}` = '{old_run_id}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def epoch_seconds(run) -> float | None:
    """Time per epoch: the loop's perf/epoch_s, else the train phase over the epochs."""
    metrics, epochs = run.data.metrics, run.data.params.get("train.epochs")
    if EPOCH_METRIC in metrics:
        return metrics[EPOCH_METRIC]
    if TRAIN_SECONDS in metrics and epochs and epochs.isdigit() and int(epochs) > 0:
        return metrics[TRAIN_SECONDS] / int(epochs)
    return None


def comparison(old_run, new_run) -> list[str]:
    """Lines comparing the two runs: final metrics (the loop's), time per epoch, cost."""
    old, new = old_run.data.metrics, new_run.data.metrics
    loop_metrics = sorted(key for key in set(old) | set(new) if not is_bookkeeping(key))
    rows = [(key, old.get(key), new.get(key)) for key in loop_metrics]
    rows.append(("time per epoch (s)", epoch_seconds(old_run), epoch_seconds(new_run)))
    rows.append(("cost (USD)", old.get(COST_METRIC), new.get(COST_METRIC)))
    width = max(len(row[0]) for row in rows)
    lines = [f"{'':{width}}  {'was':>12}  {'now':>12}"]
    for name, then, now in rows:
        change = "" if then is None or now is None or then == now else f"  ({now - then:+.4g})"
        lines.append(f"{name:{width}}  {shown(then):>12}  {shown(now):>12}{change}")
    return lines


def is_bookkeeping(key: str) -> bool:
    """gpuflow's own figures (phases, the meter's hours and dollars, telemetry), not what the loop reported."""
    return (
        key in COST_METRICS
        or key.startswith((PHASE_METRIC_PREFIX, "perf/", "system/"))
        or key.endswith(("_seconds", "_hours", "_usd"))
    )


def shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"
