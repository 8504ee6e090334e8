"""What a run started from the Prefect UI form (or the API) may change of its deployment's spec; the rest is fixed.

    # prefect.yaml, under a deployment:
    form_policy: {allow: [train.epochs, train.lr, train.params.*, compute.num_nodes], rerun_refs: [main]}

Whoever can open the Prefect UI can start a run on the worker, with the worker's cloud credentials. A
deployment with a form_policy lets such a run change only the listed fields (`*` matches one or more
levels); the loop and data generator must be functions defined in the project's own files (no builtins,
no `os:system`), and `spec_file` is refused unless listed. A rerun from the form (its rerun_of field) runs only
committed code that one of `rerun_refs` contains (git refs of the deployment's own checkout; default HEAD, the
deployed commit and its history), never a diff held in MLflow. No Prefect here: flows/run_spec.py applies it, and
cluster/rerun/for_flow.py to a rerun.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from gpuflow.cluster.spec import ExperimentSpec, SpecError, parse_spec
from gpuflow.cluster.spec.fields import shorten
from gpuflow.cluster.usercode import on_sys_path

# Derived from other fields, which are compared themselves.
DERIVED = {"compute.num_workers", "compute.use_gpu"}
RERUN_REFS = ("HEAD",)  # a UI rerun's commits, by default: the deployed one and its history
MISSING = object()


@dataclass
class FormPolicy:
    deployment: str
    baseline: ExperimentSpec  # the deployment's own spec, as its maintainers wrote it
    allow: list[str] = field(default_factory=list)
    rerun_refs: list[str] = field(default_factory=lambda: list(RERUN_REFS))  # what a rerun from the UI may run

    def problems(self, spec: ExperimentSpec, spec_file: str | None = None) -> list[str]:
        found = self.field_problems(spec, spec_file)
        generate = spec.data.generate if spec.data else None  # a loop that reads its own data has none
        for path, entrypoint in (("train.loop", spec.train.loop), ("data.generate", generate)):
            problem = entrypoint and not_a_project_function(entrypoint, self.baseline.workdir)
            if problem:
                found.append(f"{path}: {problem}")
        return found

    def field_problems(self, spec: ExperimentSpec, spec_file: str | None = None) -> list[str]:
        """The fields the policy fixes that the spec changes (what any machine can check: no import)."""
        found = []
        if spec_file and not self.allows("spec_file"):
            found.append(
                f"spec_file: deployment {self.deployment!r} takes its spec from the form only; "
                "leave spec_file empty (its form_policy in prefect.yaml does not allow spec_file)"
            )
        baseline = self.baseline.model_dump(mode="json")
        for path in differences(baseline, spec.model_dump(mode="json")):
            if path not in DERIVED and not self.allows(path):
                where = "in the spec file" if spec_file else "in the form"
                found.append(
                    f"{path}: deployment {self.deployment!r} fixes this field to "
                    f"{shorten(value_at(baseline, path), 120)}; give that value {where}, "
                    f"or add {path} to its form_policy.allow in prefect.yaml (allowed: "
                    f"{', '.join(self.allow) or 'nothing'})"
                )
        return found

    def allows(self, path: str) -> bool:
        return any(
            path == pattern or fnmatchcase(path, pattern) or path.startswith(pattern + ".") for pattern in self.allow
        )

    def enforce(self, spec: ExperimentSpec, spec_file: str | None = None) -> ExperimentSpec:
        problems = self.problems(spec, spec_file)
        if problems:
            raise SpecError(problems)
        return spec


def policy_from(deployment: str, entry: dict, baseline_spec: dict) -> FormPolicy | None:
    """The policy of one prefect.yaml deployment entry (None if it has none), with its spec as the baseline."""
    declared = entry.get("form_policy")
    if declared is None:
        return None
    allow = declared.get("allow") if isinstance(declared, dict) else None
    refs = declared.get("rerun_refs", list(RERUN_REFS)) if isinstance(declared, dict) else None
    strings = [isinstance(items, list) and all(isinstance(item, str) for item in items) for items in (allow, refs)]
    if not all(strings) or not refs:  # no rerun_refs would let a UI rerun run uncommitted code
        raise SpecError(
            [
                f"prefect.yaml: deployment {deployment!r} form_policy must be "
                "{allow: [field.path, ...], rerun_refs: [git ref, ...]}, e.g. {allow: [train.epochs, "
                "train.params.*], rerun_refs: [main]} (rerun_refs, at least one: the commits a UI rerun may run; "
                "default HEAD)"
            ]
        )
    return FormPolicy(deployment, parse_spec(baseline_spec), allow, refs)


def differences(before: Any, after: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON-like values differ; a list differs as a whole."""
    if isinstance(before, dict) and isinstance(after, dict):
        paths = []
        for key in sorted(set(before) | set(after), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            paths += differences(before.get(key, MISSING), after.get(key, MISSING), path)
        return paths
    return [] if before == after else [prefix or "spec"]


def value_at(values: Any, path: str) -> Any:
    for key in path.split("."):
        values = values.get(key) if isinstance(values, dict) else None
    return values


def not_a_project_function(entrypoint: str, workdir: str) -> str | None:
    """Why `module:function` is not a Python function defined in a file of the project (workdir), or None."""
    module_name, _, function_name = entrypoint.partition(":")
    root = Path(workdir).resolve()
    try:
        with on_sys_path(workdir):
            module = importlib.import_module(module_name)
    except Exception as exc:  # the validate step reports import errors in full
        return f"cannot import {module_name!r}: {shorten(str(exc), 200)}"
    function = getattr(module, function_name, None)
    source = getattr(module, "__file__", None)
    if not inspect.isfunction(function) or getattr(function, "__module__", None) != module_name:
        return (
            f"{shorten(entrypoint)} is not a function defined in module {module_name!r}; a run from the form "
            "may only name the project's own functions, e.g. 'experiments.digits:train_loop'"
        )
    if not source or not Path(source).resolve().is_relative_to(root):
        return (
            f"{shorten(entrypoint)} is defined outside the project folder {str(root)!r}; a run from the form "
            "may only name the project's own functions"
        )
    return None
