"""The chaos soak (benchmarks/chaos.py) in the whole matrix: 8 tiny runs, two at a time, half through `gpuflow run`
and half through `gpuflow serve`, each struck at a random moment by a fault of the table (seed 48 draws seven of its
eight kinds), then one reaper pass; every run must end true in all five of its records (issue #38): flow run final,
no MLflow run RUNNING, no cluster nor process left, no quota slot held, one message per bad end.

    .venv/bin/python -m pytest --full tests/test_chaos.py -s
"""

import pytest

from benchmarks.chaos import soak

pytestmark = pytest.mark.full

SEED = 48  # prefect-restart, cancel, kill-9-raylet, mlflow-restart, kill-9-flow, kill-9-raylet, sigterm-run, none


def test_every_run_ends_true_whatever_dies(tmp_path):
    result = soak(runs=8, seed=SEED, overlap=2, converge_bound_s=60, root=tmp_path / "chaos")
    print(result.report())
    assert result.passed, "\n" + result.report()
