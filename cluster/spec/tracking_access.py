"""Whether the tracking user may do what a run does, asked of an MLflow server with users (its basic-auth app)
before anything starts: who the user is, and EDIT on the experiment the run logs to and on the model it registers.

MLflow's own client sends the credentials (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or a token), so
what is checked is what the run will send. A server without users (no basic-auth app) has nothing to check.
"""

from __future__ import annotations

import os

from gpuflow.cluster.spec.fields import scheme_of, shorten

CURRENT_USER = "/api/2.0/mlflow/users/current"
USER_PERMISSION = "/api/3.0/mlflow/users/permissions/get"
WRITE = ("EDIT", "MANAGE")  # what creating runs and model versions takes


def tracking_access_problems(uri: str, experiment: str, model: str) -> list[str]:
    """Each problem names the variable to fix, or the permission missing and how to get it."""
    if scheme_of(uri) not in ("http", "https"):
        return []
    answer = get(uri, CURRENT_USER)
    if answer.status_code == 401:
        return [unauthenticated(uri)]
    if answer.status_code != 200:
        return []  # 404: no users on this server
    me = answer.json()["user"]
    if me["is_admin"]:
        return []
    resources = [("tracking.experiment", "experiment", experiment, "/api/2.0/mlflow/experiments/get-by-name",
                  {"experiment_name": experiment}),
                 ("name", "registered_model", model, "/api/2.0/mlflow/registered-models/get", {"name": model})]
    problems = []
    for field, kind, name, endpoint, params in resources:
        found = get(uri, endpoint, params)
        if found.status_code == 404:
            continue  # the run creates it, and its creator manages it
        if found.status_code == 200:
            resource_id = found.json()["experiment"]["experiment_id"] if kind == "experiment" else name
            permission = get(uri, USER_PERMISSION, {"username": me["username"], "resource_type": kind,
                                                    "resource_id": resource_id}).json().get("permission", "none")
        else:
            permission = f"no access ({found.status_code})"
        if permission not in WRITE:
            problems.append(
                f"{field}: MLflow user {me['username']!r} has {permission} on {kind.replace('_', ' ')} {shorten(name)} "
                f"at {uri}; a run needs EDIT: its owner or an admin grants it with `gpuflow share SPEC --user "
                f"{me['username']}`, or change {field}")
    return problems


def get(uri: str, endpoint: str, params: dict | None = None):
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    return http_request(get_default_host_creds(uri), endpoint, "GET", params=params, max_retries=0, timeout=10)


def unauthenticated(uri: str) -> str:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if not user:
        return (f"tracking.uri: the MLflow server at {uri} asks who you are (401); export MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (a user its admin created)")
    return (f"tracking.uri: the MLflow server at {uri} refused user {shorten(user)} (401): no such user, or "
            "MLFLOW_TRACKING_PASSWORD is not its password; fix MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, "
            "or ask the admin to create the user")
