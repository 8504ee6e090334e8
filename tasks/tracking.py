"""The MLflow side of a flow run, one task each: open the run, register the model, publish the summary."""

from __future__ import annotations

import json
import os
from urllib.parse import quote

import yaml
from mlflow.entities import RunInfo
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from gpuflow.cluster.cost.history import identity_tags
from gpuflow.cluster.lineage import DIFF_ARTIFACT, SPEC_ARTIFACT, source_tags, uncommitted_changes
from gpuflow.cluster.protocol import (
    BACKEND_TAG,
    CLUSTER_TAG,
    CONTINUED_FROM_TAG,
    FLOW_RUN_TAG,
    PREFECT_USER_TAG,
    REGISTERED_MODEL_TAG,
    SOURCE_STAMP_PREFIX,
    TRIGGERED_BY_TAG,
)
from gpuflow.cluster.rerun.links import link_rerun, rerun_tags
from gpuflow.cluster.rerun.source import source_stamp
from gpuflow.cluster.rerun.sweep_reuse import PLAN_ARTIFACT, finder, trial_plan
from gpuflow.cluster.rerun.work_key import work_key
from gpuflow.cluster.run.mlflow_run import artifact_repo, log_bytes_to, log_text_to
from gpuflow.cluster.run.record import (
    client_for,
    experiment_id,
    experiment_of,
    open_command,
    remember_experiment,
    run_url,
)
from gpuflow.cluster.spec import ExperimentSpec

REFUSED = ("UNAUTHENTICATED", "PERMISSION_DENIED")  # MLflow's 401 and 403: asking again gets the same answer
USER_TAG = "mlflow.user"  # who ran it, as MLflow's UI shows it


def not_refused(task, task_run, state) -> bool:
    """A tracking server that refused the user (wrong password, no permission) refuses a retry too: retry the rest."""
    try:
        state.result()
    except MlflowException as exc:
        return exc.error_code not in REFUSED
    except Exception:
        return True
    return True


def refusal(exc: MlflowException, spec: ExperimentSpec) -> MlflowException:
    """MLflow's 401/403, saying whom it refused and what to fix."""
    from mlflow.protos.databricks_pb2 import ErrorCode

    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if exc.error_code == "UNAUTHENTICATED":
        message = (
            f"MLflow at {spec.tracking_uri} refused user {user!r} (401): check MLFLOW_TRACKING_USERNAME / "
            "MLFLOW_TRACKING_PASSWORD"
            if user
            else f"MLflow at {spec.tracking_uri} asks who you are (401): "
            "export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (a user its admin created)"
        )
    else:
        message = (
            f"MLflow at {spec.tracking_uri}: user {user!r} lacks EDIT permission on experiment "
            f"{spec.experiment_name!r} (403): its owner or an admin grants it with `gpuflow share SPEC --user "
            f"{user}`, or change tracking.experiment"
        )
    return MlflowException(message, error_code=ErrorCode.Value(exc.error_code))


@task(name="open-mlflow-run", retries=2, retry_delay_seconds=[2, 5], retry_condition_fn=not_refused)
def open_mlflow_run(spec: ExperimentSpec, cluster_name: str, flow_run: dict) -> RunInfo:
    """Creates the run the job will log into: spec.yaml, and tags linking it to the Prefect run, saying who ran it
    and which commit of the project (MLflow's source tags, when the workdir is a git repository), with its
    uncommitted changes as source/uncommitted.diff; its work key (cluster/rerun/work_key.py), or why it has none; a
    rerun's link to the run it reran, both ways.
    Three calls to the tracking server (its experiment, the run, spec.yaml): its params go in with its price and lease
    (RunRecord.opened), in one more."""
    client = client_for(spec)
    tags = {
        FLOW_RUN_TAG: flow_run["id"],
        "prefect.flow_run_name": flow_run["name"],
        "prefect.flow_run_url": flow_run.get("url") or "",
        "prefect.deployment": flow_run.get("deployment") or "",
        BACKEND_TAG: spec.compute.backend,
        CLUSTER_TAG: cluster_name,
        "mlflow.runName": flow_run["name"],
        **source_tags(spec.workdir),
        **identity_tags(spec),  # the same loop on the same hardware: what later runs are predicted from
    }
    changes_tags, diff = uncommitted_changes(spec.workdir)
    tags.update(changes_tags)
    if tags.get(MLFLOW_GIT_COMMIT):  # before MLflow holds a copy anyone who edits the run could change
        stamp_source(flow_run["id"], source_stamp(tags[MLFLOW_GIT_COMMIT], diff))
    tags.update(work_key(spec, tags, diff).tags())  # from the source tags and diff above: git reads one tree more
    if flow_run.get("rerun_of"):
        tags.update(rerun_tags(client, flow_run["rerun_of"]))
    if flow_run.get("continues"):
        tags[CONTINUED_FROM_TAG] = flow_run["continues"]
    if os.environ.get("MLFLOW_TRACKING_USERNAME"):  # else MLflow's default
        tags[USER_TAG] = os.environ["MLFLOW_TRACKING_USERNAME"]
    if flow_run.get("created_by"):
        tags[PREFECT_USER_TAG] = flow_run["created_by"]
    if flow_run.get("triggered_by"):
        tags[TRIGGERED_BY_TAG] = flow_run["triggered_by"]
    try:
        experiment = experiment_id(client, spec)
        run = client.create_run(experiment, run_name=flow_run["name"], tags=tags)
        run_id = run.info.run_id
        remember_experiment(run_id, experiment)
        spec_yaml = yaml.safe_dump(spec.model_dump(mode="json", exclude={"secrets"}), sort_keys=False)
        artifacts = artifact_repo(run.info.artifact_uri, spec.tracking_uri)
        log_text_to(artifacts, spec_yaml, SPEC_ARTIFACT)
        if diff:
            log_bytes_to(artifacts, diff, DIFF_ARTIFACT)
        if spec.sweep and (plan := trial_plan(spec, tags, diff, finder(client, experiment), flow_run.get("reuse"))):
            log_text_to(artifacts, json.dumps(plan), PLAN_ARTIFACT)  # the trials the job trains, and those it reuses
            if reused := sum(1 for point in plan if point["reused"]):
                get_run_logger().info(f"sweep: {reused} of {len(plan)} trials trained before: reused, not trained")
        if flow_run.get("rerun_of"):
            link_rerun(client, flow_run["rerun_of"], run_id)
    except MlflowException as exc:
        if exc.error_code in REFUSED:
            raise refusal(exc, spec) from exc
        raise
    # TODO(skypilot): log the resolved SkyPilot task YAML beside spec.yaml (client.log_text(run_id, ...,
    # "sky-task.yaml")) once the SkyPilot backend can render it; the local backend has none.
    get_run_logger().info(f"MLflow run {run_id} in experiment {spec.experiment_name!r} ({spec.tracking_uri})")
    return run.info


