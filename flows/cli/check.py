"""`gpuflow validate` and `gpuflow plan`: what a spec would run and cost, checked before anything starts.

gpuflow validate experiments/digits.yaml
gpuflow plan experiments/digits_h100.yaml    # the SkyPilot task, each option's price; launches nothing
"""

from __future__ import annotations

import argparse
import sys

from gpuflow.cluster.backends.skypilot.infra import check_infra
from gpuflow.cluster.spec import load_spec, validate_spec
from gpuflow.flows.cli import add_overrides

HELP = {
    "validate": "check a spec without running anything",
    "plan": "show the cluster a spec would launch (SkyPilot task, resources) without launching",
}


def add_parser(commands, name: str) -> None:
    command = commands.add_parser(name, help=HELP[name])
    command.add_argument("spec", help="experiment spec (YAML)")
    add_overrides(command, "override a spec field, e.g. --set train.lr=0.01 (repeatable)")


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    return validate(spec, args.spec) if args.command == "validate" else plan(spec)


def validate(spec, path: str) -> int:
    """Checks the spec and its budget; prints the price it would run at."""
    from gpuflow.flows.cli.cost import priced_within_budget

    check_infra(validate_spec(spec))
    if spec.notify:  # the block lives in Prefect: the API `gpuflow run` would use
        from gpuflow.flows.local_stack.prefect_api import temporary_api_launched
        from gpuflow.flows.run_messages import webhook_for

        api = temporary_api_launched()
        if api:
            api.ready()
        webhook_for(spec)
    from gpuflow.cluster.cost.history import prediction_for

    deadline = deadline_lines(spec, lambda: prediction_for(spec))  # one that cannot be met is refused here
    price = priced_within_budget(spec, path)
    if price is None:
        return 2
    print(f"{path}: valid. {describe(spec)}")
    print(f"  price {price.describe()}; at most ${price.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes")
    for line in sweep_lines(spec, price) + deadline:
        print(f"  {line}")
    return 0


def deadline_lines(spec, predict) -> list[str]:
    """What the spec's deadline needs and costs (cluster/cost/deadline_run.py); a SpecError if it cannot be met.
    `predict()`: the run's prediction, asked only of a spec with a deadline (it reads the history)."""
    import time

    from gpuflow.cluster.cost.deadline_run import checked_deadline
    from gpuflow.cluster.cost.pricing import hourly_cost
    from gpuflow.cluster.spec.options import on_demand_spec

    if spec.limits.deadline is None and spec.limits.finish_within_hours is None:
        return []
    deadline = checked_deadline(spec, predict())
    try:
        on_demand_usd = hourly_cost(on_demand_spec(spec)).hourly_usd
    except Exception:  # no price: the plan says the rest
        on_demand_usd = None
    return deadline.lines(time.time(), on_demand_usd)


def sweep_lines(spec, price=None) -> list[str]:
    """What a sweep will run: its trials, how many at once, how trials stop early, and the most it can cost."""
    sweep = spec.sweep
    if sweep is None:
        return []
    grids = [f"{len(p.grid)} {path}" for path, p in sweep.parameters.items() if p.grid is not None]
    lines = [
        f"sweep: {sweep.num_trials} trials ({' × '.join(grids + [f'{sweep.num_samples} sample(s)'])}), "
        f"{sweep.max_concurrent_trials} at a time, {spec.workers_per_trial} worker(s) each; the best has the "
        f"{'highest' if sweep.mode == 'max' else 'lowest'} {sweep.metric}",
        *[f"  {path}: {p.kind} {getattr(p, p.kind)}" for path, p in sweep.parameters.items()],
    ]
    if sweep.early_stopping:
        lines.append(
            f"  early stopping (ASHA): after {sweep.early_stopping.grace_epochs} epoch(s), about 1 trial in "
            f"{sweep.early_stopping.reduction_factor:g} goes on at each rung"
        )
    if price is not None:
        from gpuflow.cluster.spec import billed_sweep_minutes, sweep_rounds

        if sweep.max_trial_minutes:
            rounds = sweep_rounds(spec)
            how = (
                f"{sweep.num_trials} trials ÷ {sweep.max_concurrent_trials} at a time × {sweep.max_trial_minutes:g} min"
            )
        else:
            rounds, how = None, "limits.max_runtime_minutes (set sweep.max_trial_minutes for a tighter bound)"
        minutes = billed_sweep_minutes(spec)
        lines.append(
            f"  cost bound: {how} = {minutes:g} min{f' ({rounds} rounds)' if rounds else ''} "
            f"× ${price.hourly_usd:.4g}/h = ${price.sweep_cost_usd(spec):.2f}"
        )
    return lines


