"""Telling people what happened to a run: one webhook message per event, from whichever process sees it.

The flow sends at the run's end (Failed, Crashed, a `stopped_by`, and Completed when asked) and on each recovery from
a lost cluster; the job's guard when it ends an orphaned run (no flow is left to say it); the reaper for the runs
it closes. An end is said once: whoever sends it first tags the MLflow run (NOTIFIED_TAG), and the others see that.

The webhook is a Prefect Custom Webhook block (flows/run_messages.py loads it); here it is a plain dict (url, method,
params, headers, json_data or form_data, values), so that the job sends with no Prefect. Its URL is a secret: it
reaches the job in its environment only (JobEnv.notify_json), never a log, a tag or a file.

At least once, said once: `send` retries a webhook that is down for up to RETRY_BOUND_S; `send_once` claims the
run's message (NOTIFY_SENDING_TAG) before sending and records the outcome on the run (NOTIFIED_TAG, or
NOTIFY_FAILED_TAG); what no one delivered, the reaper's next pass sends (flows/run_messages.py: notify_undelivered),
one try a message: the passes are its retries, and a webhook down does not hold a pass for minutes a message."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from gpuflow.cluster.protocol import NOTIFIED_TAG, NOTIFY_FAILED_TAG, NOTIFY_SENDING_TAG
from gpuflow.cluster.util.processes import started_at, still_the_process

log = logging.getLogger(__name__)

PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*\}\}")
SEND_TIMEOUT_S = 10  # one try
RETRY_BOUND_S = 120.0  # all the tries of one message: 1, 2, 4, 8 ... s apart
FIRST_RETRY_S = 1.0
CLAIM_SETTLE_S = 0.5  # between writing a claim and reading it back: a rival's write lands in between
RETRIED_HTTP = {408, 429}  # the 4xx worth another try; any other 4xx will not change


EXCEPTION_LINE = re.compile(r"^\w*(Error|Exception|Interrupt)\b[^:]*: .+")
MAX_REASON_CHARS = 400


def short_reason(message: str) -> str:
    """A state's message as one line: its first, and the last exception line of a log tail it may carry."""
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    raised = [line.split(") ", 1)[-1] for line in lines[1:] if EXCEPTION_LINE.match(line.split(") ", 1)[-1])]
    reason = lines[0].rstrip(":;") + (f" ... {raised[-1]}" if raised else "")
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


@dataclass
class Event:
    """What happened to one run, in the words a message carries."""

    event: str  # failed, crashed, stopped, orphaned, recovered, completed
    run: str  # the Prefect flow run's name
    reason: str
    cost_usd: float | None = None
    mlflow_url: str | None = None
    prefect_url: str | None = None
    # The same for every message of one event of one run, whoever sends it: a receiver drops a repeat by it (the
    # Idempotency-Key header). A run has one end; its recoveries are numbered.
    dedupe_key: str | None = None

    def __post_init__(self):
        self.dedupe_key = self.dedupe_key or f"{self.run}:end"

    @property
    def subject(self) -> str:
        return f"gpuflow: {self.run} {self.event}"

    @property
    def body(self) -> str:
        cost = "unknown" if self.cost_usd is None else f"${self.cost_usd:.2f}"
        return "\n".join(
            [
                f"reason: {short_reason(self.reason)}",
                f"cost so far: {cost}",
                f"MLflow: {self.mlflow_url or '-'}",
                f"Prefect: {self.prefect_url or '-'}",
            ]
        )


def render(template, values: dict[str, str]):
    """`{{key}}` in every string of a JSON-like template replaced by its value (unknown keys left as they are)."""
    if isinstance(template, str):
        return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)
    if isinstance(template, dict):
        return {key: render(value, values) for key, value in template.items()}
    if isinstance(template, list):
        return [render(value, values) for value in template]
    return template


