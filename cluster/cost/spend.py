"""What runs have cost, read back from MLflow: the ledger behind `gpuflow cost` and the daily budget.

gpuflow cost --since 7d                     # every gpuflow run of the tracking URI, and the totals
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from mlflow import MlflowClient
from mlflow.entities import ViewType

from gpuflow.cluster.protocol import ATTEMPT_STARTED_TAG, BACKEND_TAG, FLOW_RUN_TAG, HOURLY_METRIC, STOPPED_BY_TAG

COST_METRICS = ("cost_usd", "gpu_hours", "cluster_hours", "provision_seconds", "idle_seconds_before_teardown")
SINCE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
# A run relaunched (a lost spot cluster, the on-demand fallback) logs what its earlier clusters cost and when the
# current one was requested: a run still going is priced as those plus the current price since then.
SPENT_BEFORE_METRIC = "spent_before_attempt_usd"


@dataclass
class RunCost:
    run_id: str
    experiment: str
    name: str
    status: str
    started_at: float
    cost_usd: float  # logged at the end; else (still running, or died) its hourly price × its duration
    gpu_hours: float
    cluster_hours: float
    spot: str
    stopped_by: str
    estimated: bool  # cost from the hourly price, not from the run's own cost_usd
    flow_run_id: str = ""  # the Prefect flow run it belongs to (its budget reservation has the same owner)


def run_costs(tracking_uri: str, since: float) -> list[RunCost]:
    """Every gpuflow run started at or after `since` (epoch seconds), in every experiment of the store."""
    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = {e.experiment_id: e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    if not experiments:
        return []
    rows, token = [], None
    while True:
        page = client.search_runs(
            list(experiments),
            filter_string=f"attributes.start_time >= {int(since * 1000)}",
            max_results=1000,
            order_by=["attributes.start_time ASC"],
            page_token=token,
        )
        rows += [row_of(run, experiments) for run in page if BACKEND_TAG in run.data.tags]
        token = page.token
        if not token:
            return rows


def row_of(run, experiments: dict[str, str]) -> RunCost:
    metrics, tags, info = run.data.metrics, run.data.tags, run.info
    # No cost_usd: the run is still going, or its flow died before logging it (closed by a hook or the reaper).
    estimated = "cost_usd" not in metrics
    if estimated:
        ended_s = info.end_time / 1000 if info.end_time else time.time()
        since_s = float(tags.get(ATTEMPT_STARTED_TAG, 0)) if SPENT_BEFORE_METRIC in metrics else info.start_time / 1000
        cost = (
            metrics.get(SPENT_BEFORE_METRIC, 0.0) + metrics.get(HOURLY_METRIC, 0.0) * max(0.0, ended_s - since_s) / 3600
        )
    else:
        cost = metrics["cost_usd"]
    return RunCost(
        info.run_id,
        experiments.get(info.experiment_id, info.experiment_id),
        info.run_name or "",
        info.status,
        info.start_time / 1000,
        cost,
        metrics.get("gpu_hours", 0.0),
        metrics.get("cluster_hours", 0.0),
        tags.get("spot", ""),
        tags.get(STOPPED_BY_TAG, ""),
        estimated,
        tags.get(FLOW_RUN_TAG, ""),
    )


def start_of_today_utc(now: float | None = None) -> float:
    today = datetime.fromtimestamp(now if now is not None else time.time(), timezone.utc)
    return today.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


def parse_since(text: str) -> float:
    """'7d', '12h', '30m', '2w' → seconds."""
    match = SINCE.match(text.strip())
    if not match:
        raise ValueError(f"--since {text!r}: write a number and a unit (s, m, h, d, w), e.g. 7d or 12h")
    return float(match.group(1)) * UNIT_SECONDS[match.group(2)]


def format_table(rows: list[RunCost]) -> str:
    """The runs one per line, then the totals; a cost still accruing is marked with '~'."""
    header = (
        f"{'started (UTC)':<17} {'experiment':<18} {'run':<32} {'status':<8} {'stopped_by':<10} {'spot':<5} "
        f"{'cluster_h':>9} {'gpu_h':>7} {'cost_usd':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        started = datetime.fromtimestamp(row.started_at, timezone.utc).strftime("%Y-%m-%d %H:%M")
        cost = f"{'~' if row.estimated else ''}{row.cost_usd:.2f}"
        lines.append(
            f"{started:<17} {row.experiment[:18]:<18} {row.name[:32]:<32} {row.status[:8]:<8} "
            f"{row.stopped_by[:10]:<10} {row.spot[:5]:<5} {row.cluster_hours:>9.3f} {row.gpu_hours:>7.2f} "
            f"{cost:>9}"
        )
    lines.append("-" * len(header))
    total = sum(row.cost_usd for row in rows)
    lines.append(
        f"{len(rows)} run(s): ${total:.2f}, {sum(r.cluster_hours for r in rows):.3f} cluster-hours, "
        f"{sum(r.gpu_hours for r in rows):.2f} GPU-hours"
    )
    return "\n".join(lines)
