"""The pull step of gpuflow's deployments: a worker on any machine runs the project's code at the deployed commit.

    prefect.yaml, pull:  git_clone of the project's remote at the commit `gpuflow deploy` ran at (Prefect's step),
                         then gpuflow.flows.pull.install_checkout: the checkout installed into the worker's Python

A process worker runs each flow run in a fresh Python process, which runs the pull steps and only then imports the
flow, so the code it imports is the checkout's. A plain install, not an editable one: an editable install takes
effect only in processes started after it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def install_checkout(directory: str) -> dict:
    """Installs the cloned project into this Python: a package (pyproject.toml, setup.py) with its dependencies, or
    a requirements.txt; a folder of plain files needs nothing."""
    folder = Path(directory).resolve()  # absolute: pip reads a bare name ("remote") as a package to download
    if (folder / "pyproject.toml").is_file() or (folder / "setup.py").is_file():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(folder)]
    elif (folder / "requirements.txt").is_file():
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
            str(folder / "requirements.txt"),
        ]
    else:
        return {"installed": None}
    print(f"gpuflow: installing the checkout at {folder} ({' '.join(command[3:])})", flush=True)
    subprocess.run(command, check=True)
    return {"installed": str(folder)}