def send(webhook: dict, event: Event, retry_for_s: float | None = None) -> str | None:
    """Posts the event to the webhook, retrying for retry_for_s (RETRY_BOUND_S by default; 0: one try); returns
    None, or why it could not (a notification never fails a run)."""
    values = {
        **webhook.get("values", {}),
        **{k: "" if v is None else str(v) for k, v in asdict(event).items()},
        "subject": event.subject,
        "body": event.body,
        "name": webhook.get("name", ""),
    }
    url = render(webhook["url"], values)  # the URL may be one of the block's secrets: "{{webhook_url}}"
    if webhook.get("params"):
        url += ("&" if "?" in url else "?") + urllib.parse.urlencode(render(webhook["params"], values))
    headers = render(webhook.get("headers") or {}, values)
    headers.setdefault("Idempotency-Key", event.dedupe_key)
    data = None
    if webhook.get("json_data") is not None:
        data = json.dumps(render(webhook["json_data"], values)).encode()
        headers.setdefault("Content-Type", "application/json")
    elif webhook.get("form_data") is not None:
        form = render(webhook["form_data"], values)
        data = (form if isinstance(form, str) else urllib.parse.urlencode(form)).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=webhook.get("method", "POST"))
    retry_for_s = RETRY_BOUND_S if retry_for_s is None else retry_for_s
    deadline, delay, tries = time.monotonic() + retry_for_s, FIRST_RETRY_S, 0
    while True:
        tries += 1
        timeout_s = SEND_TIMEOUT_S if tries == 1 else max(0.1, min(SEND_TIMEOUT_S, deadline - time.monotonic()))
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                return None
        except Exception as exc:
            error, final = failure_of(exc)
        left = deadline - time.monotonic()
        if final or left <= 0:
            return f"notification not delivered after {tries} tries: {error}"
        log.warning(
            f"notification of {event.run} ({event.event}): try {tries} failed: {error}; again in {min(delay, left):g} s"
        )
        time.sleep(min(delay, left))
        delay *= 2


def failure_of(exc: Exception) -> tuple[str, bool]:
    """(what failed, in words that never name the URL: it is a secret; whether another try cannot help)."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}", 400 <= exc.code < 500 and exc.code not in RETRIED_HTTP
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, Exception):
        return type(exc.reason).__name__, False
    if isinstance(exc, ValueError):  # a malformed URL (unknown url type): the block must be fixed
        return f"{type(exc).__name__} (check the block's URL)", True
    return type(exc).__name__, False


def send_once(client, run_id: str, webhook: dict, event: Event, retry_for_s: float | None = None) -> str | None:
    """Sends the run's end event unless it is delivered already or someone else is sending it now; records on the
    run what came of it: delivered (NOTIFIED_TAG) or the failure (NOTIFY_FAILED_TAG), for the reaper to retry."""
    if not claim(client, run_id):
        return None
    failure = None
    try:
        failure = send(webhook, event, retry_for_s)
    except Exception as exc:  # e.g. a template that does not render: recorded like any failure
        failure = f"notification not sent: {type(exc).__name__}"
    finally:
        if failure is None:
            client.set_tag(run_id, NOTIFIED_TAG, f"{event.event} {utc_now()}")
        else:
            client.set_tag(run_id, NOTIFY_FAILED_TAG, f"{utc_now()} {failure}")
        client.delete_tag(run_id, NOTIFY_SENDING_TAG)
    return failure


def claim(client, run_id: str) -> bool:
    """Takes the run's message for this process: nobody delivered it, nobody else holds a live claim, and our claim is
    the one read back."""
    if not may_claim(client.get_run(run_id).data.tags, time.time()):
        return False
    mine = f"{time.time():.3f} {uuid.uuid4().hex} {socket.gethostname()} {os.getpid()} {started_at()}"
    try:
        client.set_tag(run_id, NOTIFY_SENDING_TAG, mine)
    except Exception:  # e.g. a rival's claim written at the same instant (a unique key): reading back decides
        pass
    time.sleep(CLAIM_SETTLE_S)
    return client.get_run(run_id).data.tags.get(NOTIFY_SENDING_TAG) == mine


def may_claim(tags: dict[str, str], now: float) -> bool:
    """A claim is dead once its sender is: on this host, as soon as its process is gone (a serve stopped while a
    run's end hook sent); from another host, once older than one whole send."""
    if tags.get(NOTIFIED_TAG):
        return False
    held = tags.get(NOTIFY_SENDING_TAG)
    if held is None:
        return True
    try:
        claimed_at, _token, *sender = held.split()
        here = len(sender) == 3 and sender[0] == socket.gethostname() and sender[2] != "None"
        if here and not still_the_process(int(sender[1]), float(sender[2])):
            return True
        return now - float(claimed_at) > RETRY_BOUND_S + SEND_TIMEOUT_S
    except ValueError:  # not a claim of ours
        return True


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def for_the_job(webhook: dict, run: str, mlflow_url: str | None, prefect_url: str | None) -> str:
    """What the job gets (JobEnv.notify_json): the webhook, and the run's name and links for its messages."""
    return json.dumps({"webhook": webhook, "run": run, "mlflow_url": mlflow_url, "prefect_url": prefect_url})


def notify_orphaned(client, run_id: str, notify_json: str, detail: str, cost_usd: float) -> str | None:
    """The guard's message when it ends a run whose flow is gone."""
    settings = json.loads(notify_json)
    event = Event("orphaned", settings["run"], detail, cost_usd, settings["mlflow_url"], settings["prefect_url"])
    return send_once(client, run_id, settings["webhook"], event)
