"""Paste into tests/conftest.py (or import from it) to get the `slurm_infra` fixture.

    @pytest.mark.slurm
    def test_remote_run(slurm_infra):
        r = subprocess.run(["gpuflow", "run", ..., "--infra", slurm_infra.infra],
                           env=slurm_infra.subprocess_env(slurm_infra.node_task_envs), ...)
        assert harness.slurm_jobs(user=slurm_infra.ssh_user) == []
        assert harness.sky_clusters(slurm_infra) == []

The `slurm` marker is already declared in pyproject.toml ([tool.pytest.ini_options]
markers); pytest_configure below adds it too, so the snippet also works on its own.
Select / deselect with `pytest -m slurm` / `pytest -m "not slurm"`.
Environment knobs: GPUFLOW_SLURM_BASE (state dir, default /tmp/gpuflow-slurm),
GPUFLOW_SLURM_KEEP=1 (leave the cluster running after the session, for reruns),
GPUFLOW_SLURM_NODE_VENV=1 (prebuild $BASE/nodeenv with ray[train]+torch, see NOTES.md).
"""
import os

import pytest

from tests.infra.slurm import harness  # needs tests/__init__.py + tests/infra/(slurm/)__init__.py


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs the local Slurm + SkyPilot harness (tests/infra)")


@pytest.fixture(scope="session")
def slurm_infra():
    ok, why = harness.available()
    if not ok:
        pytest.skip(f"local Slurm harness unavailable: {why}")
    try:
        infra = harness.start()
        if os.environ.get("GPUFLOW_SLURM_NODE_VENV") == "1" and not infra.node_venv:
            path, _ = harness.build_node_venv(["torch==2.13.0+cpu", "ray[train]==2.60.0"])
            infra.node_venv = path
            infra.env["GPUFLOW_NODE_VENV"] = path
        yield infra
    finally:
        # runs on failures and on KeyboardInterrupt during the session too
        if os.environ.get("GPUFLOW_SLURM_KEEP") != "1":
            print(harness.stop())
