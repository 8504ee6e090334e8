"""A hyper-parameter sweep on one cluster: Ray Tune runs trials, each a Ray Train run with its own MLflow child run.

    sweep: {parameters: {train.lr: {grid: [0.001, 0.01]}}, metric: val_accuracy, mode: max}   # in the spec

cluster/job/__main__.py calls `run_sweep` when the spec has a sweep. Each trial is a Tune function that builds and fits
a TorchTrainer (a trainer handed to the Tuner is deprecated); its reports reach Tune (TuneReportCallback, for ASHA)
and its own MLflow run, a child of the flow's (cluster/job/tracking.py). The driver side (`TrialRuns`) ends each child
run with the trial's outcome and frees what a stopped trial leaves behind. No orchestrator here; Ray Tune is
imported with this module, which only the job on the cluster (and its trials) loads.
"""

from __future__ import annotations

import time
from typing import Any

from mlflow import MlflowClient
from ray import tune
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY, TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, TrialScheduler

from gpuflow.cluster.backends.base import TRIAL_DRIVER_RESOURCE
from gpuflow.cluster.job.reports import record_best
from gpuflow.cluster.job.trainer import build_trainer
from gpuflow.cluster.protocol import (
    BACKEND_TAG,
    CHECKPOINT_TAG,
    CLUSTER_TAG,
    FLOW_RUN_TAG,
    PLACEMENT_GROUP_TAG,
    STOPPED_BY_TAG,
    TRIAL_ID_TAG,
    WORK_KEY_TAG,
    JobEnv,
    trial_line,
)
from gpuflow.cluster.rerun.sweep_reuse import read_plan, reuse_trials
from gpuflow.cluster.run.mlflow_run import close_children, close_run
from gpuflow.cluster.spec import ExperimentSpec, job_spec, max_epochs, trial_train
from gpuflow.cluster.util.ray_internals import (  # no public hook yet
    WorkerGroupCallback,
    free_placement_group,
    placement_group_of,
    reserved_placement_groups,
)

PARENT_RUN_TAG = "mlflow.parentRunId"  # how MLflow (and its UI) nests a child run under its parent
STOPPED_EARLY_TAG = "stopped_early"
# The tags a child run copies from its parent: the flow run's hooks and the reaper find runs by them.
INHERITED_TAGS = (FLOW_RUN_TAG, "prefect.flow_run_name", "prefect.flow_run_url", CLUSTER_TAG, BACKEND_TAG)


POINT = "planned_trial"  # a planned trial's values and key, as Tune's config holds them (cluster/rerun/sweep_reuse.py)


def search_space(spec: ExperimentSpec, plan: list[dict] | None = None) -> dict[str, Any]:
    """Tune's param_space: one entry per swept field, keyed by its dotted path in the spec; with the flow's plan, the
    points it leaves to train, each with its key."""
    if plan is not None:
        return {POINT: tune.grid_search([{"values": p["values"], "key": p["key"]} for p in plan if not p["reused"]])}
    sample = {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "uniform": lambda bounds: tune.uniform(*bounds),
        "loguniform": lambda bounds: tune.loguniform(*bounds),
    }
    return {path: sample[p.kind](getattr(p, p.kind)) for path, p in spec.sweep.parameters.items()}


def trial_spec(spec: ExperimentSpec, values: dict[str, Any]) -> ExperimentSpec:
    """The spec one trial trains: the sweep's values in place (its sweep still says how many workers a trial has)."""
    return spec.model_copy(update={"train": trial_train(spec.train, values)})


def trial_name(trial_id: str, values: dict[str, Any]) -> str:
    """E.g. 'trial-00003 lr=0.01 hidden=128': the trial's number and values, as the MLflow runs table shows it."""
    shown = [
        f"{path.rsplit('.', 1)[-1]}={value:g}" if isinstance(value, float) else f"{path.rsplit('.', 1)[-1]}={value}"
        for path, value in values.items()
    ]
    return " ".join([f"trial-{trial_id.rsplit('_', 1)[-1]}", *shown])


