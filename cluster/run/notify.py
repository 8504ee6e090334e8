"""Telling people what happened to a run: one webhook message per event, from whichever process sees it.

The flow sends at the run's end (Failed, Crashed, a `stopped_by`, and Completed when asked) and on each recovery from
a lost cluster; the job's guard when it ends an orphaned run (no flow is left to say it); the reaper for the runs
it closes. An end is said once: whoever sends it first tags the MLflow run (NOTIFIED_TAG), and the others see that.

The webhook is a Prefect Custom Webhook block (flows/notify.py loads it); here it is a plain dict (url, method,
params, headers, json_data or form_data, values), so that the job sends with no Prefect. Its URL is a secret: it
reaches the job in its environment only (JobEnv.notify_json), never a log, a tag or a file."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass

from gpuflow.cluster.protocol import NOTIFIED_TAG

PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
SEND_TIMEOUT_S = 10


EXCEPTION_LINE = re.compile(r"^\w*(Error|Exception|Interrupt)\b[^:]*: .+")
MAX_REASON_CHARS = 400


def short_reason(message: str) -> str:
    """A state's message as one line: its first, and the last exception line of a log tail it may carry."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    raised = [line.split(") ", 1)[-1] for line in lines[1:] if EXCEPTION_LINE.match(line.split(") ", 1)[-1])]
    reason = lines[0].rstrip(":;") + (f" ... {raised[-1]}" if raised else "")
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


@dataclass
class Event:
    """What happened to one run, in the words a message carries."""

    event: str  # failed, crashed, stopped, orphaned, recovered, completed
    run: str  # the Prefect flow run's name
    reason: str
    cost_usd: float | None = None
    mlflow_url: str | None = None
    prefect_url: str | None = None

    @property
    def subject(self) -> str:
        return f"gpuflow: {self.run} {self.event}"

    @property
    def body(self) -> str:
        cost = "unknown" if self.cost_usd is None else f"${self.cost_usd:.2f}"
        return "\n".join([f"reason: {short_reason(self.reason)}", f"cost so far: {cost}",
                          f"MLflow: {self.mlflow_url or '-'}", f"Prefect: {self.prefect_url or '-'}"])


def render(template, values: dict[str, str]):
    """`{{key}}` in every string of a JSON-like template replaced by its value (unknown keys left as they are)."""
    if isinstance(template, str):
        return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)
    if isinstance(template, dict):
        return {key: render(value, values) for key, value in template.items()}
    if isinstance(template, list):
        return [render(value, values) for value in template]
    return template


def send(webhook: dict, event: Event) -> str | None:
    """Posts the event to the webhook; returns None, or why it could not (a notification never fails a run)."""
    values = {**webhook.get("values", {}), **{k: "" if v is None else str(v) for k, v in asdict(event).items()},
              "subject": event.subject, "body": event.body, "name": webhook.get("name", "")}
    url = render(webhook["url"], values)  # the URL may be one of the block's secrets: "{{webhook_url}}"
    if webhook.get("params"):
        url += ("&" if "?" in url else "?") + urllib.parse.urlencode(render(webhook["params"], values))
    headers = render(webhook.get("headers") or {}, values)
    data = None
    if webhook.get("json_data") is not None:
        data = json.dumps(render(webhook["json_data"], values)).encode()
        headers.setdefault("Content-Type", "application/json")
    elif webhook.get("form_data") is not None:
        form = render(webhook["form_data"], values)
        data = (form if isinstance(form, str) else urllib.parse.urlencode(form)).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=webhook.get("method", "POST"))
    try:
        with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_S):
            return None
    except Exception as exc:  # the URL is a secret: the error names the kind of failure, not the address
        return f"notification not delivered: {type(exc).__name__}"


def send_once(client, run_id: str, webhook: dict, event: Event) -> str | None:
    """Sends the run's end event unless someone already did; then tags the run so that no one else does."""
    if client.get_run(run_id).data.tags.get(NOTIFIED_TAG):
        return None
    failure = send(webhook, event)
    if failure is None:
        client.set_tag(run_id, NOTIFIED_TAG, event.event)
    return failure


def for_the_job(webhook: dict, run: str, mlflow_url: str | None, prefect_url: str | None) -> str:
    """What the job gets (JobEnv.notify_json): the webhook, and the run's name and links for its messages."""
    return json.dumps({"webhook": webhook, "run": run, "mlflow_url": mlflow_url, "prefect_url": prefect_url})


def notify_orphaned(client, run_id: str, notify_json: str, detail: str, cost_usd: float) -> str | None:
    """The guard's message when it ends a run whose flow is gone."""
    settings = json.loads(notify_json)
    event = Event("orphaned", settings["run"], detail, cost_usd, settings["mlflow_url"], settings["prefect_url"])
    return send_once(client, run_id, settings["webhook"], event)
