"""The secured team stack for tests: PostgreSQL, a Prefect server with basic auth and MLflow's basic-auth app on it.

used by tests/test_team_stack.py; everything on 127.0.0.1 and free ports, stopped (and its data removed) on exit
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.infra.postgres import harness
from tests.support.servers import BIN, READY_TIMEOUT_S, base_env, prefect_server_at, serving

MLFLOW_ADMIN = "admin"


@dataclass
class TeamStack:
    api_url: str
    mlflow_url: str
    prefect_auth: str  # user:password, as PREFECT_API_AUTH_STRING
    mlflow_password: str
    postgres: harness.Postgres
    home: Path

    def client_env(self) -> dict[str, str]:
        """What a user, a worker or `gpuflow serve` exports to reach both servers."""
        return {
            "PREFECT_API_URL": self.api_url,
            "PREFECT_API_AUTH_STRING": self.prefect_auth,
            "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_password,
        }

    @contextlib.contextmanager
    def prefect_client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with (
            temporary_settings({PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: self.prefect_auth}),
            get_client(sync_client=True) as client,
        ):
            yield client


@contextlib.contextmanager
def team_stack():
    """PostgreSQL → Prefect server (PostgreSQL, basic auth) → MLflow basic-auth server (PostgreSQL); down in reverse."""
    # Not pytest's tmp_path: its parents are private to root, and the database server runs as `postgres`.
    home = Path(tempfile.mkdtemp(prefix="gpuflow-team-"))
    home.chmod(0o755)
    try:
        with (
            harness.postgres(home / "postgres") as pg,
            prefect_on_postgres(home / "prefect", pg) as (api_url, prefect_auth),
            mlflow_on_postgres(home / "mlflow", pg) as (mlflow_url, mlflow_password),
        ):
            yield TeamStack(api_url, mlflow_url, prefect_auth, mlflow_password, pg, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def prefect_on_postgres(home: Path, pg: harness.Postgres):
    auth = f"admin:{secrets.token_hex(12)}"
    home.mkdir(parents=True, exist_ok=True)
    env = base_env(
        PREFECT_HOME=str(home),
        PREFECT_API_DATABASE_CONNECTION_URL=pg.url("prefect", driver="postgresql+asyncpg"),
        PREFECT_SERVER_API_AUTH_STRING=auth,
        PREFECT_API_AUTH_STRING=auth,
        PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
    )
    with serving(prefect_server_at(env), home / "server.log", "/api/health") as (_, url):
        yield f"{url}/api", auth


@contextlib.contextmanager
def mlflow_on_postgres(home: Path, pg: harness.Postgres):
    """`mlflow server --app-name basic-auth`: runs and users both in PostgreSQL; the admin's password is generated."""
    password = secrets.token_hex(12)
    home.mkdir(parents=True, exist_ok=True)
    config = home / "basic_auth.ini"
    config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = {pg.url('mlflow_auth')}\nadmin_username = {MLFLOW_ADMIN}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = base_env(
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_AUTH_CONFIG_PATH=str(config),
        MLFLOW_AUTH_ADMIN_PASSWORD=password,
        MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
    )

    def launch_at(port: int) -> tuple[list[str], dict[str, str]]:
        return (
            [
                str(BIN / "mlflow"),
                "server",
                "--app-name",
                "basic-auth",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                pg.url("mlflow"),
                "--artifacts-destination",
                str(home / "artifacts"),
            ],
            env,
        )

    with serving(launch_at, home / "mlflow.log", "/health") as (_, url):
        yield url, password


def wait_until_final(stack: TeamStack, flow_run_ids, timeout_s: float = READY_TIMEOUT_S * 4, log: Path | None = None):
    """Polls the runs until every one is final; returns them."""
    started, deadline, reported = time.monotonic(), time.monotonic() + timeout_s, 0
    with stack.prefect_client() as client:
        while True:
            runs = [client.read_flow_run(run_id) for run_id in flow_run_ids]
            final = sum(1 for run in runs if run.state and run.state.is_final())
            if final != reported:  # progress, for a long load run (pytest -s)
                print(f"[team] {final}/{len(runs)} runs final after {time.monotonic() - started:.0f} s", flush=True)
                reported = final
            if final == len(runs):
                return runs
            if time.monotonic() > deadline:
                states = sorted(str(run.state_name) for run in runs)
                raise TimeoutError(
                    f"runs not final after {timeout_s}s: {states}\n"
                    + (log.read_text()[-3000:] if log and log.exists() else "")
                )
            time.sleep(2)
