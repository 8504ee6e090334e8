"""What a rerun checks before any cluster exists: the run's data, by the digests it recorded (a changed or missing
file refuses the rerun), and its packages against this environment (differences are said, never installed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from gpuflow.cluster.lineage import PACKAGES_ARTIFACT, packages_text, parquet_dataset

CONTEXT_FIELDS = {"training": "train", "validation": "validation"}  # MLflow's dataset context -> data.<field>
PYTHON = "python"  # the package list's header line, compared as a package


@dataclass(frozen=True)
class DataCheck:
    """One recorded input: where it was, its digest then and now (None: missing or unreadable now)."""

    field: str  # data.train, data.validation
    uri: str
    recorded: str
    now: str | None
    problem: str = ""

    @property
    def changed(self) -> bool:
        return self.now != self.recorded

    def describe(self) -> str:
        if self.now is None:
            return (
                f"{self.field} {self.uri}: missing or unreadable now ({self.problem}); the run read digest "
                f"{self.recorded}"
            )
        if self.changed:
            return f"{self.field} {self.uri}: changed since the run: digest {self.recorded} then, {self.now} now"
        return f"{self.field} {self.uri}: unchanged (digest {self.now})"


def recorded_inputs(source_run) -> dict[str, tuple[str, str]]:
    """data.<field> -> (uri, digest) of each Parquet input the run recorded."""
    found = {}
    for entry in source_run.inputs.dataset_inputs if source_run.inputs else []:
        context = next((tag.value for tag in entry.tags if tag.key == MLFLOW_DATASET_CONTEXT), "")
        uri = json.loads(entry.dataset.source or "{}").get("uri")
        if uri:
            found[f"data.{CONTEXT_FIELDS.get(context, context)}"] = (uri, entry.dataset.digest)
    return found


def data_checks(source_run) -> list[DataCheck]:
    """Each recorded input's digest, recomputed from its files' footers as the run computed it."""
    checks = []
    for field, (uri, digest) in recorded_inputs(source_run).items():
        try:
            checks.append(DataCheck(field, uri, digest, parquet_dataset(uri).digest))
        except Exception as exc:
            checks.append(DataCheck(field, uri, digest, None, f"{type(exc).__name__}: {str(exc)[:200]}"))
    return checks


# -- the packages --------------------------------------------------------------------------------------------------
def versions(text: str) -> dict[str, tuple[str, str]]:
    """normalized name -> (name, version) of a package list (lineage.packages_text), its Python as "python"."""
    found = {}
    for line in text.splitlines():
        if line.startswith("# Python "):
            found[PYTHON] = ("Python", line.removeprefix("# Python ").split()[0])
        elif "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            found[name.strip().lower().replace("_", "-")] = (name.strip(), version.strip())
    return found


def package_differences(recorded: str, here: str | None = None) -> list[tuple[str, str | None, str | None]]:
    """(name, version the run had, version here) for each package that differs; None: not installed there."""
    then, now = versions(recorded), versions(packages_text() if here is None else here)
    return [
        ((then.get(key) or now[key])[0], then.get(key, (None, None))[1], now.get(key, (None, None))[1])
        for key in sorted(set(then) | set(now))
        if then.get(key, (0, None))[1] != now.get(key, (0, None))[1]
    ]


def recorded_packages(client, source_run) -> str | None:
    """The job's package list, as the run recorded it; None when it recorded none."""
    try:
        return Path(client.download_artifacts(source_run.info.run_id, PACKAGES_ARTIFACT)).read_text()
    except Exception:
        return None
