"""The house rules, checked on the source: no import circles inside gpuflow, nothing in cluster/ that imports
Prefect, every GPUFLOW_* variable read in the settings or the contract module only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.repo import REPO

PACKAGES = {"gpuflow.cluster": REPO / "cluster", "gpuflow.flows": REPO / "flows", "gpuflow.tasks": REPO / "tasks"}
SETTINGS_AND_CONTRACT = {"gpuflow.cluster.config", "gpuflow.cluster.protocol"}


def modules() -> dict[str, Path]:
    """Every module of gpuflow by its dotted name (a package by its __init__)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "templates" in path.relative_to(folder).parts:  # files `gpuflow init` writes, not gpuflow's modules
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The gpuflow modules `path` imports, at the top or inside a function (a lazy import still makes a circle)."""
    found = set()
    tree = ast.parse(path.read_text())
    for block in ast.walk(tree):  # imports for type checkers only never run
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules importing themselves."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def test_no_import_circles_inside_gpuflow():
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_in_cluster_imports_prefect():
    offenders = []
    for path in PACKAGES["gpuflow.cluster"].rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "prefect"]
    assert offenders == []


GPUFLOW_READ = re.compile(r"""(?:environ\.get|environ\[|getenv|environ\.pop)\(?\s*["'](GPUFLOW_\w+)""")


def test_gpuflow_settings_are_read_in_the_settings_or_the_contract_module_only():
    known = modules()
    reads = [f"{path.relative_to(REPO)}: {name}" for module, path in known.items() if module not in SETTINGS_AND_CONTRACT
             for name in GPUFLOW_READ.findall(path.read_text())]
    assert reads == []


def test_the_settings_check_finds_a_read():
    assert GPUFLOW_READ.findall('x = os.environ.get("GPUFLOW_HOME", ".")\ny = os.environ["GPUFLOW_STACK"]') == [
        "GPUFLOW_HOME", "GPUFLOW_STACK"]


def test_no_module_over_300_lines():
    long = {str(path.relative_to(REPO)): n for path in modules().values()
            if (n := len(path.read_text().splitlines())) > 300}
    assert long == {}


def test_tasks_holds_only_tasks():
    """Each module of tasks/ is Prefect tasks: steps of the flow, each with its retries; helpers live elsewhere."""
    without = [path.name for path in PACKAGES["gpuflow.tasks"].glob("*.py")
               if path.name != "__init__.py" and "@task(" not in path.read_text()]
    assert without == []