def point_of(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A trial's values, and its key where the flow planned it."""
    point = config.get(POINT)
    return (point["values"], point["key"]) if point else (config, None)


# -- in the trial's actor ----------------------------------------------------------------------------
def open_child_run(client, parent_run_id: str, trial_id: str, values: dict[str, Any], key: str | None = None) -> str:
    """The trial's MLflow run, nested under the flow's: its values as params, the flow run's links and the trial's
    work key as tags."""
    parent = client.get_run(parent_run_id)
    name = trial_name(trial_id, values)
    tags = {
        PARENT_RUN_TAG: parent_run_id,
        TRIAL_ID_TAG: trial_id,
        "mlflow.runName": name,
        **{key: parent.data.tags[key] for key in INHERITED_TAGS if key in parent.data.tags},
        **({WORK_KEY_TAG: key} if key else {}),
    }
    run = client.create_run(parent.info.experiment_id, run_name=name, tags=tags)
    for path, value in values.items():
        client.log_param(run.info.run_id, path, value)
    return run.info.run_id


def run_trial(config: dict[str, Any], spec_json: str, run_name: str) -> None:
    """One trial, inside Tune: a TorchTrainer on the trial's spec, reporting to Tune and to the trial's MLflow run."""
    values, key = point_of(config)
    spec = trial_spec(job_spec(spec_json), values)
    trial_id = tune.get_context().get_trial_id()
    parent_run_id = JobEnv.from_env().mlflow_run_id
    child_run_id = open_child_run(MlflowClient(), parent_run_id, trial_id, values, key) if parent_run_id else None
    callbacks = [TuneReportCallback()] + ([PlacementGroupTag(child_run_id)] if child_run_id else [])
    build_trainer(spec, f"{run_name}-{trial_id}", run_id=child_run_id, callbacks=callbacks).fit()


class PlacementGroupTag(WorkerGroupCallback):
    """In the trial's Ray Train controller: records the workers' placement group on the trial's run, so that the
    sweep's driver can free it when Tune stops the trial (Ray's own cleaner needs the dashboard, which is off)."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def after_worker_group_start(self, worker_group) -> None:
        group = placement_group_of(worker_group)
        MlflowClient().set_tag(self.run_id, PLACEMENT_GROUP_TAG, group.id.hex())


# -- in the sweep's driver (the job) -------------------------------------------------------------------
def early_stopping_scheduler(spec: ExperimentSpec):
    """ASHA on the trials' reports (one per epoch), or None when the spec does not stop trials early."""
    if spec.sweep.early_stopping is None:
        return None

    class EarlyStopping(ASHAScheduler):
        """ASHA that remembers whom it stopped early, and lets a trial at its last epoch end by itself (so that it
        logs its model) instead of being stopped a moment before."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.stopped_early: set[str] = set()

        def on_trial_result(self, tune_controller, trial, result: dict) -> str:
            decision = super().on_trial_result(tune_controller, trial, result)
            if decision == TrialScheduler.STOP:
                if result.get("training_iteration", 0) >= trial.config.get("train.epochs", spec.train.epochs):
                    return TrialScheduler.CONTINUE
                self.stopped_early.add(trial.trial_id)
            return decision

    stopping = spec.sweep.early_stopping
    return EarlyStopping(
        max_t=max_epochs(spec), grace_period=stopping.grace_epochs, reduction_factor=stopping.reduction_factor
    )


class TrialRuns(tune.Callback):
    """Ends each trial's MLflow run with the trial's outcome (FINISHED also when stopped early or at
    max_trial_minutes, tagged so; FAILED on an error), with its share of the cluster's cost, and frees the placement
    group a stopped trial leaves reserved."""

    def __init__(self, spec: ExperimentSpec, scheduler, hourly_usd: float):
        self.spec, self.scheduler, self.hourly_usd = spec, scheduler, hourly_usd
        self.share = spec.workers_per_trial / spec.compute.num_workers  # of the cluster, while the trial runs
        self.client = MlflowClient()
        self.parent_run_id = JobEnv.from_env().mlflow_run_id
        self.started_at: dict[str, float] = {}
        self.done = 0

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.started_at[trial.trial_id] = time.time()

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._end(trial, "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._end(trial, "FAILED")

    def _end(self, trial, status: str) -> None:
        self.done += 1
        stopped_early = trial.trial_id in getattr(self.scheduler, "stopped_early", ())
        limit_s = (self.spec.sweep.max_trial_minutes or 0) * 60
        timed_out = bool(limit_s) and (trial.last_result or {}).get("time_total_s", 0) >= limit_s
        seconds = time.time() - self.started_at.get(trial.trial_id, time.time())
        run = self.child_run(trial.trial_id)
        if run is not None:
            free_placement_group(run.data.tags.get(PLACEMENT_GROUP_TAG))
            tags = {
                STOPPED_EARLY_TAG: str(stopped_early).lower(),
                **({STOPPED_BY_TAG: "max_trial_minutes"} if timed_out and not stopped_early else {}),
            }
            close_run(
                self.client,
                run.info.run_id,
                status,
                tags=tags,
                metrics={"trial_seconds": seconds, "cost_usd": self.hourly_usd * self.share * seconds / 3600},
            )
        outcome = "stopped early" if stopped_early else "stopped at max_trial_minutes" if timed_out else status.lower()
        print(
            trial_line(trial.trial_id, f"{outcome} after {seconds:.1f}s", self.done, self.spec.sweep.num_trials),
            flush=True,
        )

    def child_run(self, trial_id: str):
        if not self.parent_run_id:
            return None
        experiment = self.client.get_run(self.parent_run_id).info.experiment_id
        found = self.client.search_runs(
            [experiment], f"tags.`{PARENT_RUN_TAG}` = '{self.parent_run_id}' and tags.`{TRIAL_ID_TAG}` = '{trial_id}'"
        )
        return found[0] if found else None


def run_sweep(spec: ExperimentSpec, run_name: str) -> dict:
    """Runs every trial (at most max_concurrent_trials at once) but those the flow's plan found trained already;
    records the best of both on the parent run; the summary."""
    sweep = spec.sweep
    scheduler = early_stopping_scheduler(spec)
    trial_runs = TrialRuns(spec, scheduler, JobEnv.from_env().hourly_usd or 0.0)
    client, parent_id = trial_runs.client, trial_runs.parent_run_id
    if parent_id:  # a relaunch after a lost cluster starts the sweep over: the lost trials failed
        close_children(client, parent_id, "FAILED")
    plan = read_plan(client, parent_id) if parent_id else None
    reused = reuse_trials(client, parent_id, plan or [], INHERITED_TAGS)  # (point, the run that trained it) each
    trial_runs.done, left = len(reused), plan is None or len(reused) < len(plan)
    results = fit(spec, run_name, search_space(spec, plan), scheduler, trial_runs) if left else []
    reserved = reserved_placement_groups()
    trained = [r for r in results if not r.error and sweep.metric in (r.metrics or {})]
    scored = [(r.metrics[sweep.metric], r) for r in trained] + [
        (run.data.metrics[sweep.metric], (point, run)) for point, run in reused if sweep.metric in run.data.metrics
    ]
    if not scored:
        errors = [str(r.error).splitlines()[0] for r in results if r.error][:3]
        raise RuntimeError(f"no trial of the sweep reported {sweep.metric!r}; first errors: {errors}")
    best = (max if sweep.mode == "max" else min)(scored, key=lambda pair: pair[0])[1]
    if isinstance(best, tuple):  # an earlier run's: its model and last checkpoint are that run's
        (point, run), best_run = best, best[1]
        values, raw, checkpoint, storage = point["values"], run.data.metrics, run.data.tags.get(CHECKPOINT_TAG), None
    else:
        best_run = trial_runs.child_run(best.metrics["trial_id"])
        values, raw = point_of(best.config)[0], best.metrics
        # the trial's last checkpoint, persisted by its Ray Train run (Tune holds only its path)
        checkpoint, storage = best.metrics.get(CHECKPOINT_PATH_KEY), best.path
    outcome = {
        "best_run_id": best_run.info.run_id if best_run else None,
        "best_values": {path: values[path] for path in sweep.parameters},
        "trials": len(results) + len(reused),
        "reused_trials": len(reused),
        "failed_trials": sum(1 for r in results if r.error),
        "stopped_early": len(getattr(scheduler, "stopped_early", ())),
        "placement_groups_reserved": reserved,
    }
    metrics = {k: v for k, v in raw.items() if is_number(v) and k not in TUNE_BOOKKEEPING}
    record_best(client, parent_id, sweep.metric, metrics.get(sweep.metric), outcome)
    return {"metrics": metrics, "checkpoint": checkpoint, "storage": storage, "sweep": outcome}


def fit(spec: ExperimentSpec, run_name: str, space: dict[str, Any], scheduler, trial_runs: TrialRuns):
    """Ray Tune's run of the trials in `space`: their results."""
    sweep = spec.sweep
    trainable = tune.with_parameters(run_trial, spec_json=spec.model_dump_json(), run_name=run_name)
    tuner = tune.Tuner(
        tune.with_resources(trainable, {TRIAL_DRIVER_RESOURCE: 1}),
        param_space=space,
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=sweep.num_samples,
            max_concurrent_trials=sweep.max_concurrent_trials,
            scheduler=scheduler,
        ),
        run_config=tune.RunConfig(
            name=run_name,
            storage_path=spec.checkpoint_uri,
            callbacks=[trial_runs],
            stop={"time_total_s": sweep.max_trial_minutes * 60} if sweep.max_trial_minutes else None,
            verbose=0,
        ),
    )
    return tuner.fit()


TUNE_BOOKKEEPING = {
    "training_iteration",
    "time_this_iter_s",
    "time_total_s",
    "timestamp",
    "time_since_restore",
    "iterations_since_restore",
    "pid",
    "done",
}


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
