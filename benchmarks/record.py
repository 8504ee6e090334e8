"""Appends a benchmark's figures to its table in benchmarks/README.md, one row per run, so that figures are
written by the scripts that measure them, never by hand.

    from benchmarks.record import record
    record("overhead", {"repeats": 5, "bare s": 33.0, "warm s": 36.9, ...})

The row holds the date (UTC), the commit (`git rev-parse --short HEAD`, with a `+` when tracked files other than
benchmarks/README.md have uncommitted changes), the machine (cores, architecture and, where torch sees one, the GPU)
and then the figures, in the order of the table's columns. The table is the first one in the section whose heading
is `## <benchmark>` (followed by the end of the line, a space or a colon). A section without a table gets one, its
columns the figures' keys in their order; a missing section is added at the end of the file. A figure the table has
no column for gets a new column at the right (earlier rows show "—" there), and a column without a figure gets "—".
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import subprocess
from pathlib import Path

README = Path(__file__).resolve().with_name("README.md")
FIXED = ["date (UTC)", "commit", "machine"]
MISSING = "—"


def record(benchmark: str, figures: dict[str, str | float], readme: Path = README) -> str:
    """Appends one row of `figures` to `benchmark`'s table in `readme`; returns the row as written."""
    lines = readme.read_text().splitlines() if readme.exists() else []
    heading = re.compile(rf"^## {re.escape(benchmark)}(\s|:|$)")
    start = next((i for i, line in enumerate(lines) if heading.match(line)), None)
    if start is None:  # a new section at the end
        lines += ([""] if lines and lines[-1].strip() else []) + [f"## {benchmark}", ""]
        start = len(lines) - 2
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    table = next((i for i in range(start + 1, end) if lines[i].startswith("|")), None)
    if table is None:  # a table of the figures' keys, after the section's text
        at = end
        while at > start + 1 and not lines[at - 1].strip():
            at -= 1
        lines[at:at] = ["", row(FIXED + list(figures)), row(["---"] * (len(FIXED) + len(figures)))]
        table = at + 1
    last = table
    while last + 1 < len(lines) and lines[last + 1].startswith("|"):
        last += 1
    columns = cells(lines[table])
    added = [key for key in figures if key not in columns]
    if added:  # new figures: new columns at the right, "—" in the rows before
        lines[table] = row(columns + added)
        lines[table + 1] = row(cells(lines[table + 1]) + ["---"] * len(added))
        for i in range(table + 2, last + 1):
            lines[i] = row(cells(lines[i]) + [MISSING] * len(added))
        columns += added
    values = {
        "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "commit": commit(readme),
        "machine": machine(),
        **{key: cell(value) for key, value in figures.items()},
    }
    written = row([values.get(column, MISSING) for column in columns])
    lines.insert(last + 1, written)
    if last + 2 < len(lines) and lines[last + 2].strip():  # a table ends at a blank line
        lines.insert(last + 2, "")
    temporary = readme.with_name(f".{readme.name}.{os.getpid()}")
    temporary.write_text("\n".join(lines).rstrip("\n") + "\n")
    os.replace(temporary, readme)
    print(f"[bench] recorded in {readme}: {written}", flush=True)
    return written


def cells(line: str) -> list[str]:
    """The cells of a markdown table row (an escaped `\\|` stays inside its cell)."""
    return [part.strip() for part in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def row(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


def cell(value: str | float | None) -> str:
    """A figure as the table shows it: floats to 4 significant digits (thousands grouped from 10,000 on)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|").replace("\n", " ")
    if abs(value) >= 10_000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def commit(readme: Path) -> str:
    """The short commit of the working tree, `+` when tracked files (but the results file) have changes."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=readme.resolve().parent, capture_output=True, text=True, timeout=30, check=True
        ).stdout

    try:
        sha, top = git("rev-parse", "--short", "HEAD").strip(), git("rev-parse", "--show-toplevel").strip()
        changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        return MISSING
    dirty = [line for line in changed if Path(top, line[3:].split(" -> ")[-1]).resolve() != readme.resolve()]
    return sha + ("+" if dirty else "")


def machine() -> str:
    """What ran it, without the host's name: '2 cores, x86_64', plus the GPU where torch sees one."""
    described = f"{os.cpu_count()} cores, {platform.machine()}"
    try:
        import torch

        if torch.cuda.is_available():
            described += f", {torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}"
    except Exception:  # no torch, or a CUDA that will not answer: the CPU is still worth saying
        pass
    return described
