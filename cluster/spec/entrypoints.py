"""Checks a spec's entrypoints (train.loop, data.generate) in a fresh interpreter, as the job will import them.

    python -m gpuflow.cluster.spec.entrypoints WORKDIR train.loop=experiments.digits:train_loop

Importing a loop imports torch and Ray Train: seconds of CPU that the process checking a spec (`gpuflow run`,
a flow run in `gpuflow serve`) needs for nothing else. In a process of its own, the import runs beside the other
checks, and the checking process stays small. A check that passed is reused while the workdir's files that the
import read, and the folders it imported from (site-packages: an install or uninstall), are unchanged: a flow run
checks the spec that `gpuflow run` checked a second before, and a run of an unchanged loop reuses the last run's
check (kept under GPUFLOW_HOME/checks). The job imports the loop anyway: a stale pass could only move an import
error from the check to the job's start, never let a run train something else.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from gpuflow.cluster.spec.fields import cut
from gpuflow.cluster.usercode import resolve
from gpuflow.cluster.util.files import write_atomically

# How gpuflow calls each entrypoint: (positional arguments, what they are).
ENTRYPOINT_ARGUMENTS = {
    "train.loop": (1, "a Ray Train loop is `def train_loop(config: dict)`"),
    "data.generate": (2, "a data generator is `def write_parquet(train_uri, validation_uri)`"),
}
CHECK_RULES = 2  # raised when check() refuses more: a pass recorded under older rules is not reused
IMPORT_TIMEOUT_S = 300.0  # torch and Ray Train on a busy small machine take tens of seconds; a hang must not block
REPORT = "gpuflow-entrypoints "  # the report's line, apart from whatever the user's modules print

_checks: dict[tuple, EntrypointCheck] = {}
_lock = threading.Lock()


def entrypoint_check(workdir: str, entrypoints: dict[str, str]) -> EntrypointCheck:
    """The check of these entrypoints from this workdir: the one under way, or done with its files unchanged, else
    a new one. Start it early; `problems()` waits for it."""
    key = (workdir, str(Path(workdir).absolute()), tuple(sorted(entrypoints.items())))
    with _lock:
        check = _checks.get(key)
        if check is None or check.outdated():
            check = _checks[key] = EntrypointCheck(workdir, entrypoints)
        return check


class EntrypointCheck:
    def __init__(self, workdir: str, entrypoints: dict[str, str]):
        self.workdir, self.entrypoints = workdir, entrypoints
        self.found: list[str] | None = None
        # what the import read (the workdir's files, the folders it imported from), by mtime; None: never reuse
        self.files: dict[str, int] | None = {}
        self._lock = threading.Lock()
        self.record = record_of(workdir, entrypoints)
        if (passed := passed_before(self.record)) is not None:
            self.found, self.files, self.process = [], passed, None
            return
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuflow.cluster.spec.entrypoints",
                workdir,
                *(f"{field}={entrypoint}" for field, entrypoint in entrypoints.items()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def outdated(self) -> bool:
        if self.found is None:
            return False  # under way
        return self.files is None or changed(self.files)

    def problems(self) -> list[str]:
        with self._lock:
            if self.found is None:
                self.found = self._wait()
            return self.found

    def _wait(self) -> list[str]:
        try:
            out, err = self.process.communicate(timeout=IMPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return [
                f"{field}: importing {entrypoint!r} took more than {IMPORT_TIMEOUT_S:g} s; does the module do "
                "work at import time?"
                for field, entrypoint in self.entrypoints.items()
            ]
        reports = [line.removeprefix(REPORT) for line in out.splitlines() if line.startswith(REPORT)]
        if not reports:  # the import ended the interpreter: os._exit, a crash in an extension
            self.files = None
            return [
                f"{field}: importing {entrypoint!r} from workdir {self.workdir!r} ended the process "
                f"(exit code {self.process.returncode}): {err.strip()[-300:]}"
                for field, entrypoint in self.entrypoints.items()
            ]
        report = json.loads(reports[-1])
        self.files = report["files"]
        if not report["problems"]:  # a failure is checked anew each time: its message must be today's
            remember(self.record, self.files)
        return report["problems"]


def record_of(workdir: str, entrypoints: dict[str, str]) -> Path:
    """Where a passed check of these entrypoints, from this workdir with this Python, is kept."""
    from gpuflow.cluster.config import state_dir

    key = json.dumps([CHECK_RULES, sys.executable, str(Path(workdir).absolute()), sorted(entrypoints.items())])
    return state_dir() / "checks" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def passed_before(record: Path) -> dict[str, int] | None:
    """The files of a check that passed, if none of them changed since."""
    try:
        files = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return None if changed(files) else files


def remember(record: Path, files: dict[str, int]) -> None:
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(record, json.dumps(files))
    except OSError:
        pass  # a read-only home: the next run checks again


def changed(files: dict[str, int]) -> bool:
    try:
        return any(os.stat(path).st_mtime_ns != mtime for path, mtime in files.items())
    except OSError:
        return True


def check(workdir: str, field: str, entrypoint: str) -> str | None:
    try:
        function = resolve(entrypoint)
    except Exception as exc:  # any import-time error is the user's to see
        fix = "; give 'module:function' with the module's dotted path under the workdir (or an installed one)"
        return f"{field}: cannot load {entrypoint!r} from workdir {workdir!r}: {cut(str(exc), 200)}" + (
            fix if isinstance(exc, ModuleNotFoundError) else ""
        )
    arguments, what = ENTRYPOINT_ARGUMENTS[field]
    wrong = python_function_problem(function, what) or signature_problem(function, arguments, what)
    return f"{field}: {entrypoint!r} {wrong}" if wrong else None


def python_function_problem(function: Callable, what: str) -> str | None:
    """None if `function` is written in Python (a function, a method, a partial of one, an object with a Python
    __call__), else why not: a builtin (print, os.getcwd) or a class is no loop, whatever its signature says."""
    target = inspect.unwrap(function)
    if isinstance(target, functools.partial):
        target = inspect.unwrap(target.func)
    if inspect.isfunction(target) or inspect.ismethod(target):
        return None
    method = getattr(type(target), "__call__", None)  # noqa: B004 (the method itself, not whether there is one)
    if not inspect.isclass(target) and inspect.isfunction(method):
        return None
    kind = (
        "a builtin"
        if inspect.isbuiltin(target)
        else "a class"
        if inspect.isclass(target)
        else f"a {type(target).__name__} object"
    )
    return f"is {kind}, not a Python function; give 'module:function' of a function in the workdir: {what}"


def signature_problem(function: Callable, arguments: int, what: str) -> str | None:
    """None if `function` can be called with `arguments` positional arguments, else why not."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a callable object without a signature: nothing to say here
    try:
        signature.bind(*range(arguments))
    except TypeError:
        return f"takes {signature} but gpuflow calls it with {arguments} argument(s): {what}"
    return None


def main(argv: list[str]) -> int:
    workdir, *pairs = argv
    root = Path(workdir).absolute()
    sys.path[0] = str(root)  # where `python -m` put this process's folder: the job imports from its workdir
    problems = [
        problem
        for field, entrypoint in (pair.split("=", 1) for pair in pairs)
        if (problem := check(workdir, field, entrypoint))
    ]
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and Path(path).is_relative_to(root):
            files[path] = os.stat(path).st_mtime_ns
    for folder in sys.path[1:]:  # an install or uninstall changes its folder's mtime
        if os.path.isdir(folder):
            files[folder] = os.stat(folder).st_mtime_ns
    print(REPORT + json.dumps({"problems": problems, "files": files}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
