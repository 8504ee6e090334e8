"""The run's messages through Prefect's notification blocks: the webhook a spec names (`notify.block`), the flow's
end and recovery messages, the reaper's, and `gpuflow notify add` to make a block once for the team.

    gpuflow notify add team-alerts https://hooks.slack.com/services/T/B/X --format slack

Sending is cluster/run/webhook.py's (the job's guard sends too, with no Prefect)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from mlflow import MlflowClient

from gpuflow.cluster.protocol import FLOW_RUN_TAG, NOTIFIED_TAG, NOTIFY_BLOCK_TAG, STOP_DETAIL_TAG, STOPPED_BY_TAG
from gpuflow.cluster.run.mlflow_run import runs_of_flow_run
from gpuflow.cluster.run.record import run_url
from gpuflow.cluster.run.webhook import Event, send, send_once
from gpuflow.cluster.spec import ExperimentSpec, SpecError
from gpuflow.cluster.util.local_store import store_exists
from gpuflow.flows.quota.pools import every_flow_run
from gpuflow.flows.run_spec import spec_from
from gpuflow.flows.run_tags import flow_run_ui_url, prefect_link

if TYPE_CHECKING:
    from gpuflow.flows.experiment_run import ExperimentRun

log = logging.getLogger(__name__)

FORMATS = {  # what a message's JSON looks like, by `gpuflow notify add --format` (Prefect's placeholders only)
    "json": {"subject": "{{subject}}", "body": "{{body}}", "text": "{{subject}}\n{{body}}"},
    "slack": {"text": "*{{subject}}*\n{{body}}"},
}


def webhook_of(block_name: str) -> dict:
    """The Custom Webhook block's settings, secrets included, as cluster/run/webhook.py sends them."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    block = CustomWebhookNotificationBlock.load(block_name)
    return {
        "name": block.name,
        "url": block.url,
        "method": block.method,
        "params": block.params,
        "json_data": block.json_data,
        "form_data": block.form_data,
        "headers": block.headers,
        "values": block.secrets.get_secret_value(),
    }


def webhook_for(spec: ExperimentSpec) -> dict | None:
    """The spec's webhook, or None; a block that cannot be loaded refuses the run before anything starts."""
    if not spec.notify:
        return None
    try:
        return webhook_of(spec.notify.block)
    except Exception as exc:
        raise SpecError(
            [
                f"notify.block: {spec.notify.block!r} cannot be loaded as a Prefect Custom Webhook block "
                f"({type(exc).__name__}); make it with `gpuflow notify add {spec.notify.block} URL` "
                "against this Prefect API"
            ]
        ) from None


def main_run(client: MlflowClient, spec: ExperimentSpec, flow_run_id: str):
    """The flow run's MLflow run (not a sweep's trials), or None."""
    runs = runs_of_flow_run(client, flow_run_id, spec.experiment_name)
    return next((run for run in runs if "mlflow.parentRunId" not in run.data.tags), None)


def end_event(spec: ExperimentSpec, run, flow_run, state) -> Event:
    """The message for a flow run's end (`run`: its MLflow run, or None)."""
    stopped_by = run.data.tags.get(STOPPED_BY_TAG) if run else None
    kind = (
        "completed"
        if state.is_completed()
        else "crashed"
        if state.is_crashed()
        else (stopped_by if stopped_by == "orphaned" else "stopped")
        if stopped_by
        else "failed"
    )
    reason = (run.data.tags.get(STOP_DETAIL_TAG) if run and stopped_by else None) or state.message or state.name
    if stopped_by:  # the flow's own stop: "Flow run encountered an exception: RunStopped: stopped by budget: ..."
        reason = f"stopped_by={stopped_by}: {reason.split('RunStopped: ', 1)[-1]}"
    return Event(
        kind,
        flow_run.name,
        reason,
        run.data.metrics.get("cost_usd") if run else None,
        run_url(spec, run.info.run_id) if run else None,
        prefect_link(flow_run.id, flow_run_ui_url(flow_run.id)),
    )


