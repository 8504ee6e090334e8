"""The checks a spec's model cannot make alone, because they need this machine: the loop imports and takes its
config, the data reads as Parquet, the checkpoint storage takes a write, the tracking server answers and lets the
tracking user write."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

from gpuflow.cluster.spec.entrypoints import entrypoint_check
from gpuflow.cluster.spec.fields import absolute_uri, scheme_of, shorten
from gpuflow.cluster.spec.loading import Denied, Refusal, Silence, SpecError
from gpuflow.cluster.spec.model import ExperimentSpec
from gpuflow.cluster.util.http import NOT_HTTP, probe

TRACKING_PROBE_TIMEOUT_S = 5.0
TRACKING_WAIT_S = 120.0  # a run nobody watches waits this long for a tracking server that does not answer (restarting)
CURRENT_USER = "/api/2.0/mlflow/users/current"
USER_PERMISSION = "/api/3.0/mlflow/users/permissions/get"
WRITE = ("EDIT", "MANAGE")  # what creating runs and model versions takes


def check_spec(spec: ExperimentSpec) -> list[str]:
    """What the model alone cannot check: the loop imports and takes the right arguments, the data is readable,
    the checkpoint storage is writable, the tracking server answers."""
    importing = check_entrypoints(spec)  # seconds of imports, in a process of its own: the other checks meanwhile
    generate = spec.data.generate if spec.data else None
    problems = []
    if not Path(spec.workdir).is_dir():
        problems.append(f"workdir: {spec.workdir!r} is not a folder")
    located = spec.anchored().data
    for field in ("train", "validation"):
        uri = getattr(spec.data, field) if spec.data else None
        unusable = uri and not generate and data_problem(getattr(located, field))
        if unusable:
            problems.append(
                f"data.{field}: {uri!r} {unusable}; give a Parquet file or folder that holds rows, "
                "or set data.generate to a function that writes it"
            )
    for field, secret in enumerate(spec.secrets):
        if secret not in os.environ:
            problems.append(f"secrets[{field}]: {secret!r} is not set in this environment; export it before running")
    unwritable = storage_write_problem(spec.checkpoint_uri)
    if unwritable:
        problems.append(f"storage.checkpoints: {unwritable}; give a folder or bucket this machine can write")
    down = tracking_server_problem(spec.tracking_uri)
    problems += [Silence(f"tracking.uri: {down}")] if down else access_problems(spec)
    return importing.problems() + problems


def access_problems(spec: ExperimentSpec) -> list[str]:
    """The tracking user's problems (tracking_access_problems), or the server's silence where it stopped answering
    between the questions (killed, restarting)."""
    try:
        return tracking_access_problems(spec.tracking_uri, spec.experiment_name, spec.name)
    except ServerSilent:
        down = tracking_server_problem(spec.tracking_uri) or (
            f"the MLflow server at {shorten(spec.tracking_uri)} stopped answering as its users were asked; start it, "
            "or fix the host and port"
        )
        return [Silence(f"tracking.uri: {down}")]


def check_entrypoints(spec: ExperimentSpec):
    """Starts (or finds) the check that the spec's loop and data generator import and take the right arguments."""
    entrypoints = {"train.loop": spec.train.loop, "data.generate": spec.data.generate if spec.data else None}
    return entrypoint_check(spec.workdir, {field: value for field, value in entrypoints.items() if value})


def validate_spec(spec: ExperimentSpec, patience_s: float = 0.0, say=print) -> ExperimentSpec:
    """Raises SpecError with every problem. With `patience_s` (a run nobody watches: a schedule, the UI), a tracking
    server that does not answer is waited for that long, saying so, and the checks made again once it answers: the
    run outlives a restart of it, whenever it strikes. A person at `gpuflow run` is told at once."""
    deadline = time.monotonic() + patience_s
    problems = check_spec(spec)
    while any(isinstance(problem, Silence) for problem in problems) and time.monotonic() < deadline:
        if not wait_for_tracking_server(spec.tracking_uri, say, deadline - time.monotonic()):
            break
        problems = check_spec(spec)
    if problems:
        raise SpecError(problems)
    return spec


def readable(uri: str) -> bool:
    return data_problem(uri) is None


