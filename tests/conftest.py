"""Shared fixtures: an isolated gpuflow state folder per test, one real Prefect test server per session,
a real MLflow tracking server and the local Slurm cluster (tests/infra/slurm) for the `slurm` tests.

The tiers (`pytest`, `pytest --full`) and the end-of-session checks are in tests/support/tiers.py (tests/README.md).
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.repo import REPO
from tests.support.stores import STORES, seed_mlflow_store

pytest_plugins = [
    "pytester"
]  # tests.support.tiers and tests.support.cpu_report come in through addopts (pyproject.toml)

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A run leaves no warm stack behind in tests (tests/test_stack.py turns that on where it tests it): each test's
# processes are its own, and stop with it.
os.environ.setdefault("GPUFLOW_STACK", "manual")
# Nor is a run reused for another's work key (cluster/rerun/reuse.py): a test's second run trains, as it always did,
# unless the test is about reuse.
os.environ.setdefault("GPUFLOW_REUSE", "never")
# Nor does a command start a reaper pass of its own on the tests' Prefect servers (flows/reconcile/overdue.py): a pass
# in the background would end other tests' runs made dead on purpose; tests/test_reaper.py turns it on to test it.
os.environ.setdefault("GPUFLOW_OVERDUE_PASS", "never")


def pytest_configure(config):
    """Outside any test (session fixtures, servers) gpuflow's state goes to a temp folder too, never the repo."""
    if not hasattr(config, "workerinput"):  # the first process: pytest-xdist's workers inherit what it sets
        config._session_folders = []
        if "GPUFLOW_HOME" not in os.environ:
            os.environ["GPUFLOW_HOME"] = tempfile.mkdtemp(prefix="gpuflow-tests-home-")
            config._session_folders.append(os.environ["GPUFLOW_HOME"])
        if SESSION_CHECKS not in os.environ:  # else an outer session's (a pytest session run by a test)
            os.environ[SESSION_CHECKS] = tempfile.mkdtemp(prefix="gpuflow-tests-checks-")
            config._session_folders.append(os.environ[SESSION_CHECKS])
        if STORES not in os.environ:
            os.environ[STORES] = tempfile.mkdtemp(prefix="gpuflow-tests-stores-")
            config._session_folders.append(os.environ[STORES])


def pytest_unconfigure(config):
    for folder in getattr(config, "_session_folders", []):
        shutil.rmtree(folder, ignore_errors=True)


SESSION_CHECKS = "GPUFLOW_TESTS_LOOP_CHECKS"  # the session's folder of passed loop checks (see gpuflow_home)


@pytest.fixture(autouse=True)
def gpuflow_home(tmp_path, monkeypatch) -> Path:
    """GPUFLOW_HOME in a temp folder, for every test: MLflow store, checkpoints, cluster records of this test only.
    Its record of passed loop checks is the session's: a record names the loop's files and their times, so a run
    reuses only a check of the same, unchanged loop (as a user's second run does), and each check is a process of a
    few CPU-seconds. Its MLflow store starts migrated (tests/support/stores.py)."""
    home = tmp_path / "gpuflow-home"
    home.mkdir()
    seed_mlflow_store(home / "mlflow.db")
    (home / "checks").symlink_to(os.environ[SESSION_CHECKS], target_is_directory=True)
    monkeypatch.setenv("GPUFLOW_HOME", str(home))
    return home


@pytest.fixture
def digits_spec(gpuflow_home):
    """The shipped digits spec, its data and state redirected under the test's GPUFLOW_HOME."""
    from gpuflow.cluster.spec import load_spec

    return load_spec(
        REPO / "experiments" / "digits.yaml",
        [
            f"workdir={REPO}",
            f"data.train={gpuflow_home}/data/train.parquet",
            f"data.validation={gpuflow_home}/data/validation.parquet",
        ],
    )


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect API (temporary server and database) for every flow run of the session. Its concurrency leases
    are kept on disk as gpuflow's own servers keep them, in a Prefect home of the session's: never in a folder that
    another server's lease expiry would read (the user's ~/.prefect)."""
    from prefect.settings import (
        PREFECT_HOME,
        PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE,
        get_current_settings,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    from gpuflow.flows.local_stack.temporary_api import FILESYSTEM_LEASES, LEASE_STORAGE

    leases = {PREFECT_HOME: tmp_path_factory.mktemp("prefect-home")}
    if LEASE_STORAGE not in get_current_settings().to_environment_variables(exclude_unset=True):  # else the user's
        leases[PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE] = FILESYSTEM_LEASES
    with temporary_settings(leases), prefect_test_harness(server_startup_timeout=120):
        yield


# -- real servers for the deployment, tracking-server and browser tests (tests/support/servers.py) ------------------
@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> str:
    """`prefect server start` on a free 127.0.0.1 port; its API URL (the UI is at the same origin)."""
    from tests.support.servers import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as api_url:
        yield api_url


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory) -> str:
    """`mlflow server` with proxied artifacts on a free 127.0.0.1 port."""
    from tests.support.servers import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


@pytest.fixture(scope="session")
def served(prefect_api, mlflow_url, tmp_path_factory):
    """`gpuflow serve` of prefect.yaml's deployments, tracking to the MLflow server, state in a temp folder."""
    from tests.support.servers import ServedDeployments, gpuflow_serve

    home = tmp_path_factory.mktemp("served-home")
    with gpuflow_serve(prefect_api, home, served_overrides(mlflow_url, home), ("run-experiment", "nightly-digits")):
        yield ServedDeployments(prefect_api, mlflow_url, home)


def served_overrides(mlflow_url: str, home: Path) -> list[str]:
    return [
        f"tracking.uri={mlflow_url}",
        f"workdir={REPO}",
        f"data.train={home}/data/train.parquet",
        f"data.validation={home}/data/validation.parquet",
    ]


