"""Loading a spec: YAML (or a dict) and `--set field=value` overrides to an ExperimentSpec, and pydantic's errors
worded as 'field: problem; fix' in a refusal that always fits a screen."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gpuflow.cluster.spec import fields as checks
from gpuflow.cluster.spec.fields import cut
from gpuflow.cluster.spec.model import ExperimentSpec

MAX_PROBLEMS_SHOWN = 8
MAX_PROBLEM_CHARS = 400  # with MAX_PROBLEMS_SHOWN: a refusal always prints under 4 KB


class Refusal(str):
    """A problem that is not the spec's: a server refused the caller's credentials (the line names the variable)."""

    heading = "credentials refused (the spec is fine):"


class Denied(Refusal):
    """A problem that is not the spec's: the server knows the caller, who lacks a permission (the line names who
    grants it)."""

    heading = "permission refused (the spec is fine):"


class Silence(str):
    """The problem of a tracking server that does not answer: a wrong host or port, or a server restarting (a run
    nobody watches waits for it: probes.validate_spec)."""


class SpecError(ValueError):
    """A spec that cannot run: each line names the field, the bad value and the fix; never more than a screenful.
    Credentials a server refused are not called a bad spec."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = [cut(problem, MAX_PROBLEM_CHARS) for problem in problems[:MAX_PROBLEMS_SHOWN]]
        if len(problems) > MAX_PROBLEMS_SHOWN:
            shown.append(f"... and {len(problems) - MAX_PROBLEMS_SHOWN} more problems; fix these first")
        if not all(isinstance(problem, Refusal) for problem in problems):  # the spec's own problems come first
            heading = "invalid experiment spec:"
        else:
            heading = Denied.heading if all(isinstance(p, Denied) for p in problems) else Refusal.heading
        super().__init__(heading + "\n" + "\n".join(f"  - {p}" for p in shown))


class DuplicateKey(yaml.YAMLError):
    def __init__(self, path: str, lines: tuple[int, int]):
        self.path, self.lines = path, lines
        super().__init__(self.describe())

    def describe(self, source: str = "") -> str:
        where = f" in {source}" if source else ""
        return (
            f"{self.path}: given twice{where} (lines {self.lines[0]} and {self.lines[1]}); keep one of them "
            "(YAML would silently take the second)"
        )


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping. Checked as each mapping is composed, before
    the `<<: *anchor` merges that may legitimately override a key: the mapping holds only what the file says there."""

    def __init__(self, stream):
        super().__init__(stream)
        self.path: list = []  # the keys (and list indexes) above the node being composed

    def compose_node(self, parent, index):
        self.path.append(index.value if isinstance(index, yaml.ScalarNode) else index)
        try:
            return super().compose_node(parent, index)
        finally:
            self.path.pop()

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        lines: dict[tuple, int] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            line = key.start_mark.line + 1
            if (key.tag, key.value) in lines:
                path = ".".join(str(part) for part in [*self.path, key.value] if part is not None)
                raise DuplicateKey(cut(path, 120), (lines[key.tag, key.value], line))
            lines[key.tag, key.value] = line
        return node


def safe_load(text: str):
    """yaml.safe_load, refusing a key given twice in one mapping (e.g. `train:` twice: the second would win)."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def load_spec(path: str | Path, overrides: list[str] = ()) -> ExperimentSpec:
    """Reads a YAML spec and applies `key.sub=value` overrides (values parsed as YAML)."""
    path = Path(path)
    try:
        if path.stat().st_size > checks.MAX_SPEC_FILE_BYTES:
            raise SpecError(
                [
                    f"spec file: {str(path)!r} is {path.stat().st_size} bytes, more than a spec can be "
                    f"({checks.MAX_SPEC_FILE_BYTES}); give the experiment's YAML spec"
                ]
            )
        raw = safe_load(path.read_text()) or {}
    except (FileNotFoundError, NotADirectoryError):
        raise SpecError([f"spec file: {str(path)!r} does not exist; pass the path of a YAML spec"]) from None
    except DuplicateKey as exc:
        raise SpecError([exc.describe(repr(str(path)))]) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = str(exc).replace('"<unicode string>", ', "")  # PyYAML's name for text; the file is named before
        raise SpecError([f"spec file: {str(path)!r} is not valid YAML: {cut(where, 300)}"]) from None
    except RecursionError:
        raise SpecError([f"spec file: {str(path)!r} is nested too deeply to be a spec; flatten it"]) from None
    if not isinstance(raw, dict):
        raise SpecError([f"spec file: {str(path)!r} must hold a mapping of fields, got {type(raw).__name__}"])
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError([f"--set {item!r}: write it as field.path=value, e.g. train.lr=0.01"])
        try:
            apply_override(raw, key.strip(), safe_load(value))
        except yaml.YAMLError as exc:
            raise SpecError(
                [f"--set {checks.shorten(item)}: the value is not valid YAML: {cut(str(exc), 200)}"]
            ) from None
    return parse_spec(raw)


