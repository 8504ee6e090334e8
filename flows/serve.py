"""Serves gpuflow's deployments (prefect.yaml) from this machine: no work pool, no worker; Ctrl-C stops it.

    gpuflow serve                                  # run-experiment, nightly-digits and reap-clusters
    gpuflow serve --only run-experiment --set tracking.uri=http://127.0.0.1:5000 --limit 1
"""

from __future__ import annotations

import json
import os

from prefect import serve as prefect_serve

from gpuflow.flows.deploy import runner_deployments
from gpuflow.cluster.protocol import SERVE_OVERRIDES_ENV


def serve(overrides: list[str] = (), only: list[str] = (), limit: int | None = 1) -> None:
    """Blocks, polling the Prefect server (PREFECT_API_URL) for runs of these deployments, scheduled or from the UI."""
    deployments = runner_deployments(overrides, only)
    # The runs this process starts inherit it: a form_policy compares a run with the spec as served here.
    os.environ[SERVE_OVERRIDES_ENV] = json.dumps(list(overrides))
    # limit=1 by default: two experiments at once would fight over the same machine's CPUs.
    prefect_serve(*deployments, limit=limit)


if __name__ == "__main__":
    serve()
