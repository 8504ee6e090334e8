"""The flow's MLflow run from open to close: where it lives (the experiment, its params), its lease renewed while the
flow lives, closed with the run's outcome and bill; and finding a flow run's MLflow runs from another process."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunInfo, RunTag

from gpuflow.cluster.backends import train_run_name
from gpuflow.cluster.cost.budget import settle_budget
from gpuflow.cluster.cost.deadline_run import deadline_metrics
from gpuflow.cluster.cost.predict import Prediction
from gpuflow.cluster.cost.spend import ATTEMPT_STARTED_TAG, HOURLY_METRIC, SPENT_BEFORE_METRIC
from gpuflow.cluster.protocol import (
    ATTEMPT_TAG_PREFIX,
    CHECKPOINTS_TAG,
    CLOSED_BY_TAG,
    INSTANCE_TYPE_TAG,
    LAUNCHED_TAG_PREFIX,
    NOTIFY_BLOCK_TAG,
    OPTION_TAG,
    PHASE_METRIC_PREFIX,
    PREDICTED_COST_METRIC,
    PREDICTED_WALL_METRIC,
    PRICE_SOURCE_TAG,
    STOPPED_BY_TAG,
)
from gpuflow.cluster.run.lease import LeaseKeeper, lease_tags
from gpuflow.cluster.run.lifecycle import Outcome
from gpuflow.cluster.run.mlflow_run import close_run, runs_of_flow_run
from gpuflow.cluster.spec import ExperimentSpec

log = logging.getLogger(__name__)


def client_for(spec: ExperimentSpec) -> MlflowClient:
    return MlflowClient(tracking_uri=spec.tracking_uri)


# run id -> experiment id, for the runs this process opened: asked for again (the summary's link, the registration),
# it is known without a call to the tracking server (each one a password check on a server behind basic auth).
_experiments: dict[str, str] = {}


def remember_experiment(run_id: str, experiment: str) -> None:
    _experiments[run_id] = experiment


def experiment_of(client: MlflowClient, run_id: str) -> str:
    """The run's experiment id: remembered from its opening in this process, else read from the server once."""
    if run_id not in _experiments:
        _experiments[run_id] = client.get_run(run_id).info.experiment_id
    return _experiments[run_id]


