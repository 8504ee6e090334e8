"""The gpuflow command: run, validate (and plan, deploy, serve, cost) experiment specs.

    gpuflow run experiments/digits.yaml --set train.lr=0.01 --set compute.num_workers=4
    gpuflow validate my.yaml
    gpuflow serve                 # serve prefect.yaml's deployments from here; gpuflow deploy for a work pool
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cluster.spec import SpecError, load_spec, validate_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpuflow", description="Run ML experiments on cloud GPUs as one unit of work.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run an experiment: provision, train, track, tear down"),
                            ("validate", "check a spec without running anything")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("spec", help="experiment spec (YAML)")
        command.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                             help="override a spec field, e.g. --set train.lr=0.01 (repeatable)")
    # -- deployments (flows/deploy.py, flows/serve.py): prefect.yaml's deployments, served here or registered
    serve = commands.add_parser("serve", help="serve prefect.yaml's deployments from this machine (no work pool)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                       help="override a field of the deployments' default spec, e.g. --set tracking.uri=http://...")
    serve.add_argument("--only", action="append", default=[], metavar="DEPLOYMENT", help="serve only this one (repeatable)")
    serve.add_argument("--limit", type=int, default=1, help="flow runs at once (default 1)")
    deploy = commands.add_parser("deploy", help="register prefect.yaml's deployments with a work pool")
    deploy.add_argument("--only", action="append", default=[], metavar="DEPLOYMENT", help="deploy only this one (repeatable)")
    deploy.add_argument("--pool", default="gpuflow-process", help="work pool, created as a process pool if missing")
    args = parser.parse_args(argv)
    if args.command in ("serve", "deploy"):
        return deployments(args)
    try:
        spec = load_spec(args.spec, args.overrides)
        if args.command == "validate":
            validate_spec(spec)
            print(f"{args.spec}: valid. {describe(spec)}")
            return 0
        return run(spec)
    except SpecError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2


def deployments(args) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.deploy import deploy
    from flows.serve import serve

    try:
        if args.command == "deploy":
            return deploy(args.only, args.pool)
        serve(args.overrides, args.only, args.limit)
        return 0
    except SpecError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2


def describe(spec) -> str:
    c = spec.compute
    return (f"{spec.name}: {c.backend} backend, {c.num_nodes} node(s) × {c.workers_per_node} worker(s), "
            f"{c.accelerators or 'CPU'}, {spec.precision}, {spec.train.epochs} epochs, tracked at {spec.tracking_uri}")


def run(spec) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.experiment import run_experiment
    from tasks.tracking import open_command, run_url

    started = time.time()
    state = run_experiment(spec, return_state=True)
    if not state.is_completed():
        print(f"\ngpuflow: {spec.name} ended {state.name}: {state.message or ''}", file=sys.stderr)
        return 1
    summary = state.result()
    phases = summary["phases"]
    print(f"\ngpuflow: {spec.name} finished in {time.time() - started:.1f}s")
    print(f"  MLflow run   {summary['run_id']} (experiment {summary['experiment']!r}, {summary['tracking_uri']})")
    if open_command(spec):
        print(f"  open it      {open_command(spec)}")
    print(f"               then {run_url(spec, summary['run_id'])}")
    print("  metrics      " + "  ".join(f"{k}={v:.4g}" for k, v in summary["metrics"].items()))
    print("  phases       " + "  ".join(f"{k.removesuffix('_seconds')} {v:.1f}s" for k, v in phases.items()))
    print(f"  checkpoint   {summary['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
