"""`gpuflow cost`: what gpuflow runs cost (from MLflow), or what one spec would cost before it runs.

gpuflow cost --since 7d                               # runs of the last 7 days and their totals
gpuflow cost --estimate experiments/digits.yaml       # hourly price, most a run may cost, budget verdict
"""

from __future__ import annotations

import argparse
import sys
import time

from gpuflow.cluster.config import default_tracking_uri
from gpuflow.cluster.cost.pricing import CatalogMissing, PriceUnknown
from gpuflow.cluster.spec import load_spec
from gpuflow.flows.cli import add_overrides


def add_parser(commands, name: str) -> None:
    command = commands.add_parser(name, help="what runs cost (from MLflow), or what a spec would cost")
    command.add_argument("--since", default="7d", help="how far back: 30m, 12h, 7d, 2w (default 7d)")
    command.add_argument("--tracking-uri", help="MLflow tracking URI (default: the local store under GPUFLOW_HOME)")
    command.add_argument("--estimate", metavar="SPEC", help="price this spec instead of listing runs")
    add_overrides(command, "override a field of the --estimate spec (repeatable)")


def run(args: argparse.Namespace) -> int:
    if args.estimate:
        return estimate(args)
    from gpuflow.cluster.cost.spend import (  # MLflow's import: only for this command
        format_table,
        parse_since,
        run_costs,
    )

    try:
        since_s = parse_since(args.since)
    except ValueError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2
    uri = args.tracking_uri or default_tracking_uri()
    rows = run_costs(uri, time.time() - since_s)
    print(f"gpuflow runs since {args.since} ago in {uri}")
    print(format_table(rows))
    return 0


def priced_within_budget(spec, path: str):
    """The spec's price if its budgets allow the run; otherwise says why on stderr and returns None."""
    from gpuflow.cluster.cost.budget import BudgetExceeded, check_budget

    try:
        return check_budget(spec)
    except (BudgetExceeded, PriceUnknown, CatalogMissing) as exc:
        print(f"gpuflow: {path}: {exc}", file=sys.stderr)
        return None


def estimate(args: argparse.Namespace) -> int:
    spec = load_spec(args.estimate, args.overrides)
    price = priced_within_budget(spec, args.estimate)
    if price is None:
        return 2
    print(f"{args.estimate}: {price.describe()}")
    print(
        f"  at most ${price.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes="
        f"{spec.limits.max_runtime_minutes:g}; max_cost_usd={spec.limits.max_cost_usd}"
    )
    return 0
