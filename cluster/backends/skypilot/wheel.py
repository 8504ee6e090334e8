"""Packs the gpuflow that runs here into a wheel, so that a cloud node installs this very version, no index needed.

    python -m gpuflow.cluster.backends.skypilot.wheel /tmp/wheels      # prints the wheel's path

It zips the imported packages' own files (editable install or not) with the installed distribution's
metadata: no build backend, no network, the same bytes for the same sources.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import sys
import zipfile
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "gpuflow"
PACKAGES = ("gpuflow.flows", "gpuflow.tasks", "gpuflow.cluster")  # the packages of pyproject.toml, subpackages included
FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # zip entries' timestamps: the same sources give the same wheel
WHEEL_INFO = (
    "Wheel-Version: 1.0\nGenerator: gpuflow.cluster.backends.skypilot.wheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
)


def version() -> str:
    return metadata.version(DISTRIBUTION)


def wheel_name() -> str:
    return f"{DISTRIBUTION}-{version()}-py3-none-any.whl"


def package_files() -> list[tuple[str, Path]]:
    """(path inside the wheel, file here) for every source file of gpuflow's packages."""
    files = []
    for package in PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" not in path.parts:
                files.append((f"{package.replace('.', '/')}/{path.relative_to(folder).as_posix()}", path))
    return files


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder: str | Path) -> Path:
    """Writes gpuflow-<version>-py3-none-any.whl into folder (rewritten each call) and returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    distribution = metadata.distribution(DISTRIBUTION)
    info = f"{DISTRIBUTION}-{version()}.dist-info"
    contents = [(name, path.read_bytes()) for name, path in package_files()]
    # an editable install's source folder may hold an egg-info, whose PKG-INFO is the same metadata
    core_metadata = distribution.read_text("METADATA") or distribution.read_text("PKG-INFO")
    contents.append((f"{info}/METADATA", core_metadata.encode()))
    if distribution.read_text("entry_points.txt"):
        contents.append((f"{info}/entry_points.txt", distribution.read_text("entry_points.txt").encode()))
    contents.append((f"{info}/WHEEL", WHEEL_INFO.encode()))
    records = [record_line(name, data) for name, data in contents] + [f"{info}/RECORD,,"]
    contents.append((f"{info}/RECORD", ("\n".join(records) + "\n").encode()))

    path = folder / wheel_name()
    partial = path.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in contents:
            wheel.writestr(zipfile.ZipInfo(name, FIXED_TIME), data, zipfile.ZIP_DEFLATED)
    partial.replace(path)  # another run reading the old wheel never sees half a file
    return path


if __name__ == "__main__":
    print(build_wheel(sys.argv[1] if len(sys.argv) > 1 else "."))
