"""The experiment spec: one pydantic model, loaded from YAML, validated before any cluster exists.

    gpuflow validate experiments/digits.yaml
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictBool, ValidationError, ValidationInfo, field_validator,
    model_validator,
)

from gpuflow.cluster import checks
from gpuflow.cluster.checks import cut
from gpuflow.cluster.config import default_tracking_uri, shared_path, state_dir
from gpuflow.cluster.entrypoints import entrypoint_check

ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
ACCELERATOR = re.compile(r"^[A-Za-z0-9-]+(:\d+(\.\d+)?)?$")
REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "hdfs://", "r2://")


MAX_PROBLEMS_SHOWN = 8
MAX_PROBLEM_CHARS = 400  # with MAX_PROBLEMS_SHOWN: a refusal always prints under 4 KB


class SpecError(ValueError):
    """A spec that cannot run: each line names the field, the bad value and the fix; never more than a screenful."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = [cut(problem, MAX_PROBLEM_CHARS) for problem in problems[:MAX_PROBLEMS_SHOWN]]
        if len(problems) > MAX_PROBLEMS_SHOWN:
            shown.append(f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more problems; fix these first")
        super().__init__("invalid experiment spec:\n" + "\n".join(f"  - {p}" for p in shown))


def _no_problem(check):
    """A pydantic AfterValidator from a check that returns a problem (str) or None."""
    def validate(value):
        problem = value is not None and check(value)
        if problem:
            raise ValueError(problem)
        return value
    return AfterValidator(validate)


# Numbers are strict (`epochs: true` is not 1, "10" is not 10), finite, and bounded to what a run can mean.
def Count(ge: int, le: int):  # noqa: N802  (a type)
    return Annotated[int, Field(strict=True, ge=ge, le=le)]


def Amount(le: float, gt: float | None = 0, ge: float | None = None):  # noqa: N802
    return Annotated[float, Field(strict=True, allow_inf_nan=False, gt=None if ge is not None else gt, ge=ge, le=le)]


Text = Annotated[str, Field(max_length=4096), _no_problem(checks.control_character_problem)]
Entrypoint = Annotated[str, Field(max_length=200)]
StorageUri = Annotated[Text, _no_problem(checks.storage_uri_problem)]
EnvName = Annotated[str, Field(max_length=128), _no_problem(checks.env_name_problem)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainSpec(Strict):
    loop: Entrypoint = Field(
        description="Ray Train per-worker loop as 'module:function' taking one argument (the config dict), "
        "importable from the workdir, e.g. 'train:train_loop'.",
    )
    epochs: Count(1, 100_000) = Field(10, description="Passes over the training data.")
    batch_size: Count(1, 10_000_000) = Field(64, description="Examples per worker per step.")
    lr: Amount(le=10) = Field(1e-3, description="Learning rate.")
    params: dict[str, Any] = Field(default_factory=dict, description="Other hyper-parameters, passed to the loop as-is.")

    @field_validator("params")
    @classmethod
    def _finite_params(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"params.{checks.shorten(key)} is {item!r}; give a finite number")
        return value

    @field_validator("loop")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        if not ENTRYPOINT.match(value):
            raise ValueError(f"{value!r} is not 'module:function'; write e.g. 'experiments.digits:train_loop'")
        return value


class DataSpec(Strict):
    train: StorageUri = Field(
        description="Training data: Parquet file, folder or URI; reaches the loop as the Ray Data shard "
        "ray.train.get_dataset_shard('train'), streamed and split across workers.",
    )
    validation: StorageUri | None = Field(
        None,
        description="Held-out Parquet data the training never sees: ray.train.get_dataset_shard('validation').",
    )
    generate: Entrypoint | None = Field(
        None,
        description="Optional 'module:function(train_uri, validation_uri)' that writes the data when it is missing.",
    )

    @field_validator("generate")
    @classmethod
    def _entrypoint(cls, value: str | None) -> str | None:
        if value is not None and not ENTRYPOINT.match(value):
            raise ValueError(f"{value!r} is not 'module:function'; write e.g. 'experiments.digits:write_parquet'")
        return value


class ComputeSpec(Strict):
    backend: Literal["local", "skypilot"] = Field("local", description="'local': a Ray cluster on this machine; 'skypilot': a cloud cluster.")
    num_nodes: Count(1, 512) = Field(1, description="Machines in the cluster.")
    workers_per_node: Count(1, 64) = Field(2, description="Ray Train workers on each node.")
    num_workers: Count(1, 512 * 64) | None = Field(None, description="Total workers; if set, must equal num_nodes × workers_per_node, or sets workers_per_node.")
    cpus_per_worker: Amount(le=1024) = Field(1, description="CPUs reserved for each worker.")
    accelerators: Annotated[str, Field(max_length=64)] | Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=32)] | None = Field(None, description="GPUs per node in SkyPilot form, e.g. 'H100:8' or ['H100:1', 'A100:1'].")
    use_gpu: StrictBool | None = Field(None, description="Train on GPUs; defaults to true when accelerators are set.")
    use_spot: StrictBool = Field(False, description="Use spot instances (cheaper, may be preempted).")
    infra: Annotated[str, Field(max_length=200)] | None = Field(None, description="SkyPilot infra, e.g. 'aws', 'aws/us-east-1', 'slurm/mycluster'.")
    cloud: Annotated[str, Field(max_length=64)] | None = Field(None, description="Cloud name, e.g. 'aws', 'gcp' (or use infra).")
    region: Annotated[str, Field(max_length=64)] | None = Field(None, description="Cloud region, e.g. 'us-east-1'.")
    disk_size_gb: Count(10, 65_536) | None = Field(None, description="Boot disk per node in GB.")
    memory_gb_per_node: Amount(le=65_536) | None = Field(None, description="Memory per node in GB; the cloud's default when unset.")
    max_hourly_cost_usd: Amount(le=100_000) | None = Field(None, description="Only consider instances up to this price per hour (per node).")
    max_recoveries: Count(0, 100) = Field(
        3,
        description="Times a lost cluster (spot preemption, a node gone) is relaunched and training resumed from "
        "the last checkpoint, in the same MLflow run; past it the run ends FAILED with stopped_by=preempted.",
    )
    worker_restarts: Count(0, 100) = Field(
        0,
        description="Times Ray Train restarts a crashed worker group from the last checkpoint on a cluster that is "
        "still whole (a bug in the loop fails the same way again: keep 0 unless failures are transient).",
    )

    @field_validator("accelerators")
    @classmethod
    def _accelerators(cls, value):
        for item in [value] if isinstance(value, str) else value or []:
            if not ACCELERATOR.match(item):
                raise ValueError(f"{item!r} is not an accelerator; write e.g. 'H100:8' or 'A10G:1'")
        return value

    @model_validator(mode="after")
    def _topology(self):
        if self.num_workers is not None and self.num_workers != self.num_nodes * self.workers_per_node:
            if self.num_workers % self.num_nodes:
                raise ValueError(
                    f"num_workers={self.num_workers} does not split evenly over num_nodes={self.num_nodes}; "
                    "use a multiple of num_nodes"
                )
            object.__setattr__(self, "workers_per_node", self.num_workers // self.num_nodes)
        object.__setattr__(self, "num_workers", self.num_nodes * self.workers_per_node)
        if self.use_gpu is None:
            object.__setattr__(self, "use_gpu", bool(self.accelerators))
        if self.backend == "local" and (self.accelerators or self.use_gpu or self.use_spot):
            raise ValueError(
                "the local backend trains on this machine's CPU; remove accelerators/use_gpu/use_spot "
                "or set compute.backend: skypilot"
            )
        if self.use_gpu and not self.accelerators:
            raise ValueError("use_gpu is true but no accelerators are requested; set compute.accelerators, e.g. 'H100:1'")
        return self


class TrackingSpec(Strict):
    experiment: Annotated[Text, Field(max_length=256)] | None = Field(None, description="MLflow experiment; defaults to the spec's name.")
    uri: Annotated[Text, _no_problem(checks.tracking_uri_problem)] | None = Field(None, description="MLflow tracking URI; defaults to a local store under .gpuflow/.")
    register_model: StrictBool = Field(True, description="Register the trained model under the spec's name.")


class StorageSpec(Strict):
    checkpoints: StorageUri | None = Field(None, description="Checkpoint folder or URI (s3://, gs://, ...); defaults to .gpuflow/checkpoints.")
    num_to_keep: Count(1, 100_000) | None = Field(None, description="Keep only the newest N checkpoints; all when unset.")


class LimitsSpec(Strict):
    max_runtime_minutes: Amount(le=43_200) = Field(60, description="Stop the job and tear down after this long (at most 30 days).")
    max_cost_usd: Amount(le=10_000_000) | None = Field(None, description="Refuse or stop the run above this cost.")
    idle_minutes_to_autostop: Count(1, 10_080) = Field(10, description="A cloud cluster deletes itself after this many idle minutes.")
    hourly_rate_usd: Amount(le=100_000, ge=0) | None = Field(None, description="Price of the cluster per hour when no catalog knows it (e.g. local).")
    min_gpu_utilization: Amount(le=100) | None = Field(None, description="Stop when GPU use stays below this percent.")
    idle_gpu_minutes: Amount(le=10_080) = Field(10, description="How long GPU use may stay under min_gpu_utilization.")
    orphan_grace_minutes: Amount(le=60) = Field(
        2,
        description="The job stops itself (checkpoints kept, MLflow run FAILED, stopped_by=orphaned) when the flow "
        "has not renewed its lease for this long: the flow process was killed, frozen or cut off.",
    )


class ProfileSpec(Strict):
    steps: Count(1, 1000) = Field(20, description="Training steps rank 0 records with torch.profiler (CPU and CUDA).")
    after: Count(0, 1_000_000) = Field(5, description="Steps to skip first, so that the trace shows warm steps, not start-up.")


SWEEPABLE = ("train.lr", "train.epochs", "train.batch_size")  # and train.params.<a key train.params holds>
SweepValues = Annotated[list[Any], Field(min_length=1, max_length=1000)]


class SweepParameter(Strict):
    """How one spec field varies across trials: exactly one of grid, choice, uniform, loguniform."""

    grid: SweepValues | None = Field(None, description="Every value, each in its own trial (× the other grids).")
    choice: SweepValues | None = Field(None, description="One value drawn at random per sample.")
    uniform: Annotated[list[float], Field(min_length=2, max_length=2)] | None = Field(
        None, description="[low, high]: a number drawn uniformly per sample.")
    loguniform: Annotated[list[float], Field(min_length=2, max_length=2)] | None = Field(
        None, description="[low, high]: a positive number drawn uniformly on a log scale per sample.")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [kind for kind in ("grid", "choice", "uniform", "loguniform") if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of grid, choice, uniform, loguniform (got {given or 'none'}), "
                             "e.g. {grid: [0.001, 0.01]}")
        for kind in ("uniform", "loguniform"):
            low_high = getattr(self, kind)
            if low_high and not (low_high[0] < low_high[1] and (kind == "uniform" or low_high[0] > 0)):
                raise ValueError(f"{kind} {low_high} must be [low, high] with low < high"
                                 + (" and low > 0" if kind == "loguniform" else ""))
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in ("grid", "choice", "uniform", "loguniform") if getattr(self, kind) is not None)

    def edge_values(self) -> list:
        """Every value a trial can get, or a range's two ends: what the spec's own field checks must accept."""
        return list(getattr(self, self.kind))


