"""The experiment spec: one pydantic model, loaded from YAML, validated before any cluster exists.

    gpuflow validate experiments/digits.yaml
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
ACCELERATOR = re.compile(r"^[A-Za-z0-9-]+(:\d+(\.\d+)?)?$")
REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "hdfs://", "r2://")


def state_dir() -> Path:
    """Where gpuflow keeps its runtime state (MLflow store, checkpoints, data, clusters): never in git."""
    return Path(os.environ.get("GPUFLOW_HOME", ".gpuflow")).absolute()


def default_tracking_uri() -> str:
    """The local MLflow store every spec tracks to unless tracking.uri says otherwise."""
    return f"sqlite:///{state_dir() / 'mlflow.db'}"


class SpecError(ValueError):
    """A spec that cannot run: each line names the field, the bad value and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid experiment spec:\n" + "\n".join(f"  - {p}" for p in problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainSpec(Strict):
    loop: str = Field(
        description="Ray Train per-worker loop as 'module:function' taking one argument (the config dict), "
        "importable from the workdir, e.g. 'train:train_loop'.",
    )
    epochs: int = Field(10, ge=1, description="Passes over the training data.")
    batch_size: int = Field(64, ge=1, description="Examples per worker per step.")
    lr: float = Field(1e-3, gt=0, description="Learning rate.")
    params: dict[str, Any] = Field(default_factory=dict, description="Other hyper-parameters, passed to the loop as-is.")

    @field_validator("loop")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        if not ENTRYPOINT.match(value):
            raise ValueError(f"{value!r} is not 'module:function'; write e.g. 'experiments.digits:train_loop'")
        return value


