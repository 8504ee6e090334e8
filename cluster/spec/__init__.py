"""The experiment spec: what a run is, loaded from YAML (or the Prefect UI's form, or Python) and checked before
any cluster exists; each refusal names the field, the value and the fix.

    gpuflow validate experiments/digits.yaml

model.py (the pydantic models; compute.py the compute section), loading.py (YAML, `--set`, error wording),
fields.py (pure field checks), probes.py (the checks that need this machine), entrypoints.py (the loop's import
check), sweep.py (a sweep's arithmetic), form_policy.py (what a run from the UI may change).
"""

from gpuflow.cluster.spec.fields import absolute_uri, is_remote_uri
from gpuflow.cluster.spec.loading import SpecError, apply_override, job_spec, load_spec, parse_spec
from gpuflow.cluster.spec.model import ExperimentSpec, TrainSpec, job_secrets
from gpuflow.cluster.spec.probes import check_entrypoints, check_spec, readable, validate_spec
from gpuflow.cluster.spec.sweep import billed_sweep_minutes, max_epochs, sweep_rounds, trial_train

__all__ = [
    "ExperimentSpec",
    "SpecError",
    "TrainSpec",
    "absolute_uri",
    "apply_override",
    "billed_sweep_minutes",
    "check_entrypoints",
    "check_spec",
    "is_remote_uri",
    "job_secrets",
    "job_spec",
    "load_spec",
    "max_epochs",
    "parse_spec",
    "readable",
    "sweep_rounds",
    "trial_train",
    "validate_spec",
]
