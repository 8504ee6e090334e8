"""Importing the user's code: a 'module:function' entrypoint, with the workdir first on sys.path.

Shared by the spec's checks, the data staging and the job: each imports the user's loop or data generator as the
job on the cluster will.
"""

from __future__ import annotations

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