def experiment_id(client: MlflowClient, spec: ExperimentSpec) -> str:
    experiment = client.get_experiment_by_name(spec.experiment_name)
    if experiment:
        return experiment.experiment_id
    try:
        return client.create_experiment(spec.experiment_name, artifact_location=artifact_location(spec.tracking_uri))
    except Exception:  # created concurrently by another run
        return client.get_experiment_by_name(spec.experiment_name).experiment_id


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local store (sqlite:///dir/mlflow.db: dir/mlartifacts),
    not in whichever folder a run happened to start in (MLflow's default, ./mlruns); a server decides for itself."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).absolute().parent / "mlartifacts").as_uri()
    return None


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


def param(key, value):
    return Param(key, value)


def price_entries(price) -> tuple[dict[str, float], dict[str, str]]:
    """The price the run opens with, as (metrics, tags): so a run still going (or killed with its flow) can be
    priced later (cluster/cost/spend.py reads the metric)."""
    tags = {"spot": str(price.use_spot).lower(), PRICE_SOURCE_TAG: price.source}
    if price.instance_type:
        tags[INSTANCE_TYPE_TAG] = price.instance_type
    return {HOURLY_METRIC: price.hourly_usd}, tags


def prediction_metrics(prediction: Prediction | None, price) -> dict[str, float]:
    """The run's predicted wall time and cost (medians of its history), to set beside the actual ones at its close."""
    if prediction is None or not prediction.known:
        return {}
    return {PREDICTED_WALL_METRIC: prediction.wall.median, PREDICTED_COST_METRIC: prediction.cost_usd(price)}


class RunRecord:
    """The flow's MLflow run from open to close: its lease renewed meanwhile, closed with the run's outcome and bill."""

    def __init__(self, spec: ExperimentSpec, flow_run_id: str):
        self.spec, self.flow_run_id = spec, flow_run_id
        self.run_id: str | None = None
        self.artifact_uri: str | None = None
        self.phases: dict[str, float] = {}
        self.prediction: Prediction | None = None  # from the validate task; logged at open
        self._lease: LeaseKeeper | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times a phase of the run (`provision`, `teardown`, ...): `gpuflow.<name>_seconds` on the MLflow run and
        in the summary, also when the phase fails."""
        started = time.time()
        try:
            yield
        finally:
            self.phases[f"{name}_seconds"] = time.time() - started

    def opened(self, run: RunInfo, price) -> str:
        """The run is open: its params, its price, where its checkpoints go and its lease, in one call; then the
        lease is kept. Returns the run's id."""
        run_id = self.run_id = run.run_id
        self.artifact_uri = run.artifact_uri  # the job logs its files there (JobEnv)
        grace_s = self.spec.limits.orphan_grace_minutes * 60
        metrics, tags = price_entries(price)
        metrics.update(prediction_metrics(self.prediction, price))
        tags[CHECKPOINTS_TAG] = (
            f"{self.spec.checkpoint_uri.rstrip('/')}/{train_run_name(self.spec.name, self.flow_run_id)}"
        )
        tags.update(lease_tags(grace_s))
        if self.spec.notify:  # how the reaper finds the runs whose end may still be unsaid
            tags[NOTIFY_BLOCK_TAG] = self.spec.notify.block
        now = int(time.time() * 1000)
        client_for(self.spec).log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
            params=[param(k, v) for k, v in flat_params(self.spec).items()],
            tags=[RunTag(k, v) for k, v in tags.items()],
            synchronous=True,
        )
        self._lease = LeaseKeeper(client_for(self.spec), run_id, grace_s, taken=True)
        self._lease.start()
        return run_id

    def launched(self, attempt: int, info: dict, price) -> None:
        """Which option launched (its index and description, where it is) and the price it is metered at."""
        if not self.run_id or "launched" not in info:  # a local cluster, or one SkyPilot did not describe
            return
        tags = {
            OPTION_TAG: f"{info['option']}: {info['option_text']}"
            if info.get("option")
            else info.get("option_text", "unmatched"),
            "spot": str(price.use_spot).lower(),
            PRICE_SOURCE_TAG: price.source,
            **{f"{LAUNCHED_TAG_PREFIX}{key}": value for key, value in info.get("launched", {}).items()},
        }
        now = int(time.time() * 1000)
        client_for(self.spec).log_batch(
            self.run_id,
            metrics=[Metric(HOURLY_METRIC, price.hourly_usd, now, attempt)],
            tags=[RunTag(k, str(v)) for k, v in tags.items()],
            synchronous=True,
        )

    def relaunched(self, attempts: list[dict]) -> None:
        """A cluster ended and another is requested: what was spent so far, so a run still going is priced right."""
        if self.run_id:
            now = int(time.time() * 1000)
            client_for(self.spec).log_batch(
                self.run_id,
                metrics=[Metric(SPENT_BEFORE_METRIC, sum(a["cost_usd"] for a in attempts), now, len(attempts))],
                tags=[RunTag(ATTEMPT_STARTED_TAG, f"{time.time():.3f}")],
                synchronous=True,
            )

    def close(self, outcome: Outcome, bill: dict[str, float], attempts: list[dict] = ()) -> None:
        """Ends the run; the lease stops only after, so the job never sees a live run without one."""
        if self.run_id and attempts:
            self.log_attempts(attempts)
        if self.run_id and outcome.status != "FINISHED":
            keep_what_was_reported(client_for(self.spec), self.run_id)
        if self.run_id:
            metrics = {**{f"{PHASE_METRIC_PREFIX}{key}": value for key, value in self.phases.items()}, **bill}
            metrics.update(deadline_metrics(self.spec, attempts, time.time()))
            tags = {STOPPED_BY_TAG: outcome.stopped_by} if outcome.stopped_by else None
            # only a sweep's run has child runs (its trials) to end with it: no search for the others
            if not close_run(
                client_for(self.spec), self.run_id, outcome.status, metrics, tags, children=self.spec.sweep is not None
            ):
                log.warning(
                    f"MLflow at {self.spec.tracking_uri} unreachable: run {self.run_id} "
                    "left RUNNING; the reaper closes it"
                )
        else:
            close_runs_of_flow_run(self.spec, self.flow_run_id, outcome.status)
        settle_budget(self.spec, self.flow_run_id)  # the daily-budget reservation gives way to the cost just logged
        if self._lease:
            self._lease.finish()

    def log_attempts(self, attempts: list[dict]) -> None:
        """Each cluster of the run (attempt 1, 2, ...): its price and cost as metrics by step, its option as a tag."""
        now = int(time.time() * 1000)
        metrics = [
            Metric(name, float(attempt[key]), now, number)
            for number, attempt in enumerate(attempts, 1)
            for name, key in (("attempt_cost_usd", "cost_usd"), ("attempt_hourly_usd", "hourly_usd"))
        ]
        tags = [
            RunTag(
                f"{ATTEMPT_TAG_PREFIX}{number}",
                f"{a['option']}: ${a['hourly_usd']:.4g}/h, {a['seconds']:.0f} s, ${a['cost_usd']:.4f}",
            )
            for number, a in enumerate(attempts, 1)
        ]
        try:
            client_for(self.spec).log_batch(self.run_id, metrics=metrics, tags=tags, synchronous=True)
        except Exception as exc:  # the close that follows says whether MLflow is reachable
            log.warning(f"could not log the attempts' costs: {type(exc).__name__}: {exc}")


def close_runs_of_flow_run(spec: ExperimentSpec, flow_run_id: str, status: str) -> list[str]:
    """For hooks in another process: finds the flow run's MLflow runs still RUNNING and ends them."""
    client = client_for(spec)
    runs = runs_of_flow_run(client, flow_run_id, spec.experiment_name, running=True)
    for run in runs:
        keep_what_was_reported(client, run.info.run_id)
        client.set_tag(run.info.run_id, CLOSED_BY_TAG, "hook")
        client.set_terminated(run.info.run_id, status)
    return [run.info.run_id for run in runs]


def keep_what_was_reported(client, run_id: str) -> None:
    """Before the flow closes a run it stopped: its job, stopped with the cluster, took its last reports with it
    (they reach MLflow seconds behind training); what Ray Train persisted with a checkpoint is logged from there
    (cluster/job/reports.py), once, whoever closes the run."""
    from gpuflow.cluster.job.reports import fill_from_checkpoints

    try:
        if filled := fill_from_checkpoints(client, client.get_run(run_id)):
            log.info(f"MLflow run {run_id}: {filled} metric(s) logged from its persisted checkpoints")
    except Exception as exc:  # the close goes on; the reaper fills a run its job left orphaned
        log.warning(f"MLflow run {run_id}: could not log its checkpoints' metrics: {type(exc).__name__}: {exc}")


def run_url(spec: ExperimentSpec, run_id: str) -> str:
    experiment = experiment_of(client_for(spec), run_id)
    base = spec.tracking_uri if spec.tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"


def open_command(spec: ExperimentSpec) -> str | None:
    """The command that serves a local store's UI; None when tracking already goes to a server."""
    if spec.tracking_uri.startswith("http"):
        return None
    return f"mlflow ui --backend-store-uri {spec.tracking_uri} --port 5000"