def data_problem(uri: str) -> str | None:
    """None if `uri` is Parquet data with at least one row, else what it is."""
    import pyarrow.dataset as ds

    try:
        dataset = ds.dataset(absolute_uri(uri), format="parquet")
        if not dataset.files:
            return "holds no Parquet files"
        # a file's row count is in its footer; stop at the first file with rows
        if not any(fragment.count_rows() for fragment in dataset.get_fragments()):
            return "holds no rows"
    except Exception:
        return "cannot be read as Parquet"
    return None


# -- the checkpoint storage takes a write, the tracking server answers ---------------------------------------


def folder_write_problem(folder: Path, probe_name: str) -> str | None:
    """Writes and removes a probe file in the folder or, where it is missing, in a probe folder made and removed where
    the job will make it: root passes a permission check where only a write fails (a kernel file system, an immutable
    folder), and the probe leaves no folder (on a shared disk, the job's user must make it, not the flow's)."""
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        return f"cannot write under {shorten(str(folder))}: {existing} is a file"
    stand_in = existing / probe_name if existing != folder else None
    probe_file = (stand_in or folder) / probe_name
    try:
        if stand_in:
            stand_in.mkdir()
        probe_file.write_bytes(b"probe")
        probe_file.unlink()
    except OSError as exc:
        return f"cannot write under {shorten(str(folder))}: {exc.strerror or exc} ({exc.filename or probe_file})"
    finally:
        if stand_in:
            with contextlib.suppress(OSError):
                stand_in.rmdir()
    return None


def storage_write_problem(uri: str) -> str | None:
    """Writes and removes a probe file under the checkpoint location (local or a bucket, through pyarrow)."""
    import pyarrow.fs as pafs

    probe_name = f".gpuflow-write-probe-{uuid.uuid4().hex}"
    try:
        if scheme_of(uri) is None:
            return folder_write_problem(Path(uri).expanduser().absolute(), probe_name)
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except ValueError as exc:  # pyarrow's ArrowInvalid is a ValueError
        if "Unrecognized filesystem type" in str(exc) or "not supported" in str(exc):
            return None  # a bucket only the cluster's tools know (e.g. r2://): SkyPilot mounts it there
        return f"cannot write under {shorten(uri)}: {shorten(str(exc), 300)}"
    except OSError as exc:
        return f"cannot write under {shorten(uri)}: {shorten(exc.strerror or str(exc), 300)}"
    try:
        filesystem.create_dir(path, recursive=True)
        probe_path = f"{path.rstrip('/')}/{probe_name}"
        with filesystem.open_output_stream(probe_path) as out:
            out.write(b"probe")
        filesystem.delete_file(probe_path)
    except Exception as exc:  # pyarrow raises OSError or ArrowException subclasses per filesystem
        return f"cannot write under {shorten(uri)}: {shorten(str(exc), 300)}"
    return None


def silence_of(uri: str, timeout_s: float = TRACKING_PROBE_TIMEOUT_S) -> str | None:
    """Why an http(s) tracking server did not answer its health probe (`NOT_HTTP`: something else did); None when it
    answered (any HTTP status: a 401 means it is up, behind auth) or the URI names no server."""
    if scheme_of(uri) not in ("http", "https"):
        return None
    status, why = probe(uri.rstrip("/") + "/health", timeout_s)
    return None if status is not None else why


def tracking_server_problem(uri: str, timeout_s: float = TRACKING_PROBE_TIMEOUT_S) -> str | None:
    """An http(s) tracking URI must answer."""
    why = silence_of(uri, timeout_s)
    if why is None:
        return None
    if why == NOT_HTTP:
        return (
            f"what answers at {shorten(uri)} is not an HTTP server (not MLflow's); fix the host and port, or the scheme"
        )
    return (
        f"the MLflow server at {shorten(uri)} does not answer ({shorten(why, 200)} within "
        f"{timeout_s:g}s); start it, or fix the host and port"
    )


