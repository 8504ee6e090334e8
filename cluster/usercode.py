"""Importing the user's code: a 'module:function' entrypoint, with the workdir first on sys.path.

Shared by the spec's checks, the data staging and the job: each imports the user's loop or data generator as the
job on the cluster will.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path


def resolve(entrypoint: str):
    module_name, function_name = entrypoint.split(":")
    module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise AttributeError(f"module {module_name!r} has no function {function_name!r}")
    return function


class on_sys_path:
    """Puts the workdir first on sys.path while user code is imported."""

    def __init__(self, folder: str):
        self.folder = str(Path(folder).absolute())

    def __enter__(self):
        sys.path.insert(0, self.folder)

    def __exit__(self, *exc):
        sys.path.remove(self.folder)


def module_file(workdir: str, module_name: str) -> Path | None:
    """The source file of a module, found as the job imports it: in the workdir first, else on sys.path."""
    base = Path(workdir).absolute().joinpath(*module_name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    import importlib.util

    try:
        with on_sys_path(workdir):
            found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found and found.origin and Path(found.origin).is_file() else None


def loop_digest(workdir: str, entrypoint: str) -> str:
    """A short sha256 of the loop's source file: runs of the same loop share it, an edited loop gets another.
    A loop whose file is not found is known by its entrypoint's name alone."""
    path = module_file(workdir, entrypoint.split(":")[0])
    content = path.read_bytes() if path else f"entrypoint {entrypoint}".encode()
    return hashlib.sha256(content).hexdigest()[:12]