@pytest.fixture(scope="session")
def second_serve_stopped(served, tmp_path_factory) -> str:
    """Another machine's `gpuflow serve` of nightly-digits (the same overrides), started and then stopped: its log."""
    from tests.support.servers import gpuflow_serve

    home = tmp_path_factory.mktemp("second-serve")
    # its shutdown waits two of its poll intervals for another serve's poll: 10 s against the session serve's 1 s, so
    # that a busy machine's slow poll is not taken for no serve at all; more than the usual grace to stop
    with gpuflow_serve(
        served.api_url,
        home,
        served_overrides(served.mlflow_url, served.home),
        ("nightly-digits",),
        only=True,
        stop_grace_s=90,
        poll_s=5,
    ):
        # the session's serve registered nightly-digits already: wait for this one's own start, then its first poll
        deadline = time.monotonic() + 240
        while "being served" not in (home / "serve.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
    return (home / "serve.log").read_text()


@pytest.fixture(scope="session")
def scheduled_run(served, second_serve_stopped):
    """The flow run that a schedule one minute away makes of nightly-digits (2 epochs), once it has ended: after
    a second serve of it has stopped, so the run shows that its schedule still fires."""
    from tests.support.servers import run_on_a_schedule_a_minute_away

    return run_on_a_schedule_a_minute_away(served, "nightly-digits", overrides={"epochs": 2})


@pytest.fixture(scope="session")
def tracked_sweep(prefect_server, mlflow_url, tmp_path_factory):
    """One sweep (`tests/test_sweep.py`'s 2 × 2 grid with early stopping) tracked on the session's MLflow server,
    in a gpuflow home of its own: read by test_sweep.py and by the browser's sweep test. A sweep is minutes of CPU."""
    from types import SimpleNamespace

    from gpuflow.cluster.spec import parse_spec
    from gpuflow.flows.experiment import run_experiment
    from tests.test_sweep import tunable_sweep

    home = tmp_path_factory.mktemp("sweep") / "gpuflow-home"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPUFLOW_HOME", str(home))
        spec = parse_spec({**tunable_sweep(), "tracking": {"uri": mlflow_url}})
        started = time.monotonic()
        state = run_experiment(spec, return_state=True)
        print(f"sweep of 4 trials: {time.monotonic() - started:.1f}s")
    return SimpleNamespace(spec=spec, state=state, home=home)


@pytest.fixture(scope="session")
def slurm_infra():
    """A one-node Slurm cluster on 127.0.0.1 that SkyPilot launches onto (infra slurm/skyci); see tests/infra/slurm.

    Skips, saying why, where it cannot run (not root, not Debian, no mirror); in CI (CI set) it fails instead,
    so that the real-cluster tests can never silently stop running there. GPUFLOW_SLURM_KEEP=1 leaves it up.
    """
    from tests.infra.slurm import harness
    from tests.support.tiers import require

    ok, why = harness.available()
    require(ok, f"the local Slurm harness ({why})", "run as root on Debian with its package mirror (tests/infra/slurm)")
    try:
        yield harness.start()
    finally:
        # also on failures and on KeyboardInterrupt: stops the SkyPilot API server, Slurm jobs, skyci's processes
        if os.environ.get("GPUFLOW_SLURM_KEEP") != "1":
            print(harness.stop())


# The whole matrix runs in three pytest-xdist workers (`-n 3 --dist loadgroup`, pyproject's addopts), one per lane,
# each in file order, the files that start a session's server last. The two cores are the limit: a fourth lane kept
# them busier here (46 minutes, not 50) but every test's CPU rose with the contention (4,866 CPU-s, not 4,234) and CI's
# slower cores took longer, not less (57 minutes, not 55). The lanes pair tests that mostly wait with tests that
# compute; the longest lane is the suite's wall time (the end-of-run report's seconds by file balance them):
# - "slurm": the recovery tests, the deadline run on Ray, the watchdog's limits, the worker elsewhere (its own venv and
#   Prefect server), then the Slurm tier (one Slurm cluster on this machine, one harness: its launches wait on SkyPilot
#   and Slurm);
# - "faults": the team stack and its load test, the GPU quota's queue, the warm stack, the fault tests, the dead runs
#   and the chaos soak; most of them wait for a signal, a lease or a cleanup (an epoch a second);
# - "main": everything else, the worker in a fresh venv included.
LANES = {
    "slurm": (
        "tests/infra/slurm/",
        "tests/test_slurm.py",
        "tests/test_recovery.py",
        "tests/test_deadline_on_ray.py",
        "tests/test_watchdog.py",
        "tests/test_workers.py",
    ),
    "faults": (
        "tests/test_team_stack.py",
        "tests/test_quota.py",
        "tests/test_stack.py",
        "tests/test_faults.py",
        "tests/test_dead_runs.py",
        "tests/test_chaos.py",
    ),
}


def lane_of(nodeid: str) -> str:
    return next((lane for lane, paths in LANES.items() if nodeid.startswith(paths)), "main")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    if not config.getoption("full"):  # the quick tier: files go to the workers as they free up, each whole
        for item in items:  # (a module's shared run happens once)
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(lane_of(item.nodeid)))
    # A session's server lives from its first test to the session's end: in each lane, the files that start one go
    # last (whole, so that a module's own fixtures start once), and it idles through no other file.
    late = {module_of(item) for item in items if SESSION_SERVERS & set(item.fixturenames)}
    items.sort(key=lambda item: module_of(item) in late)


SESSION_SERVERS = {"slurm_infra", "prefect_api", "mlflow_url", "served"}  # not prefect_server: nearly all use it


def module_of(item) -> str:
    return item.nodeid.split("::")[0]
