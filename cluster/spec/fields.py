"""The spec's field checks and field types: bounded YAML, credential-looking names, URIs a cluster can reach. Pure:
the checks that need this machine (a write to the checkpoint storage, the tracking server's answer) are probes.py's.

    gpuflow validate my.yaml          # runs every check here before anything starts
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from gpuflow.cluster.config import shared_path

MAX_SPEC_FILE_BYTES = 256 * 1024  # a spec is a page of YAML; anything bigger is a mistake or an attack
MAX_SPEC_NODES = 5_000  # values in the spec, aliases counted as often as they are used
MAX_SPEC_DEPTH = 16
MAX_VALUE_CHARS = 120  # a bad value is quoted up to this length in a message

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Words that make an environment variable a credential: its value must not be logged anywhere.
CREDENTIAL_WORDS = {
    "KEY",
    "KEYS",
    "APIKEY",
    "TOKEN",
    "TOKENS",
    "SECRET",
    "SECRETS",
    "PASSWORD",
    "PASSWD",
    "PASS",
    "PWD",
    "CREDENTIAL",
    "CREDENTIALS",
    "AUTH",
    "PRIVATE",
    "CERT",
    "SESSION",
    "SIGNATURE",
    "DSN",
}
# In a hyper-parameter's name some of them mean something else (max_tokens, label_key, forward_pass, private_ratio).
PARAM_CREDENTIAL_WORDS = (
    CREDENTIAL_WORDS
    - {"KEY", "KEYS", "TOKENS", "PASS", "PWD", "AUTH", "PRIVATE", "CERT", "SESSION", "SIGNATURE", "DSN"}
) | {"ACCESSKEY", "SECRETKEY", "PRIVATEKEY"}
VOCABULARY_TOKENS = {"PAD", "BOS", "EOS", "UNK", "SEP", "CLS", "MASK", "START", "END", "STOP", "SPECIAL", "EOT"}
# What gpuflow itself sets for the job: an `envs` entry must not redirect it.
RESERVED_ENV = re.compile(r"^(GPUFLOW_.*|MLFLOW_TRACKING_URI|MLFLOW_RUN_ID|RAY_AUTH_.*|RAY_ADDRESS|PYTHONPATH)$")

TRACKING_SCHEMES = {
    "http",
    "https",
    "file",
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "databricks",
    "databricks-uc",
    "uc",
}
STORAGE_SCHEMES = {"file", "s3", "gs", "gcs", "az", "abfs", "abfss", "hdfs", "r2"}
SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def cut(text: str, limit: int) -> str:
    """`text`, shortened to `limit` characters, saying how long it was."""
    return text if len(text) <= limit else text[: limit - 20] + f" ... ({len(text)} chars)"


def shorten(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """repr(value), cut in the middle when long, so that a hostile value cannot flood a message."""
    text = repr(value)
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]} ({len(text)} chars)"


# -- the size of what was loaded ------------------------------------------------------------------


def size_problem(raw: Any) -> str | None:
    """Refuses a structure too big or too deep to be a spec, without expanding it: the walk stops at the limit.

    YAML aliases share one object, so a "billion laughs" file loads small; it is every later walk
    (validation, printing, logging) that explodes. Counting through aliases catches it here."""
    seen = 0
    stack: list[tuple[Any, int]] = [(raw, 0)]
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_SPEC_NODES:
            return (
                f"spec: more than {MAX_SPEC_NODES} values (YAML aliases count each time they are used); "
                "a spec is a short file: write each value once, without nested aliases"
            )
        if depth > MAX_SPEC_DEPTH:
            return f"spec: nested deeper than {MAX_SPEC_DEPTH} levels (or a recursive alias); flatten it"
        if isinstance(node, dict):
            stack.extend((item, depth + 1) for pair in node.items() for item in pair)
        elif isinstance(node, (list, tuple)):
            stack.extend((item, depth + 1) for item in node)
    return None


# -- environment variable names -------------------------------------------------------------------


def name_words(name: str) -> list[str]:
    """The words of a name, upper case: WANDB_API_KEY, wandb-api-key and wandbApiKey → [WANDB, API, KEY]."""
    return [word for word in re.split(r"[_\-.\s]+", re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()) if word]


def looks_like_credential(name: str) -> str | None:
    """The word of `name` that makes it a credential (WANDB_API_KEY → KEY), or None."""
    return next((word for word in name_words(name) if word in CREDENTIAL_WORDS), None)


def param_looks_like_credential(name: str) -> str | None:
    """The credential word a hyper-parameter's name ends with (db_password, wandbApiKey, hf_token), or None.

    Narrower than for an environment variable: max_tokens, label_key, pad_token or forward_pass are
    hyper-parameters, so only the last word (or last two: api_key, secret_access_key) counts."""
    words = name_words(name) or [""]
    if words[-1] == "TOKEN" and len(words) > 1 and words[-2] in VOCABULARY_TOKENS:
        return None  # pad_token, eos_token: a token of the model's vocabulary
    return next((word for word in ("".join(words[-2:]), words[-1]) if word in PARAM_CREDENTIAL_WORDS), None)


QUOTA_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def quota_name_problem(name: str) -> str | None:
    if QUOTA_NAME.match(name):
        return None
    return f"{shorten(name)}: use lowercase letters, digits, '.', '_' and '-' (at most 63), e.g. 'aws-h100'"


def env_name_problem(name: str) -> str | None:
    if not ENV_NAME.match(name):
        return f"{shorten(name)} is not an environment variable name; use letters, digits and '_', e.g. WANDB_PROJECT"
    return None


def envs_problems(envs: dict[str, str]) -> list[str]:
    problems = []
    for name in envs:
        problem = env_name_problem(name)
        if problem:
            problems.append(problem)
        elif looks_like_credential(name):
            problems.append(
                f"{name!r} looks like a credential ({looks_like_credential(name)}): its value would be logged with "
                f"the spec; move it to secrets: remove it from envs, add `secrets: [{name}]` and export {name} "
                "where the flow runs"
            )
        elif RESERVED_ENV.match(name):
            problems.append(f"{name!r} is set by gpuflow for the job; remove it from envs")
    return problems


def credential_params(params: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """The train.params keys (nested ones too) named like a credential, each with the fix: MLflow logs params."""
    found = []
    for key, value in params.items():
        if param_looks_like_credential(str(key)):
            env = "_".join(name_words(str(key)))
            env = env if ENV_NAME.match(env) else "MY_SECRET"
            found.append(
                (
                    (*path, key),
                    "a parameter named like a credential is logged to MLflow in clear; "
                    f"put the value in an environment variable, list its name under secrets: (e.g. secrets: "
                    f"[{env}]), and read it with os.environ[{env!r}] in the loop",
                )
            )
        elif isinstance(value, dict):
            found += credential_params(value, (*path, key))
    return found


# -- URIs -----------------------------------------------------------------------------------------


def scheme_of(uri: str) -> str | None:
    match = SCHEME.match(uri)
    if not match or (len(match.group(1)) == 1 and uri[1:3] in (":\\", ":/")):  # a Windows drive, not a scheme
        return None
    return match.group(1).lower().split("+")[0]


def tracking_uri_problem(uri: str) -> str | None:
    scheme = scheme_of(uri)
    if scheme is None:
        return None  # a local folder: MLflow's file store
    if scheme not in TRACKING_SCHEMES:
        return (
            f"{shorten(uri)}: MLflow cannot track to a {scheme}:// URI; use http(s)://host:port of an MLflow "
            "server, sqlite:///path.db, postgresql://..., or leave it unset for the local store"
        )
    if scheme in ("http", "https"):
        from urllib.parse import urlparse

        parsed = urlparse(uri)
        if not parsed.hostname:
            return f"{shorten(uri)} has no host; write e.g. http://127.0.0.1:5000"
        if parsed.username or parsed.password:
            return (
                "credentials in tracking.uri would be logged with the spec; remove them and add "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to secrets"
            )
    return None


def storage_uri_problem(uri: str) -> str | None:
    scheme = scheme_of(uri)
    if scheme is None or scheme in STORAGE_SCHEMES:
        return None
    return (
        f"{shorten(uri)}: {scheme}:// is not a storage gpuflow can use; give a folder, or a bucket URI "
        f"({', '.join(sorted(s + '://' for s in STORAGE_SCHEMES))})"
    )


def control_character_problem(text: str) -> str | None:
    if any(ord(ch) < 32 and ch not in "\t\n\r" for ch in text):
        return f"{shorten(text)} holds control characters (NUL, ...); remove them"
    return None


REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "hdfs://", "r2://")


def is_remote_uri(uri: str) -> bool:
    """True for a location a cluster's nodes can reach: a server, a bucket, or a path under GPUFLOW_SHARED_PATH."""
    shared = shared_path()
    return uri.startswith(("http://", "https://", "databricks") + REMOTE_SCHEMES) or (
        bool(shared) and uri.removeprefix("file://").removeprefix("sqlite:///").startswith(shared)
    )


def absolute_uri(uri: str) -> str:
    return uri if "://" in uri else str(Path(uri).expanduser().absolute())


# -- the field types of the spec's models ------------------------------------------------------------------------
def no_problem(check):
    """A pydantic AfterValidator from a check that returns a problem (str) or None."""

    def validate(value):
        problem = value is not None and check(value)
        if problem:
            raise ValueError(problem)
        return value

    return AfterValidator(validate)


# Numbers are strict (`epochs: true` is not 1, "10" is not 10), finite, and bounded to what a run can mean.
def Count(ge: int, le: int):  # noqa: N802  (a type)
    return Annotated[int, Field(strict=True, ge=ge, le=le)]


def Amount(le: float, gt: float | None = 0, ge: float | None = None):  # noqa: N802
    return Annotated[float, Field(strict=True, allow_inf_nan=False, gt=None if ge is not None else gt, ge=ge, le=le)]


Text = Annotated[str, Field(max_length=4096), no_problem(control_character_problem)]
Entrypoint = Annotated[str, Field(max_length=200)]
StorageUri = Annotated[Text, no_problem(storage_uri_problem)]
EnvName = Annotated[str, Field(max_length=128), no_problem(env_name_problem)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