def says(spec: ExperimentSpec, state) -> bool:
    """Whether a run's end is one its webhook hears: not a cancel (the user asked for it), a completion if asked."""
    return bool(spec.notify) and not state.is_cancelled() and (not state.is_completed() or spec.notify.completed)


def notify_end(flow, flow_run, state) -> None:
    """A flow hook (completion, failure, crash): the run's end, said once, to the spec's webhook."""
    try:
        spec = spec_from(flow_run.parameters.get("spec"), flow_run.parameters.get("spec_file"))
    except Exception:  # a spec that does not load names no webhook either: its refusal is the run's message
        return
    if not says(spec, state) or (state.is_crashed() and cancel_asked(flow_run)):
        return
    run = None
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
        if not (run and run.info.status in RETRIED_STATUSES):  # else its MLflow run says it is owed
            owe_message(flow_run)


def owe_message(flow_run) -> None:
    """Tags the flow run as owed its end's message: the reaper's next pass says it (notify_owed)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            tags = client.read_flow_run(flow_run.id).tags
            client.update_flow_run(flow_run.id, tags=sorted({*tags, OWED_TAG}))
    except Exception as exc:  # Prefect's API down too: nothing left to record it in
        log.warning(f"the message owed is recorded nowhere: {type(exc).__name__}")


def cancel_asked(flow_run) -> bool:
    """Whether the user cancelled the run: a runner that kills a run whose cancel timed out calls its crash hooks,
    and Prefect then ends it Cancelled, an end that is never messaged."""
    from prefect.client.orchestration import get_client

    from gpuflow.flows.cancel_watch import CANCEL_STATES

    try:
        with get_client(sync_client=True) as client:
            current = client.read_flow_run(flow_run.id).state
    except Exception:
        current = flow_run.state
    return bool(current and current.type in CANCEL_STATES)


def notify_recovered(run: ExperimentRun, lost: str, recovery: int) -> None:
    """The run lost its cluster and relaunched it (recovery n): said to its webhook, if any."""
    if run.webhook is None:
        return
    failure = send(
        run.webhook,
        Event(
            "recovered",
            run.flow_run["name"],
            f"{lost}; relaunched, resuming from the last checkpoint (recovery "
            f"{recovery} of at most {run.spec.compute.max_recoveries})",
            run.life.bill()["cost_usd"],
            run_url(run.spec, run.run_id),
            prefect_link(run.flow_run["id"], run.flow_run["url"]),
            dedupe_key=f"{run.flow_run['name']}:recovered:{recovery}",
        ),
    )
    if failure:
        log.warning(failure)


RETRIED_STATUSES = ("FAILED", "KILLED")  # MLflow runs whose undelivered end a pass finds there (notify_undelivered)
PASS_RETRY_FOR_S = 0.0  # a pass tries each message once: the next pass is its retry, not minutes of this one
UNSAID_WITHIN_S = 3 * 24 * 3600  # an end older than this is no news any more: the reaper stops trying to say it


def notify_undelivered(tracking_uris: list[str]) -> list[str]:
    """The reaper's pass: each run that ended badly, names a webhook and has no delivery recorded (its sender died,
    or the webhook was down for all of its tries) gets its message, once. Returns what happened, a line per run."""
    from mlflow.entities import ViewType
    from prefect.client.orchestration import get_client

    since_ms = int((time.time() - UNSAID_WITHIN_S) * 1000)
    unsaid = (
        f"tags.`{NOTIFY_BLOCK_TAG}` IS NOT NULL AND tags.`{NOTIFIED_TAG}` IS NULL AND attributes.end_time > {since_ms}"
    )
    said = []
    with get_client(sync_client=True) as prefect:
        for uri in tracking_uris:
            try:
                client = MlflowClient(uri)
                experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
                runs = (
                    [
                        run
                        for status in RETRIED_STATUSES
                        for run in client.search_runs(
                            experiments, f"attributes.status = '{status}' AND {unsaid}", max_results=500
                        )
                    ]
                    if experiments
                    else []
                )
            except Exception as exc:  # one store down: the others' messages still go
                said.append(f"{uri}: cannot read its runs: {type(exc).__name__}")
                continue
            said += [line for run in runs if (line := say_unsaid(prefect, client, run))]
    return said


def say_unsaid(prefect, client: MlflowClient, run) -> str | None:
    """One run's end, sent unless its flow is still ending (its hook says it) or its end is not one to say."""
    from uuid import UUID

    from prefect.exceptions import ObjectNotFound

    flow_run_id = run.data.tags.get(FLOW_RUN_TAG)
    if not flow_run_id:
        return None
    try:
        flow_run = prefect.read_flow_run(UUID(flow_run_id))
        spec = spec_from(flow_run.parameters.get("spec"), flow_run.parameters.get("spec_file"))
        if not (flow_run.state and flow_run.state.is_final() and says(spec, flow_run.state)):
            return None
        event = end_event(spec, run, flow_run, flow_run.state)
        failure = send_once(client, run.info.run_id, webhook_of(spec.notify.block), event, PASS_RETRY_FOR_S)
    except ObjectNotFound:  # no flow run, no spec: nothing to say it with
        return None
    except Exception as exc:  # one run's message must not stop the others'
        failure = f"notification not sent: {type(exc).__name__}"
    if failure:
        return f"flow run {flow_run_id}: {failure}"
    return (
        f"flow run {flow_run_id}: message delivered"
        if client.get_run(run.info.run_id).data.tags.get(NOTIFIED_TAG)
        else None
    )


