"""What a flow run ran, said in its parameters, name and tags: the spec (form or YAML file), run name, Prefect tags.

    used by flows/experiment.py; a run from the UI or a schedule is tagged experiment:<name> and backend:<backend>
"""

from __future__ import annotations

from datetime import datetime, timezone

from cluster.spec import ExperimentSpec, SpecError, load_spec, parse_spec


def spec_from(spec: ExperimentSpec | dict | None, spec_file: str | None = None) -> ExperimentSpec:
    """The spec a run uses: the YAML file when one is given, else the form's (or Python's) spec."""
    if spec_file:
        return load_spec(spec_file)
    if spec is None:
        raise SpecError(["spec: give an experiment spec, or spec_file with the path of a YAML spec"])
    return parse_spec(spec)


def run_name_for(parameters: dict) -> str:
    """<spec name>-<UTC time>, e.g. digits-mlp-2026-11-21-030000; a spec that does not parse still names its run."""
    try:
        name = spec_from(parameters.get("spec"), parameters.get("spec_file")).name
    except Exception:  # the flow itself reports the bad spec, with the field named
        name = "experiment"
    return f"{name}-{datetime.now(timezone.utc):%Y-%m-%d-%H%M%S}"


def run_tags(spec: ExperimentSpec) -> list[str]:
    return [f"experiment:{spec.name}", f"backend:{spec.compute.backend}"]


def tag_flow_run(flow_run_id, existing_tags, spec: ExperimentSpec) -> list[str]:
    """Adds the run's experiment and backend to its Prefect tags (deployment tags are fixed before the form is read)."""
    from prefect.client.orchestration import get_client

    tags = sorted(set(existing_tags) | set(run_tags(spec)))
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run_id, tags=tags)
    return tags


def flow_run_ui_url(flow_run_id) -> str | None:
    """The flow run's page in the Prefect UI (PREFECT_UI_URL).

    Not runtime.flow_run.ui_url: in Prefect 3.8.8 it gives Cloud's /flow-runs/flow-run/<id>, a 404 on a
    self-hosted server; url_for knows each UI's path.
    """
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id)
