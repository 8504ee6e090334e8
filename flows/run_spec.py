"""The spec a flow run runs, from its parameters: the form's (or Python's) spec, or a YAML file on the worker, within
its deployment's form_policy (prefect.yaml); and the spec its cancel and crash hooks act on.

    used by flows/experiment.py (the run's name too) and the run's messages (run_messages.py); a rerun's spec is
    prepared from this one afterwards (cluster/rerun/for_flow.py)
"""

from __future__ import annotations

from pathlib import Path

from gpuflow.cluster.config import serve_overrides
from gpuflow.cluster.rerun.for_flow import rerun_cache
from gpuflow.cluster.spec import ExperimentSpec, SpecError, load_spec, parse_spec
from gpuflow.cluster.spec.form_policy import FormPolicy, policy_from
from gpuflow.flows.deployments.deploy import PREFECT_YAML, declared_entry, with_overrides


def spec_from(spec: ExperimentSpec | dict | None, spec_file: str | None = None) -> ExperimentSpec:
    """The spec a run uses: the YAML file when one is given (serve's overrides fill what it leaves out), else the
    form's (or Python's) spec. A rerun's is prepared from it afterwards (cluster/rerun/for_flow.py).

    A run of a deployment with a form_policy (prefect.yaml) may change only what the policy allows: anything
    else is refused here, before anything exists."""
    policy = form_policy_of_this_run()
    if policy and spec_file and not policy.allows("spec_file"):
        return policy.enforce(policy.baseline, spec_file)  # refused without reading a file of the worker
    if spec_file:
        chosen = load_spec(spec_file)
        unset = [item for item in serve_overrides() if not given_in(chosen, item.partition("=")[0].strip())]
        chosen = load_spec(spec_file, unset) if unset else chosen  # `gpuflow serve --set` fills what the file leaves
    elif spec is None:
        raise SpecError(["spec: give an experiment spec, or spec_file with the path of a YAML spec"])
    else:
        chosen = parse_spec(spec)
    return policy.enforce(chosen, spec_file) if policy else chosen


def hooks_spec(parameters: dict) -> ExperimentSpec:
    """The spec a flow run's cancel and crash hooks act on (its backend, its tracking store), from its parameters
    alone: a rerun from the UI's is the recorded spec of the run it reran, read without a checkout."""
    asked = spec_from(parameters.get("spec"), parameters.get("spec_file"))
    rerun_of = parameters.get("rerun_of")
    if not rerun_of or Path(asked.workdir).expanduser().resolve().is_relative_to(rerun_cache().resolve()):
        return asked
    from gpuflow.cluster.rerun.find import find_run

    found = find_run(rerun_of, [asked.tracking_uri])
    recorded = found.recorded_spec()
    recorded.setdefault("tracking", {})["uri"] = found.tracking_uri
    return parse_spec({**recorded, "workdir": asked.workdir})


def form_policy_of_this_run(prefect_yaml: Path = PREFECT_YAML) -> FormPolicy | None:
    """The form_policy of the deployment this flow run belongs to, read from prefect.yaml on this machine.

    Read here, not from the server: whoever can edit a deployment in the UI could otherwise widen its policy.
    The baseline is the deployment's spec with `gpuflow serve --set` overrides applied, as it was served."""
    from prefect import runtime

    deployment = runtime.deployment.name
    entry = declared_entry(deployment, prefect_yaml) if deployment else None
    if entry is None or "form_policy" not in entry:
        return None
    return policy_from(
        deployment, entry, with_overrides(entry.get("parameters") or {}, serve_overrides(), force=True)["spec"]
    )


def given_in(spec, dotted: str) -> bool:
    """Whether the spec's source gave this field (a default is not given)."""
    node = spec
    for key in dotted.split("."):
        if key not in getattr(node, "model_fields_set", ()):
            return False
        node = getattr(node, key)
    return True