def apply_override(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError([f"--set {dotted}: {part!r} is not a section"])
    node[leaf] = value


def parse_spec(raw: dict | ExperimentSpec) -> ExperimentSpec:
    if isinstance(raw, ExperimentSpec):
        return raw
    too_big = checks.size_problem(raw)
    if too_big:
        raise SpecError([too_big])
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError([describe(error) for error in exc.errors()]) from None


REQUIRED_EXAMPLES = {
    "train": "train: {loop: 'train:train_loop'} (`gpuflow init` writes a starter spec and loop)",
    "train.loop": "loop: 'train:train_loop' (a function in train.py of the workdir, taking the config)",
    "data.train": "train: data/train.parquet (or remove data: if the loop reads its own)",
}


def describe(error: dict) -> str:
    """One pydantic error as 'field: problem (got value)' with the fix where pydantic does not give one."""
    # Pydantic adds the union member (e.g. 'constrained-str') to the location: the user knows no such field.
    parts = [
        str(part)
        for part in error["loc"]
        if not re.match(r"^(constrained-|function-|lax-|strict-)|^(str|int|float|list\[.*\]|dict\[.*\])$", str(part))
    ]
    field = cut(".".join(parts), 120) or "spec"
    message = cut(error["msg"].removeprefix("Value error, "), 600)
    got = checks.shorten(error.get("input"))
    if error["type"] == "missing":
        example = REQUIRED_EXAMPLES.get(field, "")
        return f"{field}: required, and missing; add it to the spec{', e.g. ' + example if example else ''}"
    if error["type"] == "extra_forbidden":
        return f"{field}: unknown field (got {got}); remove it or check its spelling"
    if error["type"] == "literal_error":
        return f"{field}: {got} is not allowed; {message.lower()}"
    if error["type"] in ("value_error", "assertion_error"):
        return f"{field}: {message}"
    if error["type"] in ("bool_type", "int_type", "float_type") and isinstance(error.get("input"), bool):
        return f"{field}: {message}, not a boolean (got {got}); write a number"
    if error["type"] == "finite_number":
        return f"{field}: {message} (got {got}); give a finite number"
    if error["type"] == "too_short":
        return f"{field}: {message} (got {got}); give at least {error.get('ctx', {}).get('min_length', 1)}"
    if error["type"] in ("less_than_equal", "less_than"):
        return f"{field}: {message} (got {got}); that is beyond what a run can mean, lower it"
    return f"{field}: {message} (got {got})"


def job_spec(spec_json: str) -> ExperimentSpec:
    """The spec as the job on the cluster loads it (its JSON, by the rules of a node: whatever the flow handed it
    must pass these, or the job fails after the launch was paid for)."""
    return ExperimentSpec.model_validate_json(spec_json, context={"on_cluster": True})
