"""`gpuflow quota`: the team's GPU quotas, on the Prefect server every run and worker talks to.

gpuflow quota set aws-h100 8      # the team's runs hold at most 8 GPUs of pool aws-h100 at once
gpuflow quota set local 2         # on the local backend the unit is the worker
gpuflow quota list                # each quota: size, held now, runs waiting; gives back leaked slots
gpuflow quota remove aws-h100     # runs of that pool no longer wait
"""

from __future__ import annotations

import argparse
import sys

from gpuflow.cluster.spec import SpecError
from gpuflow.cluster.spec.fields import quota_name_problem


def add_parser(commands, name: str) -> None:
    command = commands.add_parser(name, help="the team's GPU quotas: runs over one wait their turn")
    actions = command.add_subparsers(dest="action", required=True)
    set_ = actions.add_parser("set", help="create or resize a quota")
    set_.add_argument("pool", help="its name, as compute.quota names it (e.g. aws-h100, local)")
    set_.add_argument("size", type=int, help="GPUs (workers on the local backend) held at once, at most")
    actions.add_parser("list", help="each quota: its size, what is held now, the runs waiting")
    remove = actions.add_parser("remove", help="delete a quota: its runs no longer wait")
    remove.add_argument("pool")


def run(args: argparse.Namespace) -> int:
    from gpuflow.flows.local_stack.prefect_api import temporary_api_launched
    from gpuflow.flows.quota import pools

    if args.action == "list":  # before a temporary API is this process's: a pass is for a server that outlives it
        from gpuflow.flows.reconcile.overdue import ask_for_a_pass_if_overdue

        ask_for_a_pass_if_overdue()
    api = temporary_api_launched()  # without a Prefect server: the warm stack's, or the database `gpuflow run` uses
    if api:
        api.ready()
    if args.action == "set":
        problem = quota_name_problem(args.pool)
        if problem or args.size < 0:
            raise SpecError([f"pool: {problem}" if problem else f"size: {args.size} is negative; give 0 or more"])
        pools.set_quota(args.pool, args.size)
        print(f"quota {args.pool}: {args.size} at once")
        warn_of_a_forgetful_server()
    elif args.action == "remove":
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(pools.LIMIT_PREFIX + args.pool)
        print(f"quota {args.pool} removed: its runs no longer wait")
    else:
        from gpuflow.flows.reconcile.quota_recount import recount

        counts = recount()  # held: what the runs truly hold, once a leak is given back
        rows = [
            (found.pool, found.size, found.counted - found.freed, len(pools.waiting_runs(found.pool)))
            for found in counts
        ]
        print(
            "no quotas: runs never wait (gpuflow quota set POOL SIZE)"
            if not rows
            else "\n".join(
                [
                    f"{'quota':<24} {'size':>5} {'held':>5} {'waiting runs':>13}",
                    *[f"{name:<24} {size:>5} {held:>5} {waiting:>13}" for name, size, held, waiting in rows],
                ]
            )
        )
        for found in counts:
            if found.freed:
                print(
                    f"quota {found.pool}: gave back {found.freed} leaked slot(s): Prefect counted {found.counted} "
                    f"held, the runs hold {found.held} (a lease the Prefect server forgot)"
                )
            elif found.note:
                print(f"quota {found.pool}: {found.note}")
    return 0


def warn_of_a_forgetful_server() -> None:
    from prefect.client.orchestration import get_client

    from gpuflow.flows.deployments.known_servers import forgetful_server

    with get_client(sync_client=True) as client:
        if warning := forgetful_server(client):
            print(f"gpuflow: warning: {warning}", file=sys.stderr)