def wait_for_tracking_server(uri: str, say, bound_s: float = TRACKING_WAIT_S) -> bool:
    """Waits up to `bound_s` while an http(s) tracking server does not answer, saying so once; whether it answers.
    What is not an HTTP server is no restart, and is not waited for."""
    deadline, waited = time.monotonic() + bound_s, False
    while time.monotonic() < deadline:
        why = silence_of(uri)
        if why in (None, NOT_HTTP):
            if waited:
                say(f"the MLflow server at {shorten(uri)} answers again")
            return why is None
        if not waited:
            say(f"the MLflow server at {shorten(uri)} does not answer ({shorten(why, 200)}): waiting {bound_s:.0f} s")
            waited = True
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    return False


# -- the tracking user may write ------------------------------------------------------------------------------
# Asked of an MLflow server with users (its basic-auth app) before anything starts: who the user is, and EDIT on the
# experiment the run logs to and on the model it registers. MLflow's own client sends the credentials
# (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or a token), so what is checked is what the run will send. A
# server without users (no basic-auth app) has nothing to check.


def tracking_access_problems(uri: str, experiment: str, model: str) -> list[str]:
    """Each problem names the variable to fix, or the permission missing and how to get it."""
    if scheme_of(uri) not in ("http", "https"):
        return []
    answer = mlflow_get(uri, CURRENT_USER)
    if answer.status_code == 401:
        return [unauthenticated(uri)]
    if answer.status_code != 200:
        return []  # 404: no users on this server
    me = answer.json()["user"]
    if me["is_admin"]:
        return []
    resources = [
        (
            "tracking.experiment",
            "experiment",
            experiment,
            "/api/2.0/mlflow/experiments/get-by-name",
            {"experiment_name": experiment},
        ),
        ("name", "registered_model", model, "/api/2.0/mlflow/registered-models/get", {"name": model}),
    ]
    problems = []
    for field, kind, name, endpoint, params in resources:
        found = mlflow_get(uri, endpoint, params)
        if found.status_code == 404:
            continue  # the run creates it, and its creator manages it
        if found.status_code == 200:
            resource_id = found.json()["experiment"]["experiment_id"] if kind == "experiment" else name
            permission = (
                mlflow_get(
                    uri,
                    USER_PERMISSION,
                    {"username": me["username"], "resource_type": kind, "resource_id": resource_id},
                )
                .json()
                .get("permission", "none")
            )
        else:
            permission = f"no access ({found.status_code})"
        if permission not in WRITE:
            problems.append(
                Denied(
                    f"{field}: MLflow user {me['username']!r} has {permission} on {kind.replace('_', ' ')} "
                    f"{shorten(name)} at {uri}; a run needs EDIT: its owner or an admin grants it with `gpuflow share "
                    f"SPEC --user {me['username']}`, or change {field}"
                )
            )
    return problems


def verified_user(uri: str) -> str | None:
    """The MLflow user the server at `uri` took the caller's credentials for; None where it has no users to check
    (a local store, a server without its basic-auth app) or refused them (tracking_access_problems says why)."""
    if scheme_of(uri) not in ("http", "https"):
        return None
    answer = mlflow_get(uri, CURRENT_USER)
    return answer.json()["user"]["username"] if answer.status_code == 200 else None


class ServerSilent(ConnectionError):
    """Nothing answered a request to the MLflow server (its URI)."""


def mlflow_get(uri: str, endpoint: str, params: dict | None = None):
    """MLflow's answer, with the credentials its client sends; ServerSilent where nothing answered."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        return http_request(get_default_host_creds(uri), endpoint, "GET", params=params, max_retries=0, timeout=10)
    except MlflowException as exc:  # it wraps the connection's failure, as its context
        if isinstance(exc.__context__, requests.RequestException):
            raise ServerSilent(uri) from exc
        raise


def unauthenticated(uri: str) -> Refusal:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if not user:
        return Refusal(
            f"tracking.uri: the MLflow server at {uri} asks who you are (401); export MLFLOW_TRACKING_USERNAME "
            "and MLFLOW_TRACKING_PASSWORD (a user its admin created)"
        )
    return Refusal(
        f"tracking.uri: the MLflow server at {uri} refused user {shorten(user)} (401): no such user, or "
        "MLFLOW_TRACKING_PASSWORD is not its password; fix MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, "
        "or ask the admin to create the user"
    )
