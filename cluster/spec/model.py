"""The experiment spec's pydantic models and their field checks: what a run is. No I/O here (spec/probes.py does
the checks that need the machine), so the Prefect UI's form and the job on the cluster load it the same way. The
compute section is compute.py's; limits.py, notifying.py and sweep.py hold the other sections of their own."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, ValidationError, ValidationInfo, field_validator, model_validator

from gpuflow.cluster.config import default_tracking_uri, state_dir
from gpuflow.cluster.spec import fields as checks
from gpuflow.cluster.spec.compute import ComputeSpec
from gpuflow.cluster.spec.fields import (
    Amount,
    Count,
    Entrypoint,
    EnvName,
    StorageUri,
    Strict,
    Text,
    absolute_uri,
    is_remote_uri,
    no_problem,
)
from gpuflow.cluster.spec.limits import LimitsSpec, ProfileSpec, deadline_problems
from gpuflow.cluster.spec.notifying import NotifySpec
from gpuflow.cluster.spec.sweep import SweepSpec, sweep_problems

ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")


class TrainSpec(Strict):
    loop: Entrypoint = Field(
        description="Ray Train per-worker loop as 'module:function' taking one argument (the config dict), "
        "importable from the workdir, e.g. 'train:train_loop'.",
    )
    epochs: Count(1, 100_000) = Field(10, description="Passes over the training data.")
    batch_size: Count(1, 10_000_000) = Field(64, description="Examples per worker per step.")
    lr: Amount(le=10) = Field(1e-3, description="Learning rate.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Other hyper-parameters, passed to the loop as-is."
    )

    @field_validator("params")
    @classmethod
    def _params(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"params.{checks.shorten(key)} is {item!r}; give a finite number")
        found = checks.credential_params(value)
        if found:  # one error per key, each at its own field
            raise ValidationError.from_exception_data(
                "TrainSpec",
                [
                    {"type": "value_error", "loc": path, "input": None, "ctx": {"error": problem}}
                    for path, problem in found
                ],
            )
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


class TrackingSpec(Strict):
    experiment: Annotated[Text, Field(max_length=256)] | None = Field(
        None, description="MLflow experiment; defaults to the spec's name."
    )
    uri: Annotated[Text, no_problem(checks.tracking_uri_problem)] | None = Field(
        None, description="MLflow tracking URI; defaults to a local store under .gpuflow/."
    )
    register_model: StrictBool = Field(True, description="Register the trained model under the spec's name.")


class StorageSpec(Strict):
    checkpoints: StorageUri | None = Field(
        None, description="Checkpoint folder or URI (s3://, gs://, ...); defaults to .gpuflow/checkpoints."
    )
    num_to_keep: Count(1, 100_000) | None = Field(
        None, description="Keep only the newest N checkpoints; all when unset."
    )


class ExperimentSpec(Strict):
    """One experiment: what to train, on what data, on which compute, tracked where, within which limits."""

    name: str = Field("digits-mlp", description="Lowercase name: MLflow experiment, registered model and run names.")
    train: TrainSpec = Field(description="What to train: the loop and its hyper-parameters.")
    data: DataSpec | None = Field(
        None, description="Parquet data streamed to the loop; none for a loop that reads its own."
    )
    compute: ComputeSpec = Field(default_factory=ComputeSpec)
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32, or bf16/fp16 mixed precision (autocast)."
    )
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
        None,
        description="Run a hyper-parameter sweep (many trials, one cluster, one parent MLflow run) instead of "
        "one training run. Unset: one run.",
    )
    envs: Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=200)] = Field(
        default_factory=dict,
        description="Environment variables for the job (logged with the spec: no credentials; use secrets).",
    )
    notify: NotifySpec | None = Field(
        None,
        description="Message a webhook when a run fails, crashes, is stopped or "
        "recovers (and, if asked, completes). Unset: no messages.",
    )
    secrets: Annotated[list[EnvName], Field(max_length=100)] = Field(
        default_factory=list,
        description="Names of environment variables passed to the job but never printed or logged.",
    )
    reuse: Literal["finished", "never"] = Field(
        "finished",
        description="finished: a run whose work key (its code, data, training fields and packages) is a FINISHED "
        "run's does not train: it links that run, with no cluster. never: it always trains (--force: one run).",
    )

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
            raise ValueError(
                f"{value!r}: use 1-40 lowercase letters, digits and '-', starting with a letter, e.g. 'digits-mlp'"
            )
        return value

    @model_validator(mode="after")
    def _remote_needs_remote_stores(self, info: ValidationInfo):
        # On the cluster (cluster/job/__main__.py) the flow has checked this already, and "remote" is here.
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
    def _sections_fit_each_other(self):
        problems = (sweep_problems(self) if self.sweep is not None else []) + deadline_problems(self)
        if problems:  # one error per problem, each at its own field
            raise ValidationError.from_exception_data(
                "ExperimentSpec",
                [
                    {"type": "value_error", "loc": tuple(field.split(".", 2)), "input": None, "ctx": {"error": problem}}
                    for field, problem in problems
                ],
            )
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

    def anchored(self) -> ExperimentSpec:
        """This spec with every location absolute: the workdir against the current folder, relative data paths
        against the workdir (on a cloud node, the synced workdir). Each process of a run then reads the same
        files, wherever it runs: Ray Tune runs each trial in a folder of its own."""
        workdir = Path(self.workdir).expanduser().absolute()

        def located(uri: str | None) -> str | None:
            return uri if uri is None or "://" in uri else str(workdir / Path(uri).expanduser())

        data = self.data and self.data.model_copy(
            update={"train": located(self.data.train), "validation": located(self.data.validation)}
        )
        return self.model_copy(
            update={
                "workdir": str(workdir),
                "data": data,
                "tracking": self.tracking.model_copy(update={"uri": self.tracking_uri}),
                "storage": self.storage.model_copy(update={"checkpoints": self.checkpoint_uri}),
            }
        )


# A team's MLflow server asks for these (its basic-auth app); the cluster logs to the same server.
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def job_secrets(spec: ExperimentSpec) -> list[str]:
    """The names passed to the job as secrets: spec.secrets, plus the MLflow server's credentials set here."""
    if not spec.tracking_uri.startswith(("http://", "https://")):
        return list(spec.secrets)
    return [*spec.secrets, *(name for name in TRACKING_CREDENTIALS if name in os.environ and name not in spec.secrets)]