def stamp_source(flow_run_id: str, stamp: str) -> None:
    """Records on the flow run the code it runs (SOURCE_STAMP_PREFIX): a rerun checks MLflow's copy against it."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            tags = set(client.read_flow_run(flow_run_id).tags)
            if SOURCE_STAMP_PREFIX + stamp not in tags:
                client.update_flow_run(flow_run_id, tags=sorted(tags | {SOURCE_STAMP_PREFIX + stamp}))
    except Exception as exc:  # the run goes on: a rerun of it says its code could not be verified
        get_run_logger().warning(f"could not record the run's source on its flow run: {type(exc).__name__}: {exc}")


@task(name="register-model")
def register_model(spec: ExperimentSpec, run_id: str) -> str | None:
    """Registers the model that rank 0 logged as a new version of the model named after the spec."""
    client = client_for(spec)
    models = client.search_logged_models([experiment_of(client, run_id)], filter_string=f"source_run_id = '{run_id}'")
    if not models:
        get_run_logger().info(  # as the README says a loop may: its last checkpoint is the run's `checkpoint/`
            "no model to register: the loop logged none (gpuflow.cluster.loop.log_model logs one); the run keeps its "
            "last checkpoint as artifact 'checkpoint'"
        )
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
    client.set_tag(run_id, REGISTERED_MODEL_TAG, f"{spec.name}/{version.version}")
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
    rows = [
        f"| {label} | {unit.format(metrics[key])} |" for key, (label, unit) in TELEMETRY_ROWS.items() if key in metrics
    ]
    if not rows:
        return []
    if "perf/samples_per_s" in metrics and "perf/mfu_pct" not in metrics:
        rows.append("| MFU | n/a: the loop states no FLOPs, or the device's peak is unknown (see the job's log) |")
    return ["", "**Training telemetry, last epoch**", "", "| | |", "| --- | --- |", *rows]


@task(name="publish-summary")
def publish_summary(spec: ExperimentSpec, run_id: str, summary: dict) -> None:
    """A markdown artifact on the Prefect run: the MLflow run, its link, final metrics, timings and telemetry."""
    metrics = summary.get("metrics", {})
    url = run_url(spec, run_id)
    lines = [
        f"# {spec.name}",
        f"**MLflow run** `{run_id}`: [{url}]({url})",
        f"(tracking URI `{spec.tracking_uri}`"
        + (f"; open with `{open_command(spec)}`)" if open_command(spec) else ")"),
        *(
            ["", "**Reused**: its work key is this run's: nothing was trained (`force` trains)"]
            * bool(summary.get("reused"))
        ),
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
    create_markdown_artifact(
        "\n".join(lines), key=quote(f"mlflow-{spec.name}", safe="-").lower(), description="MLflow run of this flow run"
    )


def cost_of(summary: dict) -> float | None:
    """The run's cost in dollars: summary["cost"] (a number or {"cost_usd": ...}), else the cost_usd metric."""
    cost = summary.get("cost")
    if isinstance(cost, dict):
        cost = cost.get("cost_usd")
    if cost is None:
        cost = summary.get("metrics", {}).get("cost_usd")
    return None if cost is None else float(cost)
