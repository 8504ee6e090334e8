"""`gpuflow share`: lets teammates run a spec on a tracking server with users (MLflow's basic-auth app).

    gpuflow share experiments/digits.yaml --user bob --user carol      # EDIT on its experiment and its model

A run writes to two things it may not own: its experiment (runs) and its registered model (versions). Whoever
runs first creates both and manages them; everyone else needs EDIT on each. `share` creates them if they do not
exist yet (so the caller manages them) and grants each user the permission on both. The caller is whoever
MLFLOW_TRACKING_USERNAME names: the owner, or an admin.
"""

from __future__ import annotations

import argparse
import sys

from gpuflow.cluster.spec import SpecError, load_spec
from gpuflow.flows.cli import add_overrides


def add_parser(commands, name: str) -> None:
    command = commands.add_parser(name, help="let MLflow users run a spec: EDIT on its experiment and model")
    command.add_argument("spec", help="experiment spec (YAML); its tracking.uri is the server")
    command.add_argument("--user", dest="users", action="append", required=True, help="an MLflow user (repeatable)")
    command.add_argument(
        "--permission",
        default="EDIT",
        choices=["READ", "EDIT", "MANAGE"],
        help="what they may do (default EDIT: run and register versions)",
    )
    add_overrides(command, "override a spec field (repeatable)")


def run(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException

    spec = load_spec(args.spec, args.overrides)
    if not spec.tracking_uri.startswith(("http://", "https://")):
        raise SpecError(
            [
                f"tracking.uri: {spec.tracking_uri!r} is this machine's own store; sharing needs a tracking "
                "server with users (see the README, For a team)"
            ]
        )
    try:
        for line in share(spec, args.users, args.permission):
            print(line)
    except MlflowException as exc:
        print(f"gpuflow share: {exc.message}", file=sys.stderr)
        return 1
    return 0


def share(spec, users: list[str], permission: str = "EDIT") -> list[str]:
    """Grants each user the permission on the spec's experiment and registered model; says what it did."""
    from mlflow.exceptions import MlflowException
    from mlflow.server.auth.client import AuthServiceClient

    from gpuflow.cluster.run.record import client_for, experiment_id

    client = client_for(spec)
    experiment = experiment_id(client, spec)
    try:
        client.create_registered_model(spec.name)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    auth = AuthServiceClient(spec.tracking_uri)
    granted = []  # this call's new grants: taken back if a user is unknown (only an admin may look users up)
    try:
        for user in users:
            for kind, name in (("experiment", experiment), ("registered_model", spec.name)):
                try:
                    auth.grant_user_permission(user, kind, name, permission)
                    granted.append((user, kind, name))
                except MlflowException as exc:  # shared before: given this permission now, as asked
                    if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                        raise
                    auth.revoke_user_permission(user, kind, name)
                    auth.grant_user_permission(user, kind, name, permission)
    except MlflowException:
        for user, kind, name in granted:  # all or nothing
            auth.revoke_user_permission(user, kind, name)
        raise
    return [
        f"{user}: {permission} on experiment {spec.experiment_name!r} and registered model {spec.name!r} "
        f"at {spec.tracking_uri}"
        for user in users
    ]