class DataSpec(Strict):
    train: str = Field(
        description="Training data: Parquet file, folder or URI; reaches the loop as the Ray Data shard "
        "ray.train.get_dataset_shard('train'), streamed and split across workers.",
    )
    validation: str | None = Field(
        None,
        description="Held-out Parquet data the training never sees: ray.train.get_dataset_shard('validation').",
    )
    generate: str | None = Field(
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
    num_nodes: int = Field(1, ge=1, le=512, description="Machines in the cluster.")
    workers_per_node: int = Field(2, ge=1, le=64, description="Ray Train workers on each node.")
    num_workers: int | None = Field(None, ge=1, description="Total workers; if set, must equal num_nodes × workers_per_node, or sets workers_per_node.")
    cpus_per_worker: float = Field(1, gt=0, description="CPUs reserved for each worker.")
    accelerators: str | list[str] | None = Field(None, description="GPUs per node in SkyPilot form, e.g. 'H100:8' or ['H100:1', 'A100:1'].")
    use_gpu: bool | None = Field(None, description="Train on GPUs; defaults to true when accelerators are set.")
    use_spot: bool = Field(False, description="Use spot instances (cheaper, may be preempted).")
    infra: str | None = Field(None, description="SkyPilot infra, e.g. 'aws', 'aws/us-east-1', 'slurm/mycluster'.")
    cloud: str | None = Field(None, description="Cloud name, e.g. 'aws', 'gcp' (or use infra).")
    region: str | None = Field(None, description="Cloud region, e.g. 'us-east-1'.")
    disk_size_gb: int | None = Field(None, ge=10, description="Boot disk per node in GB.")
    memory_gb_per_node: float | None = Field(None, gt=0, description="Memory per node in GB; the cloud's default when unset.")
    max_hourly_cost_usd: float | None = Field(None, gt=0, description="Only consider instances up to this price per hour (per node).")
    max_recoveries: int = Field(
        3, ge=0, le=100,
        description="Times a lost cluster (spot preemption, a node gone) is relaunched and training resumed from "
        "the last checkpoint, in the same MLflow run; past it the run ends FAILED with stopped_by=preempted.",
    )
    worker_restarts: int = Field(
        0, ge=0, le=100,
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
    experiment: str | None = Field(None, description="MLflow experiment; defaults to the spec's name.")
    uri: str | None = Field(None, description="MLflow tracking URI; defaults to a local store under .gpuflow/.")
    register_model: bool = Field(True, description="Register the trained model under the spec's name.")


class StorageSpec(Strict):
    checkpoints: str | None = Field(None, description="Checkpoint folder or URI (s3://, gs://, ...); defaults to .gpuflow/checkpoints.")
    num_to_keep: int | None = Field(None, ge=1, description="Keep only the newest N checkpoints; all when unset.")


class LimitsSpec(Strict):
    max_runtime_minutes: float = Field(60, gt=0, description="Stop the job and tear down after this long.")
    max_cost_usd: float | None = Field(None, gt=0, description="Refuse or stop the run above this cost.")
    idle_minutes_to_autostop: int = Field(10, ge=1, description="A cloud cluster deletes itself after this many idle minutes.")
    hourly_rate_usd: float | None = Field(None, ge=0, description="Price of the cluster per hour when no catalog knows it (e.g. local).")
    min_gpu_utilization: float | None = Field(None, gt=0, le=100, description="Stop when GPU use stays below this percent.")
    idle_gpu_minutes: float = Field(10, gt=0, description="How long GPU use may stay under min_gpu_utilization.")
    orphan_grace_minutes: float = Field(
        2, gt=0, le=60,
        description="The job stops itself (checkpoints kept, MLflow run FAILED, stopped_by=orphaned) when the flow "
        "has not renewed its lease for this long: the flow process was killed, frozen or cut off.",
    )


class ProfileSpec(Strict):
    steps: int = Field(20, ge=1, le=1000, description="Training steps rank 0 records with torch.profiler (CPU and CUDA).")
    after: int = Field(5, ge=0, description="Steps to skip first, so that the trace shows warm steps, not start-up.")


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
        "cluster.loop.telemetry. Unset: no profiling.",
    )
    workdir: str = Field(".", description="Project folder with the training code; synced to cloud clusters.")
    setup: str | None = Field(
        None,
        description="Shell setup on each cloud node, run in the synced workdir before the job. Unset: "
        "'python -m pip install -e .' (the workdir is a project that depends on gpuflow). When set it REPLACES "
        "that default, so it must install gpuflow and the loop's packages itself (or do nothing, on an image "
        "that has them), e.g. 'uv pip install -r requirements.txt -e .'.",
    )
    envs: dict[str, str] = Field(default_factory=dict, description="Environment variables for the job.")
    secrets: list[str] = Field(default_factory=list, description="Names of environment variables passed to the job but never printed or logged.")

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


def is_remote_uri(uri: str) -> bool:
    """True for a location another machine can reach, and for a GPUFLOW_REACHABLE_PREFIX (tests' shared disk)."""
    reachable = os.environ.get("GPUFLOW_REACHABLE_PREFIX")
    return (
        uri.startswith(("http://", "https://", "databricks") + REMOTE_SCHEMES)
        or (bool(reachable) and uri.removeprefix("file://").removeprefix("sqlite:///").startswith(reachable))
    )


def absolute_uri(uri: str) -> str:
    return uri if "://" in uri else str(Path(uri).expanduser().absolute())


def load_spec(path: str | Path, overrides: list[str] = ()) -> ExperimentSpec:
    """Reads a YAML spec and applies `key.sub=value` overrides (values parsed as YAML)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise SpecError([f"spec file: {str(path)!r} does not exist; pass the path of a YAML spec"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"spec file: {str(path)!r} is not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise SpecError([f"spec file: {str(path)!r} must hold a mapping of fields, got {type(raw).__name__}"])
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError([f"--set {item!r}: write it as field.path=value, e.g. train.lr=0.01"])
        apply_override(raw, key.strip(), yaml.safe_load(value))
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
    field = ".".join(str(part) for part in error["loc"]) or "spec"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        example = REQUIRED_EXAMPLES.get(field, "")
        return f"{field}: required, and missing; add it to the spec{', e.g. ' + example if example else ''}"
    if error["type"] == "extra_forbidden":
        return f"{field}: unknown field (got {error['input']!r}); remove it or check its spelling"
    if error["type"] == "literal_error":
        return f"{field}: {error['input']!r} is not allowed; {message.lower()}"
    if error["type"] in ("value_error", "assertion_error"):
        return f"{field}: {message}"
    return f"{field}: {message} (got {error['input']!r})"


def check_spec(spec: ExperimentSpec) -> list[str]:
    """What the model alone cannot check: the loop imports, the data is readable, stores are usable."""
    problems = []
    generate = spec.data.generate if spec.data else None
    with on_sys_path(spec.workdir):
        for field, entrypoint in (("train.loop", spec.train.loop), ("data.generate", generate)):
            if entrypoint:
                try:
                    function = resolve(entrypoint)
                except Exception as exc:  # any import-time error is the user's to see
                    problems.append(f"{field}: cannot load {entrypoint!r} from workdir {spec.workdir!r}: {exc}")
                    continue
                if field == "train.loop":
                    problems += loop_signature_problems(entrypoint, function)
    if not Path(spec.workdir).is_dir():
        problems.append(f"workdir: {spec.workdir!r} is not a folder")
    for field in ("train", "validation"):
        uri = getattr(spec.data, field) if spec.data else None
        if uri and not generate and not readable(uri):
            problems.append(
                f"data.{field}: {uri!r} cannot be read as Parquet; give an existing Parquet file or folder, "
                "or set data.generate to a function that writes it"
            )
    for field, secret in enumerate(spec.secrets):
        if secret not in os.environ:
            problems.append(f"secrets[{field}]: {secret!r} is not set in this environment; export it before running")
    return problems


def loop_signature_problems(entrypoint: str, function) -> list[str]:
    """Ray Train calls the loop with one argument, the config dict: anything else fails only on the cluster."""
    import inspect

    fix = f"write it as `def {entrypoint.split(':')[1]}(config: dict) -> None`"
    if not inspect.isfunction(function):
        return [f"train.loop: {entrypoint!r} is a {type(function).__name__}, not a Python function; {fix}"]
    parameters = list(inspect.signature(function).parameters.values())
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in parameters)
    if len(required) > 1 or (not positional and not takes_varargs) or any(p.kind == p.KEYWORD_ONLY for p in required):
        names = ", ".join(p.name for p in parameters) or "no arguments"
        return [f"train.loop: {entrypoint!r} takes ({names}), but Ray Train passes one argument, the config; {fix}"]
    return []


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


def resolve(entrypoint: str):
    module_name, function_name = entrypoint.split(":")
    module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise AttributeError(f"module {module_name!r} has no function {function_name!r}")
    return function


class on_sys_path:
    """Puts the workdir first on sys.path while user code is imported."""

    def __init__(self, folder: str):
        self.folder = str(Path(folder).absolute())

    def __enter__(self):
        sys.path.insert(0, self.folder)

    def __exit__(self, *exc):
        sys.path.remove(self.folder)
