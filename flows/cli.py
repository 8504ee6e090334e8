"""The gpuflow command: run, validate (and plan, deploy, serve, cost) experiment specs.

    gpuflow run experiments/digits.yaml --set train.lr=0.01 --set compute.num_workers=4
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
import os
import sys

from gpuflow.cluster.spec import SpecError, load_spec, validate_spec
from gpuflow.flows.run_command import run, temporary_api_launched


def command_line() -> argparse.ArgumentParser:
    """Every gpuflow command and its arguments."""
    parser = argparse.ArgumentParser(prog="gpuflow", description="Run ML experiments on cloud GPUs as one unit of work.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run an experiment: provision, train, track, tear down"),
                            ("validate", "check a spec without running anything"),
                            ("plan", "show the cluster a spec would launch (SkyPilot task, resources) without launching")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("spec", help="experiment spec (YAML)")
        if name == "run":
            command.add_argument("-v", "--verbose", action="store_true",
                                 help="show the job's every line here (Ray's, MLflow's), not only gpuflow's progress")
        command.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                             help="override a spec field, e.g. --set train.lr=0.01 (repeatable)")
    from gpuflow.flows import cost_command, notify_command, quota_command, share_command

    cost_command.add_parser(commands)
    share_command.add_parser(commands)
    notify_command.add_parser(commands)
    quota_command.add_parser(commands)
    from gpuflow.flows import status_command

    status_command.add_parser(commands)
    # -- deployments (flows/deploy.py, flows/serve.py): prefect.yaml's deployments, served here or registered
    serve = commands.add_parser("serve", help="serve prefect.yaml's deployments from this machine (no work pool)")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                       help="override a field of the deployments' default spec, e.g. --set tracking.uri=http://...")
    serve.add_argument("--only", action="append", default=[], metavar="DEPLOYMENT", help="serve only this one (repeatable)")
    serve.add_argument("--limit", type=int, default=1, help="flow runs at once (default 1)")
    up = commands.add_parser("up", help="keep a warm local stack (Prefect API, a spare Ray cluster) for the next runs")
    up.add_argument("spec", nargs="?", help="shape the spare cluster for this spec (default: as the last run's)")
    up.add_argument("--idle-minutes", type=float, default=30, help="stop after this long without a run (default 30)")
    down = commands.add_parser("down", help="tear down a gpuflow cluster by name (what the reaper would do), "
                                            "or without a name the warm stack")
    down.add_argument("cluster", nargs="?", help="cluster name, gpuflow-<flow run id>")
    down.add_argument("--backend", choices=["local", "skypilot"], default=None,
                      help="where it runs (default: local if this machine has it, else skypilot)")
    deploy = commands.add_parser("deploy", help="register prefect.yaml's deployments with a work pool")
    deploy.add_argument("--only", action="append", default=[], metavar="DEPLOYMENT", help="deploy only this one (repeatable)")
    deploy.add_argument("--pool", default="gpuflow-process", help="work pool, created as a process pool if missing")
    deploy.add_argument("--remote", help="git URL workers pull the code from (default: this folder's origin)")
    init = commands.add_parser("init", help="write a starter project: experiment.yaml, train.py (a Ray Train loop), prefect.yaml")
    init.add_argument("folder", nargs="?", default=".", help="where to write it (default: here)")
    init.add_argument("--force", action="store_true", help="overwrite those files if they exist")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = command_line().parse_args(argv)
    if args.command == "init":
        return init_project(args.folder, args.force)
    if args.command in ("serve", "deploy"):
        return deployments(args)
    if args.command == "down":
        return down_cluster(args.cluster, args.backend) if args.cluster else down_stack()
    try:
        if args.command == "up":
            return up_stack(args.spec, args.idle_minutes)
        if args.command == "cost":
            from gpuflow.flows import cost_command

            return cost_command.run(args)
        if args.command == "status":
            from gpuflow.flows import status_command

            return status_command.run(args)
        if args.command == "quota":
            from gpuflow.flows import quota_command

            return quota_command.run(args)
        if args.command == "notify":
            from gpuflow.flows import notify_command

            return notify_command.run(args)
        if args.command == "share":
            from gpuflow.flows import share_command

            return share_command.run(args)
        spec = load_spec(args.spec, args.overrides)
        if args.command == "validate":
            return validate(spec, args.spec)
        if args.command == "plan":
            return plan(spec)
        return run(spec, args.verbose)
    except SpecError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2


def validate(spec, path: str) -> int:
    """Checks the spec and its budget; prints the price it would run at."""
    from gpuflow.flows.cost_command import priced_within_budget

    validate_spec(spec)
    if spec.notify:  # the block lives in Prefect: the API `gpuflow run` would use
        from gpuflow.flows.notify import webhook_for

        api = temporary_api_launched()
        if api:
            api.ready()
        webhook_for(spec)
    price = priced_within_budget(spec, path)
    if price is None:
        return 2
    print(f"{path}: valid. {describe(spec)}")
    print(f"  price {price.describe()}; at most ${price.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes")
    for line in sweep_lines(spec, price):
        print(f"  {line}")
    return 0


def sweep_lines(spec, price=None) -> list[str]:
    """What a sweep will run: its trials, how many at once, how trials stop early, and the most it can cost."""
    sweep = spec.sweep
    if sweep is None:
        return []
    grids = [f"{len(p.grid)} {path}" for path, p in sweep.parameters.items() if p.grid is not None]
    lines = [f"sweep: {sweep.num_trials} trials ({' × '.join(grids + [f'{sweep.num_samples} sample(s)'])}), "
             f"{sweep.max_concurrent_trials} at a time, {spec.workers_per_trial} worker(s) each; the best has the "
             f"{'highest' if sweep.mode == 'max' else 'lowest'} {sweep.metric}",
             *[f"  {path}: {p.kind} {getattr(p, p.kind)}" for path, p in sweep.parameters.items()]]
    if sweep.early_stopping:
        lines.append(f"  early stopping (ASHA): after {sweep.early_stopping.grace_epochs} epoch(s), about 1 trial in "
                     f"{sweep.early_stopping.reduction_factor:g} goes on at each rung")
    if price is not None:
        from gpuflow.cluster.spec import billed_sweep_minutes, sweep_rounds

        if sweep.max_trial_minutes:
            rounds = sweep_rounds(spec)
            how = f"{sweep.num_trials} trials ÷ {sweep.max_concurrent_trials} at a time × {sweep.max_trial_minutes:g} min"
        else:
            rounds, how = None, "limits.max_runtime_minutes (set sweep.max_trial_minutes for a tighter bound)"
        minutes = billed_sweep_minutes(spec)
        lines.append(f"  cost bound: {how} = {minutes:g} min{f' ({rounds} rounds)' if rounds else ''} "
                     f"× ${price.hourly_usd:.4g}/h = ${price.sweep_cost_usd(spec):.2f}")
    return lines


def down_cluster(cluster: str, backend_name: str | None) -> int:
    from gpuflow.cluster.backends import get_backend

    if backend_name is None:
        local = get_backend("local")
        backend_name = "local" if any(status.name == cluster for status in local.status()) else "skypilot"
    existed = get_backend(backend_name).down(cluster)
    print(f"{backend_name} cluster {cluster} {'is down' if existed else 'was not found (nothing to tear down)'}")
    return 0


def up_stack(spec_path: str | None, idle_minutes: float) -> int:
    from gpuflow.cluster.backends.local import shape_of
    from gpuflow.flows import stack

    shape = None
    if spec_path:
        spec = load_spec(spec_path)
        validate_spec(spec)
        if spec.compute.backend != "local":
            raise SpecError([f"compute.backend: the warm stack's spare is a local cluster, and {spec_path} runs on "
                             f"{spec.compute.backend!r}; name a local spec, or none (its API serves every run)"])
        shape = shape_of(spec)
    record = stack.up(idle_minutes, shape)
    spare = record.get("spare_shape")
    print(f"gpuflow: warm stack up (stops after {record['idle_minutes']:g} idle min, or `gpuflow down`)")
    print(f"  Prefect API  {record['api_url']}")
    print("  spare        " + (f"a local Ray cluster of {spare['num_nodes']} node(s) × {spare['cpus']:g} CPU(s)"
                                if spare else "none yet: the first run's shape makes the next one"))
    return 0


def down_stack() -> int:
    from gpuflow.flows import stack

    print("gpuflow: warm stack " + ("stopped" if stack.down() else "was not up (nothing to stop)"))
    return 0


def init_project(folder: str, force: bool) -> int:
    from pathlib import Path

    from gpuflow.flows.starter import SPEC_FILE, init_project

    try:
        written = init_project(Path(folder), force)
    except FileExistsError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2
    print("gpuflow: wrote " + ", ".join(str(path) for path in written))
    where = "" if Path(folder).absolute() == Path.cwd() else f"cd {folder} && "
    print(f"  next: {where}gpuflow validate {SPEC_FILE} && gpuflow run {SPEC_FILE}")
    return 0


def deployments(args) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from gpuflow.flows.deploy import deploy
    from gpuflow.flows.serve import serve

    try:
        if args.command == "deploy":
            return deploy(args.only, args.pool, remote=args.remote)
        serve(args.overrides, args.only, args.limit)
        return 0
    except SpecError as exc:
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2


def describe(spec) -> str:
    c = spec.compute
    return (f"{spec.name}: {c.backend} backend, {c.num_nodes} node(s) × {c.workers_per_node} worker(s), "
            f"{c.accelerators or 'CPU'}, {spec.precision}, {spec.train.epochs} epochs, tracked at {spec.tracking_uri}")


def plan(spec) -> int:
    """Prints what would be launched and billed; launches nothing."""
    from gpuflow.cluster.cost.pricing import hourly_cost, option_prices
    from gpuflow.cluster.spec.options import compute_options

    validate_spec(spec)
    print(f"# {describe(spec)}")
    if spec.compute.backend == "local":
        for line in sweep_lines(spec, hourly_cost(spec)):
            print(f"# {line}")
        print("# local backend: a Ray cluster on this machine; nothing is billed.")
        return 0
    from gpuflow.cluster.backends.skypilot import resources_for, task_yaml

    price = None
    try:
        for option, estimate in option_prices(spec):
            print(f"# option {option.index}{' (spot fallback)' if option not in compute_options(spec.compute) else ''}"
                  f": {option.describe()}: {estimate.describe()}")
        price = hourly_cost(spec)
        print(f"# budget estimate (the dearest option that may launch): {price.describe()}; at most "
              f"${price.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes={spec.limits.max_runtime_minutes:g}")
    except Exception as exc:  # a plan is still worth showing without a price
        print(f"# price unknown: {exc}")
    print(f"# SkyPilot tries the options {'cheapest first (compute.any_of)' if spec.compute.any_of else 'in order'}; "
          f"with no capacity anywhere the run waits up to limits.max_queue_minutes={spec.limits.max_queue_minutes:g}")
    for line in sweep_lines(spec, price):
        print(f"# {line}")
    print(f"# launched with autostop after {spec.limits.idle_minutes_to_autostop} idle min and down=True (autodown)")
    for rank, resources in enumerate(resources_for(spec), 1):
        print(f"# choice {rank}: {spec.compute.num_nodes} × {resources}")
    print(task_yaml(spec), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
