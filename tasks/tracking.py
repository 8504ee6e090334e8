"""The MLflow side of a flow run: open the run, close it with the flow's outcome, link the two both ways."""

from __future__ import annotations

import json
from urllib.parse import quote

import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from gpuflow.cluster.backends import train_run_name
from gpuflow.cluster.run.lease import LeaseKeeper
from gpuflow.cluster.run.lifecycle import Outcome
from gpuflow.cluster.run.mlflow_run import close_run
from gpuflow.cluster.protocol import CHECKPOINTS_TAG, FLOW_RUN_TAG, STOPPED_BY_TAG
from gpuflow.cluster.config import state_dir
from gpuflow.cluster.spec import ExperimentSpec
from gpuflow.tasks.cost import record_estimate, settle_budget



def client_for(spec: ExperimentSpec) -> MlflowClient:
    return MlflowClient(tracking_uri=spec.tracking_uri)


def experiment_id(client: MlflowClient, spec: ExperimentSpec) -> str:
    experiment = client.get_experiment_by_name(spec.experiment_name)
    if experiment:
        return experiment.experiment_id
    # A local store keeps artifacts beside it under .gpuflow/, not in the working directory.
    location = None if spec.tracking.uri else (state_dir() / "mlartifacts").as_uri()
    try:
        return client.create_experiment(spec.experiment_name, artifact_location=location)
    except Exception:  # created concurrently by another run
        return client.get_experiment_by_name(spec.experiment_name).experiment_id


def flat_params(spec: ExperimentSpec) -> dict[str, str]:
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        else:
            flat[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)

    walk("", spec.model_dump(exclude={"secrets", "envs"}))
    return {key: value[:6000] for key, value in flat.items()}


@task(name="open-mlflow-run", retries=2, retry_delay_seconds=[2, 5])
def open_mlflow_run(spec: ExperimentSpec, cluster_name: str, flow_run: dict) -> str:
    """Creates the run the job will log into: params, the spec, and tags linking it to the Prefect run."""
    client = client_for(spec)
    tags = {
        FLOW_RUN_TAG: flow_run["id"],
        "prefect.flow_run_name": flow_run["name"],
        "prefect.flow_run_url": flow_run.get("url") or "",
        "prefect.deployment": flow_run.get("deployment") or "",
        "gpuflow.backend": spec.compute.backend,
        "gpuflow.cluster": cluster_name,
        "mlflow.runName": flow_run["name"],
    }
    run = client.create_run(experiment_id(client, spec), run_name=flow_run["name"], tags=tags)
    run_id = run.info.run_id
    client.log_batch(run_id, params=[_param(k, v) for k, v in flat_params(spec).items()], synchronous=True)
    client.log_text(run_id, yaml.safe_dump(spec.model_dump(mode="json", exclude={"secrets"}), sort_keys=False), "spec.yaml")
    # TODO(skypilot): log the resolved SkyPilot task YAML beside spec.yaml (client.log_text(run_id, ..., "sky-task.yaml"))
    # once the SkyPilot backend can render it; the local backend has none.
    get_run_logger().info(f"MLflow run {run_id} in experiment {spec.experiment_name!r} ({spec.tracking_uri})")
    return run_id


def _param(key, value):
    from mlflow.entities import Param

    return Param(key, value)


class RunRecord:
    """The flow's MLflow run from open to close: its lease renewed meanwhile, closed with the run's outcome and bill."""

    def __init__(self, spec: ExperimentSpec, flow_run_id: str):
        self.spec, self.flow_run_id = spec, flow_run_id
        self.run_id: str | None = None
        self.phases: dict[str, float] = {}
        self._lease: LeaseKeeper | None = None

    def opened(self, run_id: str, price) -> str:
        self.run_id = run_id
        record_estimate(self.spec, run_id, price)
        checkpoints = f"{self.spec.checkpoint_uri.rstrip('/')}/{train_run_name(self.spec.name, self.flow_run_id)}"
        client_for(self.spec).set_tag(run_id, CHECKPOINTS_TAG, checkpoints)
        self._lease = LeaseKeeper(client_for(self.spec), run_id, self.spec.limits.orphan_grace_minutes * 60)
        self._lease.start()
        return run_id

    def close(self, outcome: Outcome, bill: dict[str, float]) -> None:
        """Ends the run; the lease stops only after, so the job never sees a live run without one."""
        if self.run_id:
            metrics = {**{f"gpuflow.{key}": value for key, value in self.phases.items()}, **bill}
            tags = {STOPPED_BY_TAG: outcome.stopped_by} if outcome.stopped_by else None
            if not close_run(client_for(self.spec), self.run_id, outcome.status, metrics, tags):
                get_run_logger().warning(f"MLflow at {self.spec.tracking_uri} unreachable: run {self.run_id} "
                                         "left RUNNING; the reaper closes it")
        else:
            close_runs_of_flow_run(self.spec, self.flow_run_id, outcome.status)
        settle_budget(self.spec, self.flow_run_id)  # the daily-budget reservation gives way to the cost just logged
        if self._lease:
            self._lease.finish()


