"""The flow⇄job contract: everything that crosses the process boundary between the flow and the job, defined once.

The flow hands the job a `JobEnv` (environment variables: `to_env()` on the flow's side, `from_env()` on the
cluster's); the job answers on its log, in lines that start with the markers below, which `parse_line` reads back;
both sides write the MLflow tags named here. This module imports nothing heavy (no Ray, torch, Prefect or MLflow):
the flow reads the job's lines without loading the job's world.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# -- what the flow hands the job --------------------------------------------------------------------------------------
ENV_NAMES = {  # JobEnv field -> environment variable
    "tracking_uri": "MLFLOW_TRACKING_URI",
    "mlflow_run_id": "GPUFLOW_MLFLOW_RUN_ID",
    "artifact_uri": "GPUFLOW_ARTIFACT_URI",
    "requested_at": "GPUFLOW_REQUESTED_AT",
    "hourly_usd": "GPUFLOW_HOURLY_USD",
    "local_cluster_session": "GPUFLOW_LOCAL_CLUSTER_SESSION",
    "spec_json": "GPUFLOW_SPEC_JSON",
    "run_name": "GPUFLOW_RUN_NAME",
    "notify_json": "GPUFLOW_NOTIFY",
    "metadata_url": "GPUFLOW_METADATA_URL",
    "continue_from": "GPUFLOW_CONTINUE_FROM",
}
SECRET_ENV_NAMES = {"GPUFLOW_NOTIFY"}  # never in a log or a backend's job record: SkyPilot gets them as secrets


@dataclass(frozen=True)
class JobEnv:
    """What the job needs from the flow: where to log (the flow's MLflow run) and what it needs to enforce the run's
    limits and lease on its own, should the flow die. Unset fields are left out of the environment."""

    tracking_uri: str | None = None
    mlflow_run_id: str | None = None  # every report of the job is logged into this run
    artifact_uri: str | None = None  # that run's artifact store: the job writes there without reading the run first
    requested_at: float | None = None  # when the cluster was requested (epoch seconds): the bill counts from here
    hourly_usd: float | None = None  # what the launched cluster costs
    local_cluster_session: int | None = None  # the local backend's session of the cluster: the guard may stop it
    spec_json: str | None = None  # a SkyPilot node: the spec, and Ray Train's run name, for the job it starts
    run_name: str | None = None
    notify_json: str | None = None  # the run's webhook, links and name (cluster/run/webhook.py): a secret
    metadata_url: str | None = None  # a test's double of the clouds' metadata service (cluster/config.py), for nodes
    continue_from: str | None = None  # an earlier run's last checkpoint, where a continuation starts (rerun/reuse.py)

    def to_env(self) -> dict[str, str]:
        return {ENV_NAMES[f.name]: str(value) for f in fields(self) if (value := getattr(self, f.name)) is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        environ = os.environ if environ is None else environ
        types = {"requested_at": float, "hourly_usd": float, "local_cluster_session": int}
        values = {}
        for name, variable in ENV_NAMES.items():
            raw = environ.get(variable)
            if raw:
                values[name] = types.get(name, str)(raw)
        return cls(**values)


def split_secrets(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """A job's environment as (what may be shown, the secrets among it)."""
    return (
        {name: value for name, value in env.items() if name not in SECRET_ENV_NAMES},
        {name: value for name, value in env.items() if name in SECRET_ENV_NAMES},
    )


# `gpuflow serve --set ...`: the overrides reach the flow runs that serve starts, as JSON in their environment.
SERVE_OVERRIDES_ENV = "GPUFLOW_SERVE_OVERRIDES"

# The local backend's supervisor tells the job that the process that owned the cluster is gone.
OWNER_DIED = signal.SIGUSR1

# -- what the job says on its log ------------------------------------------------------------------------------------
MARK = "[gpuflow]"  # gpuflow's own lines; the rest is Ray's, MLflow's or the loop's
SETUP_DONE = f"{MARK} setup finished"  # rank 0's first line on a cloud node: the job's runtime counts from here
SPEC_LOADED = f"{MARK} job loaded its spec"  # the job's first line: the node accepted what the flow handed it
RESULT_PREFIX = f"{MARK} result "  # the job's last line: its summary as JSON
STOP_PREFIX = f"{MARK} stopped "  # "<prefix><reason>: <detail>": the job stopped the run itself
CHECKPOINT_PERSISTED = f"{MARK} checkpoint persisted"
RESUMING = f"{MARK} resuming at epoch"
NOTICE_PREFIX = f"{MARK} preemption notice: "  # a node's watcher saw its cloud's notice and drained it in Ray
# The job's exit when Ray Train ended training because a node was preempted (drained, its deadline passed): the node
# may not be gone yet, so the flow waits for the loss as it does for a job killed by a signal.
PREEMPTED_EXIT_CODE = 4


def result_line(summary: dict) -> str:
    return RESULT_PREFIX + json.dumps(summary)


def stop_line(reason: str, detail: str) -> str:
    return f"{STOP_PREFIX}{reason}: {detail}"


def notice_line(detail: str) -> str:
    return NOTICE_PREFIX + detail


def nodes_line(alive: int, of: int) -> str:
    """An elastic run's cluster has `alive` of its `of` nodes: the flow bills those (Meter.resized)."""
    return f"{MARK} nodes alive: {alive} of {of}"


def checkpoint_line(step: int) -> str:
    """A report's checkpoint is in storage (Ray Train calls the report's callbacks after that): a resume starts here."""
    return f"{CHECKPOINT_PERSISTED} (step {step})"


def resumed_line(epoch: int, step: int | None = None) -> str:
    """The loop restored a checkpoint (cluster/loop.py restore) and trains again: `step` steps of `epoch` done when
    the checkpoint was taken on a preemption notice, else at the start of `epoch`."""
    if step is not None:
        return f"{RESUMING} {epoch} step {step} from the checkpoint taken on a preemption notice"
    return f"{RESUMING} {epoch} from the checkpoint of epoch {epoch - 1}"


def epoch_line(epoch: int, shown: str) -> str:
    return f"{MARK} epoch {epoch}: {shown}"


def trial_line(trial: str, outcome: str, done: int, total: int) -> str:
    return f"{MARK} trial {trial} {outcome} ({done} of {total} done)"


# The job's own result line: bare (the local backend's log) or behind SkyPilot's "(task, pid=N) ", not a Ray worker's.
RESULT_LINE = re.compile(r"^(?:\([^()]*, pid=\d+\) )?" + re.escape(RESULT_PREFIX) + r"(.*)$")
STOP_LINE = re.compile(re.escape(STOP_PREFIX) + r"(\w+): (.*)$")
EPOCH_LINE = re.compile(re.escape(MARK) + r" epoch (\d+):")
TRIAL_LINE = re.compile(re.escape(MARK) + r" trial \S+ .*\((\d+) of (\d+) done\)")
NODES_LINE = re.compile(re.escape(MARK) + r" nodes alive: (\d+) of (\d+)")
METRIC = re.compile(r"(\S+)=(\S+)")


@dataclass(frozen=True)
class JobEvent:
    """What one line of the job's log means to the flow."""

    kind: str  # "result", "stop", "epoch", "trial", "nodes", "checkpoint", "resumed" or "setup_done"
    value: Any = None  # the result's summary, (reason, detail), the epoch, (done, total), (alive, of)


def parse_line(line: str) -> JobEvent | None:
    """The event a job's log line carries, or None for any other line."""
    if MARK not in line:
        return None
    if result := RESULT_LINE.search(line):
        return JobEvent("result", json.loads(result.group(1)))
    if stopped := STOP_LINE.search(line):
        return JobEvent("stop", (stopped.group(1), stopped.group(2)))
    if epoch := EPOCH_LINE.search(line):
        return JobEvent("epoch", int(epoch.group(1)))
    if trial := TRIAL_LINE.search(line):
        return JobEvent("trial", (int(trial.group(1)), int(trial.group(2))))
    if nodes := NODES_LINE.search(line):
        return JobEvent("nodes", (int(nodes.group(1)), int(nodes.group(2))))
    if CHECKPOINT_PERSISTED in line:
        return JobEvent("checkpoint")
    if RESUMING in line:
        return JobEvent("resumed")
    if SETUP_DONE in line:
        return JobEvent("setup_done")
    return None


def epoch_metrics(line: str) -> dict[str, float]:
    """The metrics of an epoch line, `{"val_accuracy": 0.95, ...}`, in the order the job printed them."""
    found = EPOCH_LINE.search(line)
    metrics = {}
    for key, value in METRIC.findall(line[found.end() :] if found else ""):
        try:
            metrics[key] = float(value)
        except ValueError:
            pass
    return metrics


# -- the MLflow run both sides write -------------------------------------------------------------------------------
FLOW_RUN_TAG = "prefect.flow_run_id"
# A Prefect flow-run tag its flow writes as the run opens (cluster/rerun/source.py source_stamp): the commit and the
# digest of the uncommitted diff it ran. MLflow's copy can be changed by whoever can edit the run: a rerun compares.
SOURCE_STAMP_PREFIX = "source:"
BACKEND_TAG = "gpuflow.backend"  # every run gpuflow opens has it
CLUSTER_TAG = "gpuflow.cluster"
CHECKPOINT_TAG = "gpuflow.checkpoint"  # the last persisted checkpoint
CHECKPOINTS_TAG = "gpuflow.checkpoints"  # where Ray Train keeps this run's checkpoints
FILLED_TAG = "gpuflow.filled_from_checkpoints"  # metrics logged from a closing run's persisted checkpoints
RENEWED_TAG = "gpuflow.lease_renewed_at"  # the flow's lease on the run (cluster/run/lease.py)
GRACE_TAG = "gpuflow.lease_grace_seconds"
STOPPED_BY_TAG = "stopped_by"  # why the run ended early: a key of STATUS_FOR_STOP
TRAINED_TAG = "gpuflow.trained"  # the job's training ended well (its seconds): the run is FINISHED, its flow or not
STOP_DETAIL_TAG = "gpuflow.stop_detail"
PREEMPTION_NOTICE_TAG = "gpuflow.preemption_notice"  # the latest spot notice: its cloud, node, deadline (UTC)
HOURLY_METRIC = "hourly_cost_usd"  # logged when the run opens, so a run still going can be priced
PHASE_METRIC_PREFIX = "gpuflow."  # + a phase's name: the flow's own figures, not the loop's reports
PRICE_SOURCE_TAG = "gpuflow.price_source"  # where the run's price came from (Estimate.source)
INSTANCE_TYPE_TAG = "gpuflow.instance_type"
OPTION_TAG = "gpuflow.option"  # the compute option that launched
LAUNCHED_TAG_PREFIX = "gpuflow.launched."  # + a key of what launched (its cloud, region, ...)
ATTEMPT_TAG_PREFIX = "gpuflow.attempt."  # + the cluster's number in the run (1, 2, ...): its option, price and cost
ATTEMPT_STARTED_TAG = "gpuflow.attempt_started_at"  # when the run's current cluster was requested
CLOSED_BY_TAG = "gpuflow.closed_by"  # who closed a run its flow left RUNNING: "hook" or "reaper"
NOTIFIED_TAG = "gpuflow.notified"  # "<event> <when, UTC>": the end event delivered for this run
NOTIFY_SENDING_TAG = "gpuflow.notify_sending"  # "<epoch> <token> <host> <pid> <started>": who sends the end now
NOTIFY_FAILED_TAG = "gpuflow.notify_failed"  # "<when, UTC> <error>": the last try at the end event that failed
NOTIFY_BLOCK_TAG = "gpuflow.notify_block"  # the spec's notify.block (its name, not its secret URL)
PREFECT_USER_TAG = "gpuflow.prefect_user"  # who (or which schedule, automation) created the Prefect run
# The MLflow user of whoever started the run through a deployment (`gpuflow run --deployment`), as that command
# declared it on the flow run's Prefect tag below: a self-hosted Prefect server has no users to tell it otherwise.
TRIGGERED_BY_TAG = "gpuflow.triggered_by"
TRIGGERED_BY_PREFECT_TAG_PREFIX = "triggered-by:"


def triggered_by(prefect_tags) -> str | None:
    """The MLflow user that `gpuflow run --deployment` put on a flow run's tags (None: started otherwise)."""
    return next(
        (
            tag.removeprefix(TRIGGERED_BY_PREFECT_TAG_PREFIX)
            for tag in prefect_tags or ()
            if tag.startswith(TRIGGERED_BY_PREFECT_TAG_PREFIX)
        ),
        None,
    )


REGISTERED_MODEL_TAG = "gpuflow.registered_model"  # "<name>/<version>" of the model registered from the run
TRIAL_ID_TAG = "gpuflow.trial_id"  # a sweep's trial, on its child run
PLACEMENT_GROUP_TAG = "gpuflow.placement_group"  # the trial's Ray placement group, freed when the trial stops
BEST_RUN_TAG = "gpuflow.best_run_id"  # a sweep's best trial, on the parent run
RESERVED_FOR_TAG = "gpuflow.reserved_for"  # a budget reservation's flow run id, the same as its prefect.flow_run_id tag
RESERVATION_EXPIRES_TAG = "gpuflow.reservation_expires_at"  # when a budget reservation lapses (epoch seconds)
LOOP_DIGEST_TAG = "gpuflow.loop_digest"  # sha256 (short) of the training loop's file: runs of the same loop
HARDWARE_TAG = "gpuflow.hardware"  # backend, nodes × workers, accelerators (local: CPUs): runs on the same hardware
PREDICTED_WALL_METRIC = "predicted_wall_seconds"  # at open, from past runs (cluster/cost/predict.py), beside the
PREDICTED_COST_METRIC = "predicted_cost_usd"  # actual gpuflow.wall_seconds and cost_usd logged at close

# A rerun (`gpuflow rerun`): both runs name each other; the run's source beyond its commit, for a rerun to rebuild it.
RERUN_OF_TAG = "gpuflow.rerun_of"  # on a rerun: the run it reran
RERUN_BY_TAG = "gpuflow.rerun_by"  # on a run rerun: every rerun's run id, comma-separated, oldest first
NOTE_TAG = "mlflow.note.content"  # the run's description in MLflow's UI
SOURCE_WORKDIR_TAG = "gpuflow.source.workdir"  # the spec's workdir inside its git repository ("." at its top)
DIFF_TOO_LARGE_TAG = "gpuflow.source.diff_too_large"  # the uncommitted changes were over the cap: not recorded

# A run's work key (cluster/rerun/work_key.py): what its training produces depends on, digested; a later run of the
# same work is found by it. A run whose inputs cannot be digested has no key, and says why instead.
WORK_KEY_TAG = "gpuflow.work_key"
WORK_KEY_WITHOUT_EPOCHS_TAG = "gpuflow.work_key_without_epochs"  # the same without train.epochs: a run to continue
WORK_KEY_MISSING_TAG = "gpuflow.work_key_missing"  # why the run has no work key
CONTINUED_FROM_TAG = "gpuflow.continued_from"  # the FINISHED run of fewer epochs whose last checkpoint it started from
REUSED_RUN_TAG = "gpuflow.reused_run"  # a sweep's trial that trained nothing: the FINISHED run of its key it points at

QUOTA_LOST = "quota_lost"  # the team's quota lease lapsed or was revoked while the run held it


def true_status(status: str, tags: dict[str, str]) -> str:
    """The status a run ends with where its flow did not close it: FINISHED once its job had trained to the end
    (TRAINED_TAG), though its flow died after; a stop the user asked for (KILLED) stays."""
    return "FINISHED" if status == "FAILED" and TRAINED_TAG in tags else status


def trained_then_orphaned(tags: dict[str, str]) -> str:
    """The stop detail of a run that true_status makes FINISHED: which flow run died before it closed the run."""
    return f"trained to the end; its flow run {tags.get(FLOW_RUN_TAG, '(unknown)')} died before it closed the run"


# How a run stopped early ends in MLflow: a stop the user asked for, or a limit, is KILLED; a lost run FAILED.
STATUS_FOR_STOP = {
    "cancelled": "KILLED",
    "timeout": "KILLED",
    "budget": "KILLED",
    "idle_gpu": "KILLED",
    "interrupted": "KILLED",
    "orphaned": "FAILED",
    "preempted": "FAILED",
    "hung": "FAILED",
    QUOTA_LOST: "FAILED",
}