def describe(spec) -> str:
    c = spec.compute
    elastic = f" (elastic: trains on down to {c.min_workers})" if c.min_workers else ""
    return (
        f"{spec.name}: {c.backend} backend, {c.num_nodes} node(s) × {c.workers_per_node} worker(s){elastic}, "
        f"{c.accelerators or 'CPU'}, {spec.precision}, {spec.train.epochs} epochs, tracked at {spec.tracking_uri}"
    )


def plan(spec) -> int:
    """Prints what would be launched and billed; launches nothing."""
    from gpuflow.cluster.cost.pricing import CatalogMissing, hourly_cost, option_prices
    from gpuflow.cluster.spec.options import compute_options

    check_infra(validate_spec(spec))
    from gpuflow.cluster.cost.history import prediction_for
    from gpuflow.cluster.rerun.reuse import finished_twin

    print(f"# {describe(spec)}")
    twin = finished_twin(spec)
    print(f"# {reuse_line(spec, twin)}")
    left = {"epochs": twin.epochs_left} if twin.continues else {}  # a continuation's time is its epochs left's
    predicted = spec.model_copy(update={"train": spec.train.model_copy(update=left)})
    prediction = prediction_for(predicted)  # one read of the history, for the deadline and the prediction's lines
    for line in deadline_lines(spec, lambda: prediction):
        print(f"# {line}")
    if spec.compute.backend == "local":
        price = hourly_cost(spec)
        for line in sweep_lines(spec, price):
            print(f"# {line}")
        print(
            "# local backend: a Ray cluster on this machine; nothing is billed."
            if price.hourly_usd == 0
            else f"# local backend, priced at {price.describe()}"
        )
        print_prediction(prediction, price)
        return 0
    from gpuflow.cluster.backends.skypilot import resources_for, task_yaml

    price, fallback = None, " (spot fallback)" if spec.compute.spot_fallback_after else " (when the deadline needs it)"
    try:
        for option, estimate in option_prices(spec):
            print(
                f"# option {option.index}{'' if option in compute_options(spec.compute) else fallback}"
                f": {option.describe()}: {estimate.describe()}"
            )
        price = hourly_cost(spec)
        print(
            f"# budget estimate (the dearest option that may launch): {price.describe()}; at most "
            f"${price.max_runtime_cost_usd(spec):.2f} in limits.max_runtime_minutes={spec.limits.max_runtime_minutes:g}"
        )
        print_prediction(prediction, price)
    except CatalogMissing as exc:  # not a plan that can launch: SkyPilot would fail at launch, offline
        print(f"gpuflow: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a plan is still worth showing without a price
        print(f"# price unknown: {exc}")
    print(
        f"# SkyPilot tries the options {'cheapest first (compute.any_of)' if spec.compute.any_of else 'in order'}; "
        f"with no capacity anywhere the run waits up to limits.max_queue_minutes={spec.limits.max_queue_minutes:g}"
    )
    for line in sweep_lines(spec, price):
        print(f"# {line}")
    print(f"# launched with autostop after {spec.limits.idle_minutes_to_autostop} idle min and down=True (autodown)")
    for rank, resources in enumerate(resources_for(spec), 1):
        print(f"# choice {rank}: {spec.compute.num_nodes} × {resources}")
    print(task_yaml(spec), end="")
    return 0


def reuse_line(spec, twin=None) -> str:
    """Whether `gpuflow run` of the spec would train, continue a finished run, or reuse one (cluster/rerun/reuse.py
    decides: `twin`, or asked here)."""
    from gpuflow.cluster.rerun.reuse import finished_twin

    twin = twin or finished_twin(spec)
    if twin.run is None:
        return f"gpuflow run trains: {twin.why}"
    run = twin.run.info
    return (
        f"gpuflow run reuses the finished run {run.run_name} ({run.run_id}), of the same work: nothing trains or is "
        "billed (--force trains anyway)"
    )


def print_prediction(prediction, price) -> None:
    """The run's time and cost predicted from past runs of its loop on its hardware, or why there is none."""
    for line in prediction.lines(price):
        print(f"# {line}")
