"""The run to rerun, from an MLflow run id or a Prefect flow run id, and what it recorded: its spec, its trial's
values (a sweep's trial), the run that holds its source and data (a trial's parent)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from gpuflow.cluster.lineage import SPEC_ARTIFACT
from gpuflow.cluster.protocol import TRIAL_ID_TAG
from gpuflow.cluster.rerun import RerunRefused
from gpuflow.cluster.run.mlflow_run import runs_of_flow_run
from gpuflow.cluster.util.local_store import store_exists

RUN_ID = re.compile(r"^[0-9A-Za-z-]{8,64}$")  # MLflow's hex ids, Prefect's UUIDs


@dataclass
class FoundRun:
    """The run asked for (`run`), and the run that recorded its spec, source and data (`source`: the sweep's parent
    for a trial, else the run itself)."""

    tracking_uri: str
    client: MlflowClient
    run: Any
    source: Any
    trial_values: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    @property
    def is_trial(self) -> bool:
        return self.source is not self.run

    def recorded_spec(self) -> dict:
        """The spec the run ran: the source run's spec.yaml, a trial's values in place and no sweep."""
        raw = read_spec(self.client, self.source.info.run_id)
        if not self.is_trial:
            return raw
        from gpuflow.cluster.spec.loading import apply_override

        raw.pop("sweep", None)
        for path, value in self.trial_values.items():
            apply_override(raw, path, value)
        return raw


def read_spec(client: MlflowClient, run_id: str) -> dict:
    try:
        text = Path(client.download_artifacts(run_id, SPEC_ARTIFACT)).read_text()
    except (MlflowException, OSError):
        raise RerunRefused(
            f"run {run_id} has no {SPEC_ARTIFACT} artifact: it was not started by gpuflow run (or its "
            "artifacts are gone), so there is no spec to rerun"
        ) from None
    return yaml.safe_load(text) or {}


def find_run(ref: str, tracking_uris: Iterable[str]) -> FoundRun:
    """The run `ref` names (an MLflow run id, else a Prefect flow run id: its top-level MLflow run), in the first of
    `tracking_uris` that has it. A local store that does not exist is skipped, never created."""
    if not RUN_ID.match(ref):
        raise RerunRefused(
            f"run {ref!r} is not a run id; give an MLflow run id (32 hex digits) or a Prefect flow "
            "run id (a UUID), as `gpuflow status` or MLflow's UI shows them"
        )
    searched = []
    for uri in tracking_uris:
        searched.append(uri)
        if not store_exists(uri):
            continue
        client = MlflowClient(uri)
        run = run_by_id(client, ref) or run_of_flow_run(client, ref)
        if run is not None:
            return found(uri, client, run)
    raise RerunRefused(
        f"run {ref!r}: no MLflow run, and no Prefect flow run's MLflow run, has this id in "
        f"{', '.join(searched) or 'no tracking store'}; give the store it was tracked in with "
        "--tracking-uri URI"
    )


def run_by_id(client: MlflowClient, ref: str):
    try:
        return client.get_run(ref)
    except MlflowException:
        return None


def run_of_flow_run(client: MlflowClient, flow_run_id: str):
    """The flow run's own MLflow run (a sweep's parent, not its trials); the newest if it opened several."""
    try:
        runs = runs_of_flow_run(client, flow_run_id)
    except MlflowException:
        return None
    top = [run for run in runs if MLFLOW_PARENT_RUN_ID not in run.data.tags]
    return max(top, key=lambda run: run.info.start_time, default=None)


def found(uri: str, client: MlflowClient, run) -> FoundRun:
    """A trial's source is its parent; its values are its params at the parent's swept paths."""
    parent_id = run.data.tags.get(MLFLOW_PARENT_RUN_ID)
    if not (parent_id and TRIAL_ID_TAG in run.data.tags):
        return FoundRun(uri, client, run, run)
    parent = client.get_run(parent_id)
    swept = (read_spec(client, parent_id).get("sweep") or {}).get("parameters") or {}
    values = {path: yaml.safe_load(value) for path, value in run.data.params.items() if path in swept}
    return FoundRun(uri, client, run, parent, values)