OWED_TAG = "notify-owed"  # a flow run whose end's message is owed until delivered: the reaper marked it Crashed, or
# its own end hook could not say it


def notify_owed() -> list[str]:
    """The reaper's pass: the ends of the flow runs it marked Crashed (they ran no hook) and of those whose hook could
    not say it: through their MLflow run where they have one (its delivery recorded there, so said once whoever says
    it), else as such (a run that ended before its MLflow run opened: refused, waiting for GPUs, provisioning). The
    tag is dropped once the end is delivered, or is no news any more (UNSAID_WITHIN_S)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    said = []
    with get_client(sync_client=True) as prefect:
        for flow_run in every_flow_run(prefect, flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[OWED_TAG]))):
            try:
                spec = spec_from(flow_run.parameters.get("spec"), flow_run.parameters.get("spec_file"))
                failure = None
                stale = flow_run.state.timestamp.timestamp() < time.time() - UNSAID_WITHIN_S
                if says(spec, flow_run.state) and not stale:
                    client = MlflowClient(spec.tracking_uri) if store_exists(spec.tracking_uri) else None
                    run = client and main_run(client, spec, str(flow_run.id))
                    event, webhook = end_event(spec, run, flow_run, flow_run.state), webhook_of(spec.notify.block)
                    failure = (
                        send_once(client, run.info.run_id, webhook, event, PASS_RETRY_FOR_S)
                        if run
                        else send(webhook, event, PASS_RETRY_FOR_S)
                    )
                    said.append(f"flow run {flow_run.id}: {failure or 'message delivered'}")
            except Exception as exc:  # one run's message must not stop the others'
                failure = f"notification not sent: {type(exc).__name__}"
                said.append(f"flow run {flow_run.id}: {failure}")
            if not failure:
                prefect.update_flow_run(flow_run.id, tags=[tag for tag in flow_run.tags if tag != OWED_TAG])
    return said


def add_webhook(name: str, url: str, format: str = "json") -> str:
    """`gpuflow notify add`: saves a Custom Webhook block in Prefect (its secrets encrypted there, masked in its
    UI and events)."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    # the URL among the block's secrets: a block's plain fields are shown in Prefect's UI and its events
    CustomWebhookNotificationBlock(
        name=name, url="{{webhook_url}}", secrets={"webhook_url": url}, json_data=FORMATS[format]
    ).save(name, overwrite=True)
    return f"notify block {name!r} saved ({format} messages); name it in a spec: notify: {{block: {name}}}"
