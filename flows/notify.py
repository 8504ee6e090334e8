"""The run's messages through Prefect's notification blocks: the webhook a spec names (`notify.block`), the flow's
end and recovery messages, the reaper's, and `gpuflow notify add` to make a block once for the team.

    gpuflow notify add team-alerts https://hooks.slack.com/services/T/B/X --format slack

Sending is cluster/run/notify.py's (the job's guard sends too, with no Prefect)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlflow import MlflowClient

from gpuflow.cluster.protocol import STOP_DETAIL_TAG, STOPPED_BY_TAG
from gpuflow.cluster.run.mlflow_run import runs_of_flow_run
from gpuflow.cluster.run.notify import Event, send, send_once
from gpuflow.cluster.run.record import run_url
from gpuflow.cluster.spec import ExperimentSpec, SpecError
from gpuflow.flows.run_info import flow_run_ui_url, prefect_link, spec_from

if TYPE_CHECKING:
    from gpuflow.flows.experiment_run import ExperimentRun

log = logging.getLogger(__name__)

FORMATS = {  # what a message's JSON looks like, by `gpuflow notify add --format` (Prefect's placeholders only)
    "json": {"subject": "{{subject}}", "body": "{{body}}", "text": "{{subject}}\n{{body}}"},
    "slack": {"text": "*{{subject}}*\n{{body}}"},
}


def webhook_of(block_name: str) -> dict:
    """The Custom Webhook block's settings, secrets included, as cluster/run/notify.py sends them."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock.load(block_name)
    return {"name": block.name, "url": block.url, "method": block.method, "params": block.params,
            "json_data": block.json_data, "form_data": block.form_data, "headers": block.headers,
            "values": block.secrets.get_secret_value()}


def webhook_for(spec: ExperimentSpec) -> dict | None:
    """The spec's webhook, or None; a block that cannot be loaded refuses the run before anything starts."""
    if not spec.notify:
        return None
    try:
        return webhook_of(spec.notify.block)
    except Exception as exc:
        raise SpecError([f"notify.block: {spec.notify.block!r} cannot be loaded as a Prefect Custom Webhook block "
                         f"({type(exc).__name__}); make it with `gpuflow notify add {spec.notify.block} URL` "
                         "against this Prefect API"]) from None


def main_run(client: MlflowClient, spec: ExperimentSpec, flow_run_id: str):
    """The flow run's MLflow run (not a sweep's trials), or None."""
    runs = runs_of_flow_run(client, flow_run_id, spec.experiment_name)
    return next((run for run in runs if "mlflow.parentRunId" not in run.data.tags), None)


def end_event(spec: ExperimentSpec, run, flow_run, state) -> Event:
    """The message for a flow run's end (`run`: its MLflow run, or None)."""
    stopped_by = run.data.tags.get(STOPPED_BY_TAG) if run else None
    kind = "completed" if state.is_completed() else "crashed" if state.is_crashed() else \
        (stopped_by if stopped_by == "orphaned" else "stopped") if stopped_by else "failed"
    reason = (run.data.tags.get(STOP_DETAIL_TAG) if run and stopped_by else None) or state.message or state.name
    if stopped_by:  # the flow's own stop: "Flow run encountered an exception: RunStopped: stopped by budget: ..."
        reason = f"stopped_by={stopped_by}: {reason.split('RunStopped: ', 1)[-1]}"
    return Event(kind, flow_run.name, reason, run.data.metrics.get("cost_usd") if run else None,
                 run_url(spec, run.info.run_id) if run else None,
                 prefect_link(flow_run.id, flow_run_ui_url(flow_run.id)))


def notify_end(flow, flow_run, state) -> None:
    """A flow hook (completion, failure, crash): the run's end, said once, to the spec's webhook."""
    try:
        spec = spec_from(flow_run.parameters.get("spec"), flow_run.parameters.get("spec_file"))
    except Exception:  # a spec that does not load names no webhook either: its refusal is the run's message
        return
    if not spec.notify or (state.is_completed() and not spec.notify.completed) or state.is_cancelled():
        return
    try:
        webhook = webhook_of(spec.notify.block)
        client = MlflowClient(spec.tracking_uri)
        run = main_run(client, spec, str(flow_run.id))
        event = end_event(spec, run, flow_run, state)
        failure = send_once(client, run.info.run_id, webhook, event) if run else send(webhook, event)
    except Exception as exc:  # a hook must not change the run's outcome
        failure = f"notification not sent: {type(exc).__name__}"
    if failure:
        log.warning(failure)


def notify_recovered(run: ExperimentRun, lost: str, recovery: int) -> None:
    """The run lost its cluster and relaunched it (recovery n): said to its webhook, if any."""
    if run.webhook is None:
        return
    failure = send(run.webhook, Event(
        "recovered", run.flow_run["name"], f"{lost}; relaunched, resuming from the last checkpoint (recovery "
        f"{recovery} of at most {run.spec.compute.max_recoveries})", run.life.bill()["cost_usd"],
        run_url(run.spec, run.run_id), prefect_link(run.flow_run["id"], run.flow_run["url"])))
    if failure:
        log.warning(failure)


def notify_reaped(flow_run_ids: set[str], tracking_uris: list[str]) -> None:
    """The reaper's messages for the dead runs it closed or marked Crashed, unless their job already said so."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as prefect:
        for flow_run_id in flow_run_ids:
            try:
                flow_run = prefect.read_flow_run(UUID(flow_run_id))
                spec = spec_from(flow_run.parameters.get("spec"), flow_run.parameters.get("spec_file"))
                if not spec.notify or spec.tracking_uri not in tracking_uris:
                    continue
                client = MlflowClient(spec.tracking_uri)
                run = main_run(client, spec, flow_run_id)
                event = end_event(spec, run, flow_run, Crashed(message="its process died: found by the reaper"))
                failure = send_once(client, run.info.run_id, webhook_of(spec.notify.block), event) if run else None
            except Exception as exc:  # one run's message must not stop the others'
                failure = f"notification not sent: {type(exc).__name__}"
            if failure:
                log.warning(f"reaper: flow run {flow_run_id}: {failure}")


def add_webhook(name: str, url: str, format: str = "json") -> str:
    """`gpuflow notify add`: saves a Custom Webhook block in Prefect (its secrets encrypted there, masked in its
    UI and events)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    # the URL among the block's secrets: a block's plain fields are shown in Prefect's UI and its events
    CustomWebhookNotificationBlock(name=name, url="{{webhook_url}}", secrets={"webhook_url": url},
                                   json_data=FORMATS[format]).save(name, overwrite=True)
    return f"notify block {name!r} saved ({format} messages); name it in a spec: notify: {{block: {name}}}"
