"""`gpuflow init`: a starter project in a folder of your own — a spec, a Ray Train loop and prefect.yaml.

mkdir my-project && cd my-project && gpuflow init && gpuflow validate experiment.yaml && gpuflow run experiment.yaml
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from string import Template

LOOP_FILE = "train.py"
SPEC_FILE = "experiment.yaml"
PREFECT_FILE = "prefect.yaml"

TEMPLATES = Path(__file__).parent / "templates"  # the loop is plain Ray Train and torch, no gpuflow import


def add_parser(commands, name: str) -> None:
    init = commands.add_parser(
        name, help="write a starter project: experiment.yaml, train.py (a Ray Train loop), prefect.yaml"
    )
    init.add_argument("folder", nargs="?", default=".", help="where to write it (default: here)")
    init.add_argument("--force", action="store_true", help="overwrite those files if they exist")


def run(args: argparse.Namespace) -> int:
    try:
        written = init_project(Path(args.folder), args.force)
    except FileExistsError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2
    print("gpuflow: wrote " + ", ".join(str(path) for path in written))
    where = "" if Path(args.folder).absolute() == Path.cwd() else f"cd {args.folder} && "
    print(f"  next: {where}gpuflow validate {SPEC_FILE} && gpuflow run {SPEC_FILE}")
    return 0


def project_name(folder: Path) -> str:
    """The folder's name as a spec name (lowercase, digits and '-', starting with a letter)."""
    name = re.sub(r"[^a-z0-9]+", "-", folder.absolute().name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"exp-{name}".rstrip("-")
    return name[:40].rstrip("-") or "my-experiment"


def init_project(folder: Path, force: bool = False) -> list[Path]:
    """Writes the starter files into the folder; refuses to overwrite any of them unless force."""
    import yaml
    from prefect import __version__ as prefect_version

    folder.mkdir(parents=True, exist_ok=True)
    name = project_name(folder)
    spec = Template((TEMPLATES / SPEC_FILE).read_text()).substitute(name=name)
    spec_block = "".join(
        f"      {line}\n" for line in yaml.safe_dump(yaml.safe_load(spec), sort_keys=False).splitlines()
    )
    files = {
        folder / LOOP_FILE: (TEMPLATES / LOOP_FILE).read_text(),
        folder / SPEC_FILE: spec,
        folder / PREFECT_FILE: Template((TEMPLATES / PREFECT_FILE).read_text()).safe_substitute(
            name=name, prefect_version=prefect_version, spec_block=spec_block
        ),
    }
    existing = [path for path in files if path.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(str(p) for p in existing)} already exist; remove them or pass --force")
    for path, text in files.items():
        path.write_text(text)
    return list(files)