class EarlyStoppingSpec(Strict):
    grace_epochs: Count(1, 100_000) = Field(
        1, description="Epochs every trial runs before ASHA may stop it for trailing the others.")
    reduction_factor: Amount(le=100, gt=1) = Field(
        3, description="ASHA keeps about 1 in this many trials at each rung (grace_epochs × factor^k epochs).")


class SweepSpec(Strict):
    """A hyper-parameter sweep: many trials (each a Ray Train run) on the one cluster, by Ray Tune."""

    parameters: Annotated[dict[str, SweepParameter], Field(min_length=1, max_length=50)] = Field(
        description="Spec field → how it varies, e.g. {'train.lr': {grid: [0.001, 0.01]}}; fields: "
        + ", ".join(SWEEPABLE) + ", train.params.<key>.")
    num_samples: Count(1, 10_000) = Field(1, description="Times the whole grid is repeated (choices drawn anew each time).")
    metric: Annotated[str, Field(min_length=1, max_length=250)] = Field(
        description="The reported metric that ranks trials, e.g. val_accuracy.")
    mode: Literal["max", "min"] = Field("max", description="Whether a higher (max) or lower (min) metric is better.")
    max_concurrent_trials: Count(1, 1000) = Field(1, description="Trials running at once on the cluster.")
    workers_per_trial: Count(1, 512 * 64) | None = Field(
        None, description="Ray Train workers of each trial; defaults to compute.num_workers ÷ max_concurrent_trials.")
    max_trial_minutes: Amount(le=43_200) | None = Field(
        None, description="A trial still reporting after this long is stopped; also what `gpuflow plan` bounds "
        "the sweep's cost with. Unset: only limits.max_runtime_minutes bounds the sweep.")
    early_stopping: EarlyStoppingSpec | None = Field(
        None, description="Stop trials that trail the others early (ASHA); unset: every trial runs all its epochs.")

    @property
    def num_trials(self) -> int:
        return math.prod(len(p.grid) for p in self.parameters.values() if p.grid is not None) * self.num_samples


