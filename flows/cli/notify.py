"""`gpuflow notify add`: a webhook for the team's run messages, saved once as a Prefect Custom Webhook block.

gpuflow notify add team-alerts https://hooks.slack.com/services/T/B/X --format slack
# then in a spec:  notify: {block: team-alerts}
"""

from __future__ import annotations

import argparse

from gpuflow.flows.run_messages import FORMATS, add_webhook


def add_parser(commands, name: str) -> None:
    command = commands.add_parser(name, help="save a webhook that runs message on failures, stops and recoveries")
    actions = command.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="save (or replace) a webhook block")
    add.add_argument("name", help="the block's name, which specs give as notify.block")
    add.add_argument("url", help="the webhook URL (kept encrypted by Prefect; never logged)")
    add.add_argument(
        "--format",
        choices=sorted(FORMATS),
        default="json",
        help="json: the event's fields and text; slack: Slack's incoming-webhook message",
    )


def run(args: argparse.Namespace) -> int:
    from gpuflow.flows.local_stack.prefect_api import temporary_api_launched

    api = temporary_api_launched()  # without a Prefect server: the database `gpuflow run` uses too
    if api:
        api.ready()
    print(add_webhook(args.name, args.url, args.format))
    return 0
