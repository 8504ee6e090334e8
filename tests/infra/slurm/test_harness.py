"""Checks of the harness itself (cheap: no sky.launch). Run: pytest --full -m slurm tests/infra/slurm"""

import subprocess

import pytest

from tests.infra.slurm import harness

pytestmark = pytest.mark.slurm


def test_slurm_up_and_empty(slurm_infra):
    assert slurm_infra.infra == "slurm/skyci"
    assert slurm_infra.env["HOME"].endswith("/clienthome")
    assert harness.slurm_jobs() == []


def test_sky_sees_slurm_and_no_clusters(slurm_infra):
    r = subprocess.run(
        ["sky", "check", "slurm"], env=slurm_infra.subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert "skyci" in r.stdout and "enabled" in r.stdout.lower(), r.stdout + r.stderr
    assert harness.sky_clusters(slurm_infra) == []
