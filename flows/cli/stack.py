"""`gpuflow up` and `gpuflow down`: the warm local stack, and tearing down one cluster by name; and the stack a
local `gpuflow run` leaves up for the next (GPUFLOW_STACK auto).

    gpuflow up [experiments/digits.yaml] [--idle-minutes 30]
    gpuflow down [gpuflow-<flow run id>] [--backend local|skypilot]
"""

from __future__ import annotations

import argparse

from gpuflow.cluster.config import stack_idle_minutes, stack_mode
from gpuflow.cluster.spec import SpecError, load_spec, validate_spec


def add_parser(commands, name: str) -> None:
    if name == "up":
        up = commands.add_parser(
            "up", help="keep a warm local stack (Prefect API, a spare Ray cluster) for the next runs"
        )
        up.add_argument("spec", nargs="?", help="shape the spare cluster for this spec (default: as the last run's)")
        up.add_argument(
            "--idle-minutes", type=float, default=30, help="stop after this long without a run (default 30)"
        )
        return
    down = commands.add_parser(
        "down", help="tear down a gpuflow cluster by name (what the reaper would do), or without a name the warm stack"
    )
    down.add_argument("cluster", nargs="?", help="cluster name, gpuflow-<flow run id>")
    down.add_argument(
        "--backend",
        choices=["local", "skypilot"],
        default=None,
        help="where it runs (default: local if this machine has it, else skypilot)",
    )


def run(args: argparse.Namespace) -> int:
    if args.command == "up":
        return up_stack(args.spec, args.idle_minutes)
    return down_cluster(args.cluster, args.backend) if args.cluster else down_stack()


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
    from gpuflow.flows.local_stack import stack

    shape, secrets = None, ()
    if spec_path:
        spec = load_spec(spec_path)
        validate_spec(spec)
        if spec.compute.backend != "local":
            raise SpecError(
                [
                    f"compute.backend: the warm stack's spare is a local cluster, and {spec_path} runs on "
                    f"{spec.compute.backend!r}; name a local spec, or none (its API serves every run)"
                ]
            )
        shape, secrets = shape_of(spec), spec.secrets
    was_up = stack.read_stack() is not None
    record = stack.up(idle_minutes, shape, secrets)
    spare = record.get("spare_shape")
    print(f"gpuflow: warm stack up (stops after {record['idle_minutes']:g} idle min, or `gpuflow down`)")
    if was_up and record["idle_minutes"] != idle_minutes:
        print(f"  (it was up already, with its own idle time: `gpuflow down`, then up, for {idle_minutes:g} min)")
    print(f"  Prefect API  {record['api_url']}")
    print(
        "  spare        "
        + (
            f"a local Ray cluster of {spare['num_nodes']} node(s) × {spare['cpus']:g} CPU(s)"
            if spare
            else "none yet: the first run's shape makes the next one"
        )
    )
    return 0


def down_stack() -> int:
    from gpuflow.flows.local_stack import stack

    print(f"gpuflow: warm stack {stack.down()}")
    return 0


def leave_a_stack(spec) -> str | None:
    """Starts the warm stack as a local run ends (GPUFLOW_STACK auto): the next run finds Prefect's API and a spare
    cluster of this run's shape up. Returns the line that says so; None when it leaves none. Never fails the run."""
    if spec.compute.backend != "local" or stack_mode() != "auto":
        return None
    from gpuflow.cluster.backends.local import shape_of
    from gpuflow.flows.local_stack import stack

    minutes = stack_idle_minutes()
    try:
        stack.start(minutes, shape_of(spec), spec.secrets)
    except OSError as exc:
        return f"  warm stack   not left for the next run: {exc}"
    return (
        f"  warm stack   up for your next run until {minutes:g} min idle (Prefect's API, a spare cluster): gpuflow down"
    )
