"""The house rules, checked on the source: no import circles inside gpuflow, nothing in cluster/ that imports
Prefect, every GPUFLOW_* variable read in the settings or the contract module only (however spelled), MLflow tags
named in the contract module only, at most 12 modules a folder, flows/ in rooms (no arrow back up, at most 5
floors), the flow's functions of at most 4 parameters, no print-function sinks in cluster/, a README under 400
lines, ruff's lint and format clean, every test the README's fault table names collected by the whole matrix, one
place deciding that a run is dead. Each check has a companion test that shows it catching a deliberate offence."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
    return imports_in(path.read_text(), known)


def imports_in(source: str, known) -> set[str]:
    """The modules of `known` that `source` imports, lazily or not; imports for type checkers only never run."""
    found = set()
    tree = ast.parse(source)
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                for alias in node.names
            ]
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
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in names if name.split(".")[0] == "prefect"]
    assert offenders == []


GPUFLOW_READ = re.compile(r"""(?:environ\.get|environ\[|getenv|environ\.pop)\(?\s*["'](GPUFLOW_\w+)""")


def test_gpuflow_settings_are_read_in_the_settings_or_the_contract_module_only():
    known = modules()
    reads = [
        f"{path.relative_to(REPO)}: {name}"
        for module, path in known.items()
        if module not in SETTINGS_AND_CONTRACT
        for name in GPUFLOW_READ.findall(path.read_text())
    ]
    assert reads == []


def test_the_settings_check_finds_a_read():
    assert GPUFLOW_READ.findall('x = os.environ.get("GPUFLOW_HOME", ".")\ny = os.environ["GPUFLOW_STACK"]') == [
        "GPUFLOW_HOME",
        "GPUFLOW_STACK",
    ]


def test_no_module_over_300_lines():
    long = {
        str(path.relative_to(REPO)): n for path in modules().values() if (n := len(path.read_text().splitlines())) > 300
    }
    assert long == {}


def test_every_package_is_installed():
    """pyproject.toml lists gpuflow's packages by name (its folders install under gpuflow.): one missing from the list
    imports in an editable install and fails in a user's `pip install /path/to/gpuflow`."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {name for name, path in modules().items() if path.name == "__init__.py"} - listed == set()


def test_tasks_holds_only_tasks():
    """Each module of tasks/ is Prefect tasks: steps of the flow, each with its retries; helpers live elsewhere."""
    without = [
        path.name
        for path in PACKAGES["gpuflow.tasks"].glob("*.py")
        if path.name != "__init__.py" and "@task(" not in path.read_text()
    ]
    assert without == []


# -- folders of at most 12 modules -------------------------------------------------------------------------------------
MODULES_PER_FOLDER = 12  # .py files in the folder itself, __init__.py not counted (it is the package, not a part)


def crowded_folders(roots: list[Path], limit: int = MODULES_PER_FOLDER) -> dict[str, int]:
    """Folders under `roots` (each root included) holding more than `limit` modules; `gpuflow init`'s templates
    are files it writes, not modules."""
    crowded = {}
    for root in roots:
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            if {"templates", "__pycache__"} & set(folder.relative_to(root).parts):
                continue
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > limit:
                crowded[str(folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder)] = count
    return crowded


def test_no_folder_holds_more_than_12_modules():
    assert crowded_folders(list(PACKAGES.values())) == {}


def test_the_folder_check_finds_a_crowded_folder(tmp_path):
    (tmp_path / "room" / "templates").mkdir(parents=True)
    for n in range(13):
        (tmp_path / "room" / f"part{n}.py").write_text("")
        (tmp_path / "room" / "templates" / f"t{n}.py").write_text("")
    (tmp_path / "room" / "__init__.py").write_text("")
    (tmp_path / "fine").mkdir()
    for n in range(12):
        (tmp_path / "fine" / f"part{n}.py").write_text("")
    assert crowded_folders([tmp_path]) == {str(tmp_path / "room"): 13}


# -- GPUFLOW_* read through os.environ or getenv, however spelled --------------------------------------------------
def sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in modules().items()}


def gpuflow_constants(modules_source: dict[str, str]) -> dict[str, set[str]]:
    """module → its module-level names bound to a string starting with GPUFLOW_ (`HOME_ENV = "GPUFLOW_HOME"`)."""
    found = {}
    for module, source in modules_source.items():
        for node in ast.parse(source).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            value = getattr(node, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value.startswith("GPUFLOW_"):
                found.setdefault(module, set()).update(t.id for t in targets if isinstance(t, ast.Name))
    return found


def is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ` (from os import environ): the process's own environment, not a child's dict."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def environ_keys_read(tree: ast.AST) -> list[ast.AST]:
    """The key expressions of every read of the process's environment: os.environ.get/pop/setdefault(k),
    os.environ[k], `k in os.environ`, os.getenv(k) / getenv(k)."""
    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and is_environ(func.value):
                keys.append(node.args[0])
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                isinstance(func, ast.Name) and func.id == "getenv"
            ):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            keys.append(node.slice)
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and any(is_environ(c) for c in node.comparators)
        ):
            keys.append(node.left)
    return keys


def gpuflow_env_reads(modules_source: dict[str, str], allowed: set[str] = SETTINGS_AND_CONTRACT) -> list[str]:
    """'module: key' for each read of a GPUFLOW_* variable outside `allowed`: a literal, an f-string starting with
    GPUFLOW_, or a name bound to such a constant (in the module itself, imported from another, or module.NAME)."""
    constants = gpuflow_constants(modules_source)
    every_name = set().union(*constants.values()) if constants else set()
    reads = []
    for module, source in modules_source.items():
        if module in allowed:
            continue
        tree = ast.parse(source)
        names = set(constants.get(module, set()))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in constants:
                names |= {alias.asname or alias.name for alias in node.names if alias.name in constants[node.module]}
        for key in environ_keys_read(tree):
            literal = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
            if isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
                literal = str(key.values[0].value)
            if (
                (literal and literal.startswith("GPUFLOW_"))
                or (isinstance(key, ast.Name) and key.id in names)
                or (isinstance(key, ast.Attribute) and key.attr in every_name)
            ):
                reads.append(f"{module}: {ast.unparse(key)}")
    return reads


def test_gpuflow_variables_are_read_in_the_settings_or_the_contract_module_only_however_spelled():
    assert gpuflow_env_reads(sources()) == []


def test_the_settings_check_finds_reads_however_spelled():
    contract = 'HOME_ENV = "GPUFLOW_HOME"\nSTACK = "GPUFLOW_STACK"\nOTHER = "PATH"\n'
    reader = """
import os
from os import environ, getenv
from gpuflow.cluster.protocol import HOME_ENV, STACK as S, OTHER
from gpuflow.cluster import protocol
LOCAL = "GPUFLOW_LOCAL"
a = os.environ.get(HOME_ENV)
b = os.getenv(S)
c = environ.get(f"GPUFLOW_{a}")
d = os.environ[protocol.STACK]
e = getenv(LOCAL, "x")
f = "GPUFLOW_DEBUG" in os.environ
g = os.environ.get(OTHER)                    # not GPUFLOW_
env = {**os.environ, HOME_ENV: "/tmp"}       # an environment built for a child: writing, not reading
h = env.get(HOME_ENV)
"""
    assert gpuflow_env_reads({"gpuflow.cluster.protocol": contract, "gpuflow.flows.reader": reader}) == [
        "gpuflow.flows.reader: HOME_ENV",
        "gpuflow.flows.reader: S",
        "gpuflow.flows.reader: f'GPUFLOW_{a}'",
        "gpuflow.flows.reader: protocol.STACK",
        "gpuflow.flows.reader: LOCAL",
        "gpuflow.flows.reader: 'GPUFLOW_DEBUG'",
    ]


# -- the README stays short ----------------------------------------------------------------------------------------
README_LINES = 400


def over_length(text: str, limit: int = README_LINES) -> int:
    """How many lines `text` has beyond what it may have (limit - 1: under `limit`), 0 if none."""
    return max(0, len(text.splitlines()) - (limit - 1))


def test_the_readme_is_under_400_lines():
    assert over_length((REPO / "README.md").read_text()) == 0


def test_the_readme_check_finds_a_long_readme():
    assert over_length("line\n" * 400) == 1 and over_length("line\n" * 399) == 0


# -- MLflow tags named in the contract module only -----------------------------------------------------------------
TAGS_HOME = "gpuflow.cluster.protocol"
MODULE_NAME = re.compile(r"gpuflow\.(cluster|flows|tasks)(\.[a-z_]\w*)*$")


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string statements (docstrings, and strings standing alone as comments)."""
    return {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def tag_literals(modules_source: dict[str, str], home: str = TAGS_HOME) -> list[str]:
    """'module: string' for each string (or f-string) starting with "gpuflow." outside the contract module, but for
    module names (gpuflow.cluster..., gpuflow.flows..., gpuflow.tasks..., to import or run), logger names
    (getLogger's argument) and docstrings."""
    found = []
    for module, source in modules_source.items():
        if module == home:
            continue
        tree = ast.parse(source)
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                getattr(node.func, "attr", None) == "getLogger" or getattr(node.func, "id", None) == "getLogger"
            ):
                skip |= {id(arg) for arg in node.args}
                skip |= {id(part) for arg in node.args for part in ast.walk(arg)}
            if isinstance(node, ast.JoinedStr):
                skip |= {id(part) for part in node.values}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                text = str(node.values[0].value)
            else:
                continue
            if text.startswith("gpuflow.") and not MODULE_NAME.match(re.split(r"[\s:]", text, maxsplit=1)[0]):
                found.append(f"{module}: {ast.unparse(node)}")
    return found


def test_mlflow_tags_are_named_in_the_contract_module_only():
    assert tag_literals(sources()) == []


def test_the_tag_check_finds_a_tag_outside_the_contract():
    source = '''"""gpuflow.closed_by in a docstring is prose."""
import logging
log = logging.getLogger("gpuflow.reaper")
RUN = "gpuflow.flows.experiment:run_experiment"
MODULE = "gpuflow.cluster.job.sweep"
TAG = "gpuflow.closed_by"
def tags(key):
    return {f"gpuflow.launched.{key}": 1}
'''
    assert tag_literals({"gpuflow.flows.reaper": source, TAGS_HOME: 'TAG = "gpuflow.closed_by"'}) == [
        "gpuflow.flows.reaper: 'gpuflow.closed_by'",
        "gpuflow.flows.reaper: f'gpuflow.launched.{key}'",
    ]


# -- flows/ as rooms: no arrow back up, at most 5 floors -----------------------------------------------------------
FLOORS = 5


def room_of(module: str) -> str | None:
    """flows/'s room of a module: its top-level module or subpackage (gpuflow.flows.cli.run → cli); the package's
    own __init__ is the room `flows`. None outside flows/."""
    parts = module.split(".")
    if parts[:2] != ["gpuflow", "flows"]:
        return None
    return parts[2] if len(parts) > 2 else "flows"


def room_graph(modules_source: dict[str, str]) -> dict[str, set[str]]:
    """room → the rooms it imports (lazy imports too, TYPE_CHECKING blocks not; cluster/ and tasks/ left out)."""
    graph: dict[str, set[str]] = {}
    known = set(modules_source)
    for module, source in modules_source.items():
        room = room_of(module)
        if room is None:
            continue
        graph.setdefault(room, set())
        graph[room] |= {other for name in imports_in(source, known) if (other := room_of(name)) and other != room}
    return graph


def floors(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports (a simple path) through the rooms."""
    best: list[str] = []

    def walk(path: list[str]):
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        for other in sorted(graph.get(path[-1], ())):
            if other not in path:
                walk(path + [other])

    for room in sorted(graph):
        walk([room])
    return best


def test_no_import_points_back_up_between_the_rooms_of_flows():
    assert circles(room_graph(sources())) == []


def test_the_rooms_of_flows_stand_at_most_5_floors_high():
    assert len(floors(room_graph(sources()))) <= FLOORS, floors(room_graph(sources()))


def test_the_room_checks_find_an_arrow_back_up_and_a_tower():
    rooms = {
        "gpuflow.flows.cli.run": "from gpuflow.flows import experiment\nfrom gpuflow.cluster import spec",
        "gpuflow.flows.experiment": "def f():\n    from gpuflow.flows.cli import run  # lazy: still an arrow\n",
        "gpuflow.flows.run_messages": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuflow.flows import experiment"
        ),
        "gpuflow.flows.cli": "",
        "gpuflow.cluster.spec": "",
    }
    graph = room_graph(rooms)
    assert graph == {"cli": {"experiment"}, "experiment": {"cli"}, "run_messages": set()}
    assert circles(graph) == [["cli", "experiment"]]
    tower = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"e"}, "e": {"f"}, "f": set(), "g": {"f"}}
    assert floors(tower) == ["a", "b", "c", "d", "e", "f"]


# -- the flow's own functions take at most 4 parameters --------------------------------------------------------------
MAX_PARAMETERS = 4


def wide_functions(source: str, limit: int = MAX_PARAMETERS) -> dict[str, int]:
    """name → parameters, for each function (nested ones too) taking more than `limit`: positional, keyword-only,
    *args and **kwargs each count one; a method's self or cls does not."""
    wide = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        names = [p.arg for p in (*a.posonlyargs, *a.args)]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        count = len(names) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
        if count > limit:
            wide[f"{node.name}:{node.lineno}"] = count
    return wide


def test_no_function_of_the_flow_takes_more_than_4_parameters():
    wide = {
        f"{path.relative_to(REPO)}:{name}": n
        for path in sorted(PACKAGES["gpuflow.flows"].glob("*.py"))
        for name, n in wide_functions(path.read_text()).items()
    }
    assert wide == {}


def test_the_parameter_check_finds_a_wide_function():
    source = """
def hook(flow, flow_run, state):
    pass
class Watch:
    def method(self, a, b, c, d):
        def inner(a, b, *rest, key=None, **more):
            pass
async def wide(a, b, c, d, e):
    pass
"""
    assert wide_functions(source) == {"inner:6": 5, "wide:8": 5}


# -- no print-function sinks in cluster/ -----------------------------------------------------------------------------
PRINT_SINK = re.compile(r"Callable\[\[str\],\s*None\]")


def print_sinks(source: str) -> list[str]:
    """'function(parameter)' for each parameter annotated Callable[[str], None] (a print-function sink; cluster/
    logs to its module's logger instead), however qualified, quoted or made optional."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
            if p is None or p.annotation is None:
                continue
            text = p.annotation.value if isinstance(p.annotation, ast.Constant) else ast.unparse(p.annotation)
            if isinstance(text, str) and PRINT_SINK.search(text):
                found.append(f"{getattr(node, 'name', 'lambda')}({p.arg})")
    return found


def test_nothing_in_cluster_takes_a_print_function():
    sinks = [
        f"{path.relative_to(REPO)}: {sink}"
        for path in sorted(PACKAGES["gpuflow.cluster"].rglob("*.py"))
        for sink in print_sinks(path.read_text())
    ]
    assert sinks == []


def test_the_sink_check_finds_a_print_function():
    source = """
from typing import Callable, Optional
import typing
def launch(spec, say: Callable[[str], None] = print, *, log: "Callable[[str], None]" = print):
    pass
def wait(out: typing.Optional[typing.Callable[[str], None]] = None, done: Callable[[], None] = None):
    pass
def fine(write: Callable[[str], int]):
    pass
"""
    assert print_sinks(source) == ["launch(say)", "launch(log)", "wait(out)"]


# -- ruff: lint and format clean ---------------------------------------------------------------------------------------
LINTED = ("flows", "tasks", "cluster", "tests", "benchmarks", "experiments")  # pyproject.toml's [tool.ruff] include
RUFF_FINDING = re.compile(r"^\S+:\d+:\d+: ")  # path:line:column: what (--output-format concise)


def ruff_findings(root: Path = REPO, folders: tuple[str, ...] = LINTED) -> list[str]:
    """What `ruff check` and `ruff format --check` say of `folders` under `root` (its pyproject.toml's settings, this
    venv's ruff: the dev extra pins it), one line per finding; ruff's whole output when it fails without one."""
    found = []
    for command in (["check"], ["format", "--check"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "--output-format", "concise", "--no-cache", *folders],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [line for line in done.stdout.splitlines() if RUFF_FINDING.match(line)]
        found += lines or (
            [f"ruff {command[0]} exited {done.returncode}: {done.stdout}{done.stderr}"] if done.returncode else []
        )
    return found


def test_ruff_finds_nothing_to_lint_or_format():
    """`ruff check --fix` and `ruff format` (the venv's: pip install -e .[dev]) fix most findings."""
    findings = ruff_findings()
    assert findings == [], "\n".join(findings)


def test_the_ruff_check_finds_a_lint_and_a_format_finding(tmp_path):
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "bad.py").write_text('"""Bad."""\n\nimport os\n\nx = {\'a\':1}\n')
    (tmp_path / "flows" / "good.py").write_text('"""Fine."""\n\nx = {"a": 1}\n')
    assert ruff_findings(tmp_path, ("flows",)) == [
        "flows/bad.py:3:8: F401 [*] `os` imported but unused",
        "flows/bad.py:5:6: unformatted: File would be reformatted",
    ]


def fault_table_tests(readme: str) -> list[str]:
    """The tests each row of the README's fault table names (`file::test`), refusing a row that names none."""
    table = readme[readme.index("| fault | cluster |") :].split("\n\n", 1)[0].splitlines()[2:]
    assert len(table) >= 10
    named = []
    for row in table:
        found = re.findall(r"`(test_\w+\.py)::(test_\w+)`", row.split("|")[-2])
        assert found, f"a fault with no test named: {row.split('|')[1].strip()}"
        named += [f"tests/{file}::{test}" for file, test in found]
    return named


def not_collected_by_the_whole_matrix(names: list[str]) -> list[str]:
    """Those of `names` that `pytest --full` does not collect: a session of its own, collecting only (no addopts:
    neither the CPU report nor the workers; the tiers for --full)."""
    files = sorted({name.split("::")[0] for name in names})
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "tests.support.tiers", "--full", "--co", "-q", *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    ids = {line.split("[")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert ids, collected.stdout[-2000:] + collected.stderr[-2000:]
    return [name for name in names if name not in ids]


def test_every_fault_in_the_readme_names_tests_that_the_whole_matrix_collects():
    assert not_collected_by_the_whole_matrix(fault_table_tests((REPO / "README.md").read_text())) == []


def test_the_fault_table_check_finds_a_test_that_is_not_there():
    readme = "| fault | cluster |\n| --- | --- |\n" + "| a fault | `test_faults.py::test_no_such_fault` |\n" * 10
    assert (
        not_collected_by_the_whole_matrix(fault_table_tests(readme))
        == ["tests/test_faults.py::test_no_such_fault"] * 10
    )


# -- one place decides that a run is dead (docs/verdicts.md) -----------------------------------------------------------
# The facts a run's death is read from, and the modules that may name them: those that decide (the lease's `stale`,
# liveness's `silent_death` and `beating`), the contract that names the tags, and readers that only show them or wait
# on them. Any other module that names one decides by itself.
VERDICT_FACTS = {
    "RENEWED_TAG": {"cluster/run/lease.py", "cluster/protocol.py", "flows/cli/status.py"},  # status shows its time
    "GRACE_TAG": {"cluster/run/lease.py", "cluster/protocol.py", "flows/cli/status.py"},
    "HEARTBEAT_LATE_S": {"cluster/run/liveness.py", "benchmarks/chaos.py"},  # the soak waits that long
    "NEVER_BEGUN_S": {"cluster/run/liveness.py", "benchmarks/chaos.py"},
    "PROVISION_GRACE_S": {"cluster/run/liveness.py"},
}


def deciding_elsewhere(sources_by_path: dict[str, str]) -> list[str]:
    """ "path: fact" for each module that names a fact of a run's death where VERDICT_FACTS does not allow it."""
    return sorted(
        f"{path}: {fact}"
        for path, text in sources_by_path.items()
        for fact, allowed in VERDICT_FACTS.items()
        if path not in allowed and re.search(rf"\b{fact}\b", text)
    )


def test_one_place_decides_that_a_run_is_dead():
    files = {
        str(path.relative_to(REPO)): path.read_text()
        for folder in ("flows", "cluster", "tasks", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
    }
    assert deciding_elsewhere(files) == []


def test_the_verdict_check_finds_a_module_that_decides_by_itself():
    judged_here = {"flows/cli/quota.py": "if now - float(run.data.tags[RENEWED_TAG]) > 60:\n    dead.add(run)\n"}
    assert deciding_elsewhere(judged_here) == ["flows/cli/quota.py: RENEWED_TAG"]