class ExperimentSpec(Strict):
    """One experiment: what to train, on what data, on which compute, tracked where, within which limits."""

    name: str = Field("digits-mlp", description="Lowercase name: MLflow experiment, registered model and run names.")
    train: TrainSpec = Field(description="What to train: the loop and its hyper-parameters.")
    data: DataSpec | None = Field(None, description="Parquet data streamed to the loop; none for a loop that reads its own.")
    compute: ComputeSpec = Field(default_factory=ComputeSpec)
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="fp32, or bf16/fp16 mixed precision (autocast).")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    profile: ProfileSpec | None = Field(
        None,
        description="Record a torch.profiler trace of some training steps on rank 0, logged to MLflow as "
        "profile/trace.json (opens in Perfetto) and profile/top_operators.txt; for loops that use "
        "gpuflow.cluster.loop.telemetry. Unset: no profiling.",
    )
    workdir: Text = Field(".", description="Project folder with the training code; synced to cloud clusters.")
    setup: Annotated[str, Field(max_length=20_000)] | None = Field(
        None,
        description="Shell setup on each cloud node, run in the synced workdir before the job. Unset: "
        "'python -m pip install -e .' (the workdir is a project that depends on gpuflow). When set it REPLACES "
        "that default, so it must install gpuflow and the loop's packages itself (or do nothing, on an image "
        "that has them), e.g. 'uv pip install -r requirements.txt -e .'.",
    )
    sweep: SweepSpec | None = Field(
        None, description="Run a hyper-parameter sweep (many trials, one cluster, one parent MLflow run) instead of "
        "one training run. Unset: one run.")
    envs: Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=200)] = Field(
        default_factory=dict, description="Environment variables for the job (logged with the spec: no credentials; use secrets).")
    secrets: Annotated[list[EnvName], Field(max_length=100)] = Field(
        default_factory=list, description="Names of environment variables passed to the job but never printed or logged.")

    @field_validator("envs")
    @classmethod
    def _no_credentials_in_envs(cls, value: dict[str, str]) -> dict[str, str]:
        problems = checks.envs_problems(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME.match(value):
            raise ValueError(f"{value!r}: use 1-40 lowercase letters, digits and '-', starting with a letter, e.g. 'digits-mlp'")
        return value

    @model_validator(mode="after")
    def _remote_needs_remote_stores(self, info: ValidationInfo):
        # On the cluster (cluster/job.py) the flow has checked this already, and "remote" is here.
        on_cluster = bool(info.context and info.context.get("on_cluster"))
        if self.compute.backend == "skypilot" and not on_cluster:
            if not is_remote_uri(self.tracking.uri or ""):
                raise ValueError(
                    "tracking.uri must be a server a cloud cluster can reach (http(s)://..., or databricks); "
                    f"got {self.tracking.uri!r}. Start `mlflow server` somewhere reachable and set tracking.uri"
                )
            if self.data and not self.data.generate and not is_remote_uri(self.data.train):
                raise ValueError(
                    f"data.train {self.data.train!r} is on this machine, which a cloud cluster cannot read; "
                    "upload it to a bucket (s3://, gs://) or set data.generate to make it on the cluster"
                )
            if not is_remote_uri(self.storage.checkpoints or ""):
                raise ValueError(
                    "storage.checkpoints must be a bucket a cloud cluster can write (s3://, gs://, ...); "
                    f"got {self.storage.checkpoints!r}. Set storage.checkpoints, e.g. s3://my-bucket/gpuflow"
                )
        return self

    @model_validator(mode="after")
    def _sweep_fits_the_spec(self):
        problems = sweep_problems(self) if self.sweep is not None else []
        if problems:  # one error per problem, each at its own field
            raise ValidationError.from_exception_data("ExperimentSpec", [
                {"type": "value_error", "loc": tuple(field.split(".", 2)), "input": None, "ctx": {"error": problem}}
                for field, problem in problems])
        return self

    @property
    def workers_per_trial(self) -> int:
        """Ray Train workers of one trial: the spec's, or its share of the cluster; the whole cluster with no sweep."""
        if self.sweep is None:
            return self.compute.num_workers
        return self.sweep.workers_per_trial or max(1, self.compute.num_workers // self.sweep.max_concurrent_trials)

    # Resolved locations: relative paths are relative to the working directory, state under .gpuflow/.
    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or default_tracking_uri()

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name

    @property
    def checkpoint_uri(self) -> str:
        return absolute_uri(self.storage.checkpoints or str(state_dir() / "checkpoints"))

    def anchored(self) -> "ExperimentSpec":
        """This spec with every location absolute: the workdir against the current folder, relative data paths
        against the workdir (on a cloud node, the synced workdir). Each process of a run then reads the same
        files, wherever it runs: Ray Tune runs each trial in a folder of its own."""
        workdir = Path(self.workdir).expanduser().absolute()

        def located(uri: str | None) -> str | None:
            return uri if uri is None or "://" in uri else str(workdir / Path(uri).expanduser())

        data = self.data and self.data.model_copy(update={
            "train": located(self.data.train), "validation": located(self.data.validation)})
        return self.model_copy(update={
            "workdir": str(workdir), "data": data,
            "tracking": self.tracking.model_copy(update={"uri": self.tracking_uri}),
            "storage": self.storage.model_copy(update={"checkpoints": self.checkpoint_uri})})


def sweep_problems(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """(field, problem) for what a sweep asks that the rest of the spec cannot give: unknown fields, values the
    field refuses, a concurrency the cluster cannot hold, early stopping that could never stop anything."""
    sweep, problems = spec.sweep, []
    for path, parameter in sweep.parameters.items():
        field = f"sweep.parameters.{cut(path, 60)}"
        key = path.removeprefix("train.params.")
        if path.startswith("train.params.") and key not in spec.train.params:
            problems.append((field, f"train.params has no {checks.shorten(key, 60)} (it has "
                                    f"{', '.join(sorted(spec.train.params)) or 'none'}); give it a default there or "
                                    "fix the name"))
        elif not path.startswith("train.params.") and path not in SWEEPABLE:
            problems.append((field, f"not a field a sweep can vary; use one of {', '.join(SWEEPABLE)} or "
                                    "train.params.<key>"))
        else:
            for value in parameter.edge_values():
                try:
                    trial_train(spec.train, {path: value})
                except ValidationError as exc:
                    problems.append((field, f"{parameter.kind} value {checks.shorten(value, 60)} is not a valid "
                                            f"{path}: {cut(exc.errors()[0]['msg'], 120)}; fix or remove it"))
                    break
    workers = spec.workers_per_trial * sweep.max_concurrent_trials
    if workers > spec.compute.num_workers:
        problems.append(("sweep.max_concurrent_trials", (
            f"{sweep.max_concurrent_trials} trials × {spec.workers_per_trial} worker(s) need {workers} workers, "
            f"the cluster has compute.num_workers={spec.compute.num_workers}; lower max_concurrent_trials or "
            "workers_per_trial, or add workers")))
    if sweep.max_trial_minutes and sweep_minutes(spec) > spec.limits.max_runtime_minutes:
        problems.append(("sweep.max_trial_minutes", (
            f"{sweep.num_trials} trials, {sweep.max_concurrent_trials} at a time, of up to {sweep.max_trial_minutes:g} "
            f"min each may take {sweep_minutes(spec):g} min, but limits.max_runtime_minutes="
            f"{spec.limits.max_runtime_minutes:g} stops the sweep before; raise max_runtime_minutes to "
            f"{sweep_minutes(spec):g} or lower max_trial_minutes")))
    if not problems and sweep.early_stopping and sweep.early_stopping.grace_epochs >= max_epochs(spec):
        problems.append(("sweep.early_stopping.grace_epochs", (
            f"{sweep.early_stopping.grace_epochs} is not below the trials' {max_epochs(spec)} epochs, so no trial "
            "could stop early; lower it or remove early_stopping")))
    return problems


def trial_train(train: TrainSpec, values: dict[str, Any]) -> TrainSpec:
    """The train section of one trial: the spec's, with the trial's values at their dotted paths (train.*)."""
    fields = train.model_dump()
    for path, value in values.items():
        *parents, leaf = path.removeprefix("train.").split(".")
        node = fields
        for part in parents:
            node = node[part]
        node[leaf] = value
    return TrainSpec.model_validate(fields)


def sweep_rounds(spec: ExperimentSpec) -> int:
    """How many rounds of max_concurrent_trials trials the sweep runs."""
    return math.ceil(spec.sweep.num_trials / spec.sweep.max_concurrent_trials)


def sweep_minutes(spec: ExperimentSpec) -> float:
    """The longest a sweep's trials can take: its rounds, each up to max_trial_minutes (without max_trial_minutes:
    limits.max_runtime_minutes). The bill is also capped by limits.max_runtime_minutes: `billed_sweep_minutes`."""
    if not spec.sweep.max_trial_minutes:
        return spec.limits.max_runtime_minutes
    return sweep_rounds(spec) * spec.sweep.max_trial_minutes


def billed_sweep_minutes(spec: ExperimentSpec) -> float:
    """The most minutes a sweep can bill: its trials' time, never past limits.max_runtime_minutes (which ends the job)."""
    return min(sweep_minutes(spec), spec.limits.max_runtime_minutes)


def max_epochs(spec: ExperimentSpec) -> int:
    """The most epochs any trial trains (train.epochs may be swept)."""
    varied = spec.sweep.parameters.get("train.epochs") if spec.sweep else None
    return max(varied.edge_values()) if varied else spec.train.epochs


# A team's MLflow server asks for these (its basic-auth app); the cluster logs to the same server.
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def job_secrets(spec: ExperimentSpec) -> list[str]:
    """The names passed to the job as secrets: spec.secrets, plus the MLflow server's credentials set here."""
    if not spec.tracking_uri.startswith(("http://", "https://")):
        return list(spec.secrets)
    return [*spec.secrets, *(name for name in TRACKING_CREDENTIALS if name in os.environ and name not in spec.secrets)]


def is_remote_uri(uri: str) -> bool:
    """True for a location a cluster's nodes can reach: a server, a bucket, or a path under GPUFLOW_SHARED_PATH."""
    shared = shared_path()
    return (
        uri.startswith(("http://", "https://", "databricks") + REMOTE_SCHEMES)
        or (bool(shared) and uri.removeprefix("file://").removeprefix("sqlite:///").startswith(shared))
    )


def absolute_uri(uri: str) -> str:
    return uri if "://" in uri else str(Path(uri).expanduser().absolute())


def load_spec(path: str | Path, overrides: list[str] = ()) -> ExperimentSpec:
    """Reads a YAML spec and applies `key.sub=value` overrides (values parsed as YAML)."""
    path = Path(path)
    try:
        if path.stat().st_size > checks.MAX_SPEC_FILE_BYTES:
            raise SpecError([f"spec file: {str(path)!r} is {path.stat().st_size} bytes, more than a spec can be "
                             f"({checks.MAX_SPEC_FILE_BYTES}); give the experiment's YAML spec"])
        raw = yaml.safe_load(path.read_text()) or {}
    except (FileNotFoundError, NotADirectoryError):
        raise SpecError([f"spec file: {str(path)!r} does not exist; pass the path of a YAML spec"]) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecError([f"spec file: {str(path)!r} is not valid YAML: {cut(str(exc), 300)}"]) from None
    except RecursionError:
        raise SpecError([f"spec file: {str(path)!r} is nested too deeply to be a spec; flatten it"]) from None
    if not isinstance(raw, dict):
        raise SpecError([f"spec file: {str(path)!r} must hold a mapping of fields, got {type(raw).__name__}"])
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError([f"--set {item!r}: write it as field.path=value, e.g. train.lr=0.01"])
        try:
            apply_override(raw, key.strip(), yaml.safe_load(value))
        except yaml.YAMLError as exc:
            raise SpecError([f"--set {checks.shorten(item)}: the value is not valid YAML: {cut(str(exc), 200)}"]) from None
    return parse_spec(raw)


def apply_override(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError([f"--set {dotted}: {part!r} is not a section"])
    node[leaf] = value


def parse_spec(raw: dict | ExperimentSpec) -> ExperimentSpec:
    if isinstance(raw, ExperimentSpec):
        return raw
    too_big = checks.size_problem(raw)
    if too_big:
        raise SpecError([too_big])
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError([describe(error) for error in exc.errors()]) from None


REQUIRED_EXAMPLES = {
    "train": "train: {loop: 'train:train_loop'} (`gpuflow init` writes a starter spec and loop)",
    "train.loop": "loop: 'train:train_loop' (a function in train.py of the workdir, taking the config)",
    "data.train": "train: data/train.parquet (or remove data: if the loop reads its own)",
}


def describe(error: dict) -> str:
    """One pydantic error as 'field: problem (got value)' with the fix where pydantic does not give one."""
    # Pydantic adds the union member (e.g. 'constrained-str') to the location: the user knows no such field.
    parts = [str(part) for part in error["loc"] if not re.match(r"^(constrained-|function-|lax-|strict-)|^(str|int|float|list\[.*\]|dict\[.*\])$", str(part))]
    field = cut(".".join(parts), 120) or "spec"
    message = cut(error["msg"].removeprefix("Value error, "), 600)
    got = checks.shorten(error.get("input"))
    if error["type"] == "missing":
        example = REQUIRED_EXAMPLES.get(field, "")
        return f"{field}: required, and missing; add it to the spec{', e.g. ' + example if example else ''}"
    if error["type"] == "extra_forbidden":
        return f"{field}: unknown field (got {got}); remove it or check its spelling"
    if error["type"] == "literal_error":
        return f"{field}: {got} is not allowed; {message.lower()}"
    if error["type"] in ("value_error", "assertion_error"):
        return f"{field}: {message}"
    if error["type"] in ("bool_type", "int_type", "float_type") and isinstance(error.get("input"), bool):
        return f"{field}: {message}, not a boolean (got {got}); write a number"
    if error["type"] == "finite_number":
        return f"{field}: {message} (got {got}); give a finite number"
    if error["type"] == "too_short":
        return f"{field}: {message} (got {got}); give at least {error.get('ctx', {}).get('min_length', 1)}"
    if error["type"] in ("less_than_equal", "less_than"):
        return f"{field}: {message} (got {got}); that is beyond what a run can mean, lower it"
    return f"{field}: {message} (got {got})"


def check_spec(spec: ExperimentSpec) -> list[str]:
    """What the model alone cannot check: the loop imports and takes the right arguments, the data is readable,
    the checkpoint storage is writable, the tracking server answers."""
    importing = check_entrypoints(spec)  # seconds of imports, in a process of its own: the other checks meanwhile
    generate = spec.data.generate if spec.data else None
    problems = []
    if not Path(spec.workdir).is_dir():
        problems.append(f"workdir: {spec.workdir!r} is not a folder")
    located = spec.anchored().data
    for field in ("train", "validation"):
        uri = getattr(spec.data, field) if spec.data else None
        if uri and not generate and not readable(getattr(located, field)):
            problems.append(
                f"data.{field}: {uri!r} cannot be read as Parquet; give an existing Parquet file or folder, "
                "or set data.generate to a function that writes it"
            )
    for field, secret in enumerate(spec.secrets):
        if secret not in os.environ:
            problems.append(f"secrets[{field}]: {secret!r} is not set in this environment; export it before running")
    unwritable = checks.storage_write_problem(spec.checkpoint_uri)
    if unwritable:
        problems.append(f"storage.checkpoints: {unwritable}; give a folder or bucket this machine can write")
    down = checks.tracking_server_problem(spec.tracking_uri)
    if down:
        problems.append(f"tracking.uri: {down}")
    return importing.problems() + problems


def check_entrypoints(spec: ExperimentSpec):
    """Starts (or finds) the check that the spec's loop and data generator import and take the right arguments."""
    entrypoints = {"train.loop": spec.train.loop, "data.generate": spec.data.generate if spec.data else None}
    return entrypoint_check(spec.workdir, {field: value for field, value in entrypoints.items() if value})


def validate_spec(spec: ExperimentSpec) -> ExperimentSpec:
    problems = check_spec(spec)
    if problems:
        raise SpecError(problems)
    return spec


def readable(uri: str) -> bool:
    import pyarrow.dataset as ds

    try:
        ds.dataset(absolute_uri(uri), format="parquet").schema
        return True
    except Exception:
        return False
