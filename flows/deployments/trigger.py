"""`gpuflow run --deployment NAME`: a run of a served (or deployed) deployment, started from this terminal and
recorded as the caller's.

    gpuflow run --deployment run-experiment/run-experiment --set train.epochs=3

A self-hosted Prefect server has one shared credential, not users: it records no creator for a run started through
its API or UI. Before it triggers, this asks the run's MLflow server who the caller's credentials
(MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) belong to, and whether that user may write the run's experiment
and model: a wrong password, an unknown user or a missing permission starts nothing. The flow run is tagged with the
user the server verified, and the flow copies it onto its MLflow run (protocol.TRIGGERED_BY_TAG). A tracking store
without users has no one to verify: the run is then tagged with MLFLOW_TRACKING_USERNAME as declared.
"""

from __future__ import annotations

import os

from gpuflow.cluster.protocol import TRIGGERED_BY_PREFECT_TAG_PREFIX
from gpuflow.cluster.spec import SpecError, parse_spec
from gpuflow.cluster.spec.probes import access_problems, verified_user
from gpuflow.flows.deployments.deploy import declared_entry, with_overrides


class NoSuchDeployment(LookupError):
    """The Prefect server has no deployment of that name; the message names the server and how to list them."""


def trigger(name: str, overrides: list[str] = ()) -> str:
    """Creates a flow run of the deployment `flow/deployment` (the deployment's spec with `overrides`); its id."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise NoSuchDeployment(
                f"no deployment {name!r} on the Prefect server at {client.api_url}: `prefect deployment ls` lists "
                "those it has (a `gpuflow serve` registers prefect.yaml's as it starts)"
            ) from None
        parameters = with_overrides(deployment.parameters, overrides) if overrides else None
        spec = parse_spec((parameters or deployment.parameters)["spec"])
        refuse_what_the_form_fixes(name, deployment.parameters["spec"], spec)
        user = caller(spec)
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters=parameters, tags=[TRIGGERED_BY_PREFECT_TAG_PREFIX + user] if user else []
        )
    print(
        # not its name: Prefect's placeholder until the flow names it (`gpuflow status` shows the id's first 8)
        f"gpuflow: started flow run {flow_run.id} of {name}"
        + (f", triggered by {user}" if user else "; MLFLOW_TRACKING_USERNAME unset: recorded as nobody's")
    )
    if unserved := not_served(deployment):
        print(f"gpuflow: {name} {unserved}: the run waits, Scheduled, until a `gpuflow serve` (or worker) picks it up")
    return str(flow_run.id)


def refuse_what_the_form_fixes(name: str, served_spec: dict, spec) -> None:
    """Raises SpecError for a field the deployment's form_policy fixes (as this project's prefect.yaml declares it),
    before anything is triggered. The serving machine applies its own policy to the run, and decides: this spares a
    run that would fail there."""
    from gpuflow.cluster.spec.form_policy import policy_from

    deployment = name.partition("/")[2]
    entry = declared_entry(deployment)
    policy = entry and policy_from(deployment, entry, served_spec)
    if policy and (problems := policy.field_problems(spec)):
        raise SpecError(problems)


def not_served(deployment) -> str | None:
    """Why nothing would pick a run of `deployment` up now (paused, or polled by no serve lately); None if served."""
    from prefect.client.schemas.objects import DeploymentStatus

    if deployment.paused:
        return "is paused (its last serve stopped)"
    if deployment.status == DeploymentStatus.NOT_READY:
        return "is polled by no serve now"
    return None


def caller(spec) -> str | None:
    """Who triggers, as the run's MLflow server verified it (raises SpecError, naming the variable or the permission
    to fix, where it refuses); the declared MLFLOW_TRACKING_USERNAME where the store has no users to check."""
    problems = access_problems(spec)
    if problems:
        raise SpecError(problems)
    return verified_user(spec.tracking_uri) or os.environ.get("MLFLOW_TRACKING_USERNAME")
