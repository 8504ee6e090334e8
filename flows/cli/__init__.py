"""The gpuflow command: run, validate (and plan, deploy, serve, cost) experiment specs.

gpuflow run experiments/digits.yaml --set train.lr=0.01 --set compute.num_workers=4
gpuflow rerun RUN [--dry-run]      # an MLflow (or Prefect flow) run again: its commit, changes, spec, data
gpuflow validate my.yaml
gpuflow cost --since 7d
gpuflow status                     # what is running or waiting now, its cluster, GPUs, cost so far
gpuflow quota set aws-h100 8       # the team's runs hold at most 8 of those GPUs at once; the rest wait
gpuflow share my.yaml --user bob   # on a tracking server with users: bob may run it and register versions
gpuflow serve                 # serve prefect.yaml's deployments from here; gpuflow deploy for a work pool
gpuflow init                  # a starter project here: experiment.yaml, train.py, prefect.yaml
gpuflow up                    # a warm local stack that the next runs start on at once; gpuflow down stops it
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import warnings

from gpuflow.cluster.config import SettingError
from gpuflow.cluster.spec import SpecError

# Each command's module, in the order `gpuflow -h` lists them: its add_parser(commands) and run(args) -> exit code.
COMMANDS = {
    "run": "run",
    "rerun": "run",
    "validate": "check",
    "plan": "check",
    "cost": "cost",
    "share": "share",
    "notify": "notify",
    "quota": "quota",
    "status": "status",
    "serve": "deployments",
    "up": "stack",
    "down": "stack",
    "deploy": "deployments",
    "init": "starter",
}


def module_of(command: str):
    return importlib.import_module(f"{__name__}.{COMMANDS[command]}")


def command_line(only: str | None = None) -> argparse.ArgumentParser:
    """Every gpuflow command and its arguments; or one command's alone, so that a command does not import the others'
    modules (some load MLflow: a second of CPU before `gpuflow run` starts anything)."""
    parser = argparse.ArgumentParser(
        prog="gpuflow", description="Run ML experiments on cloud GPUs as one unit of work."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in [only] if only in COMMANDS else COMMANDS:
        module_of(command).add_parser(commands, command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = command_line(argv[0] if argv else None).parse_args(argv)
    try:
        return module_of(args.command).run(args)
    except (SpecError, SettingError) as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not (refused := refused_by_prefect(exc)):
            raise
        print(f"gpuflow: {refused}", file=sys.stderr)
        return 2


def refused_by_prefect(exc: Exception) -> str | None:
    """What to tell a user whose Prefect server refused this machine's credential (401, 403); None for other errors.
    By name: this module imports no Prefect before a command needs it."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if type(exc).__name__ != "PrefectHTTPStatusError" or status not in (401, 403):
        return None
    url = exc.request.url
    return (
        f"the Prefect server at {url.scheme}://{url.netloc.decode()} refused this machine's credential ({status}): "
        "set PREFECT_API_AUTH_STRING to the user:password its admin gave (the server's "
        "PREFECT_SERVER_API_AUTH_STRING; docs/team.md, step 5)"
    )


def entry() -> None:
    """The `gpuflow` command as a process: main(), then an exit that does not wait on the interpreter's last garbage
    collections. Those walk every object Prefect, MLflow and torch made: about a second after a run's summary
    (benchmarks/overhead.py). Frozen, the objects are skipped; atexit handlers and Prefect's drains run as ever."""
    # MLflow's users client imports its server's app, which imports a module Starlette deprecates: a warning on every
    # command of a team's user that they can do nothing about
    warnings.filterwarnings("ignore", message="starlette.middleware.wsgi is deprecated")
    code = main()
    gc.freeze()
    sys.exit(code)


def add_overrides(command: argparse.ArgumentParser, help: str) -> None:
    """`--set FIELD=VALUE`, repeatable, into args.overrides: how every command takes a spec's overrides."""
    command.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE", help=help)