def close_runs_of_flow_run(spec: ExperimentSpec, flow_run_id: str, status: str) -> list[str]:
    """For hooks in another process: finds the flow run's MLflow runs still RUNNING and ends them."""
    client = client_for(spec)
    experiment = client.get_experiment_by_name(spec.experiment_name)
    if not experiment:
        return []
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}' and attributes.status = 'RUNNING'",
    )
    for run in runs:
        client.set_tag(run.info.run_id, "gpuflow.closed_by", "hook")
        client.set_terminated(run.info.run_id, status)
    return [run.info.run_id for run in runs]


def run_url(spec: ExperimentSpec, run_id: str) -> str:
    client = client_for(spec)
    experiment = client.get_run(run_id).info.experiment_id
    base = spec.tracking_uri if spec.tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"


def open_command(spec: ExperimentSpec) -> str | None:
    """The command that serves a local store's UI; None when tracking already goes to a server."""
    if spec.tracking_uri.startswith("http"):
        return None
    return f"mlflow ui --backend-store-uri {spec.tracking_uri} --port 5000"


@task(name="register-model")
def register_model(spec: ExperimentSpec, run_id: str) -> str | None:
    """Registers the model that rank 0 logged as a new version of the model named after the spec."""
    client = client_for(spec)
    experiment = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models([experiment], filter_string=f"source_run_id = '{run_id}'")
    if not models:
        get_run_logger().warning("the training loop logged no model (gpuflow.cluster.loop.log_model): nothing to register")
        return None
    import mlflow

    mlflow.set_tracking_uri(spec.tracking_uri)  # where the registry looks up the logged model of `models:/<id>`
    try:  # the client, not mlflow.register_model: that one prints its progress to stderr, past the quiet console
        client.create_registered_model(spec.name)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    model_id = models[0].model_id
    version = client.create_model_version(spec.name, f"models:/{model_id}", run_id=run_id, model_id=model_id)
    client.set_tag(run_id, "gpuflow.registered_model", f"{spec.name}/{version.version}")
    get_run_logger().info(f"registered model {spec.name!r} version {version.version}")
    return version.version


# The loop's per-epoch telemetry (cluster/telemetry.py), as the summary shows the last epoch's values.
TELEMETRY_ROWS = {
    "perf/samples_per_s": ("throughput", "{:,.1f} samples/s"),
    "perf/tokens_per_s": ("tokens", "{:,.0f} tokens/s"),
    "perf/step_time_ms": ("step time", "{:.1f} ms"),
    "perf/data_wait_pct": ("waiting for data", "{:.1f} % of step time"),
    "perf/mfu_pct": ("MFU", "{:.1f} %"),
    "perf/peak_memory_mb": ("peak memory (rank 0)", "{:,.0f} MiB"),
    "perf/epoch_s": ("epoch wall time", "{:.1f} s"),
    "perf/worker_rss_mb": ("worker RSS (rank 0)", "{:,.0f} MiB"),
}


def telemetry_lines(metrics: dict) -> list[str]:
    """A markdown table of the last epoch's telemetry; empty when the job reported none."""
    rows = [f"| {label} | {unit.format(metrics[key])} |" for key, (label, unit) in TELEMETRY_ROWS.items() if key in metrics]
    if not rows:
        return []
    if "perf/samples_per_s" in metrics and "perf/mfu_pct" not in metrics:
        rows.append("| MFU | n/a: the loop states no FLOPs, or the device's peak is unknown (see the job's log) |")
    return ["", "**Training telemetry, last epoch**", "", "| | |", "| --- | --- |", *rows]


@task(name="publish-summary")
def publish_summary(spec: ExperimentSpec, run_id: str, summary: dict) -> None:
    """A markdown artifact on the Prefect run: the MLflow run, its link, final metrics, timings and telemetry."""
    metrics = summary.get("metrics", {})
    lines = [
        f"# {spec.name}",
        f"**MLflow run** `{run_id}`: [{run_url(spec, run_id)}]({run_url(spec, run_id)})",
        f"(tracking URI `{spec.tracking_uri}`" + (f"; open with `{open_command(spec)}`)" if open_command(spec) else ")"),
        "",
        "| metric | value |",
        "| --- | --- |",
        *[f"| {key} | {value:.4g} |" for key, value in metrics.items() if key not in TELEMETRY_ROWS],
        *[f"| {key} | {value:.1f} s |" for key, value in summary.get("phases", {}).items()],
        *[f"| cost | ${value:.2f} |" for value in [cost_of(summary)] if value is not None],
        *telemetry_lines(metrics),
        "",
        f"Price: {summary['price']}" if summary.get("price") else "",
        f"Checkpoints: `{summary.get('checkpoint')}`",
    ]
    create_markdown_artifact("\n".join(lines), key=quote(f"mlflow-{spec.name}", safe="-").lower(), description="MLflow run of this flow run")


def cost_of(summary: dict) -> float | None:
    """The run's cost in dollars: summary["cost"] (a number or {"cost_usd": ...}), else the cost_usd metric."""
    cost = summary.get("cost")
    if isinstance(cost, dict):
        cost = cost.get("cost_usd")
    if cost is None:
        cost = summary.get("metrics", {}).get("cost_usd")
    return None if cost is None else float(cost)
