"""`gpuflow serve` and `gpuflow deploy`: prefect.yaml's deployments, served from here or registered with a work pool.

gpuflow serve [--limit 2] [--set tracking.uri=http://...]
gpuflow deploy [--pool gpuflow-process] [--remote URL]
"""

from __future__ import annotations

import argparse
import os
import sys

from gpuflow.flows.cli import add_overrides


def add_parser(commands, name: str) -> None:
    if name == "serve":
        serve = commands.add_parser("serve", help="serve prefect.yaml's deployments from this machine (no work pool)")
        add_overrides(serve, "override a field of the deployments' default spec, e.g. --set tracking.uri=http://...")
        serve.add_argument(
            "--only", action="append", default=[], metavar="DEPLOYMENT", help="serve only this one (repeatable)"
        )
        serve.add_argument("--limit", type=int, default=1, help="flow runs at once (default 1)")
        return
    deploy = commands.add_parser("deploy", help="register prefect.yaml's deployments with a work pool")
    deploy.add_argument(
        "--only", action="append", default=[], metavar="DEPLOYMENT", help="deploy only this one (repeatable)"
    )
    deploy.add_argument("--pool", default="gpuflow-process", help="work pool, created as a process pool if missing")
    deploy.add_argument("--remote", help="git URL workers pull the code from (default: this folder's origin)")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from gpuflow.flows.deployments.deploy import deploy
    from gpuflow.flows.deployments.serve import ServedElsewhere, serve

    if args.command == "deploy":
        return deploy(args.only, args.pool, remote=args.remote)
    try:
        serve(args.overrides, args.only, args.limit)
    except ServedElsewhere as exc:
        print(f"gpuflow serve: {exc}", file=sys.stderr)
        return 2
    return 0
