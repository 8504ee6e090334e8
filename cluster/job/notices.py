"""The clouds' spot interruption notices, as a node's own metadata service gives them: one table, a parser per cloud.

    cloud (lead)   what the node asks                        headers          no notice      a notice
    AWS (2 min)    GET http://169.254.169.254                X-aws-ec2-meta-  404            200 {"action": "terminate",
                   /latest/meta-data/spot/instance-action    data-token: the                 "time": "2026-11-27T04:
                   (IMDSv2: PUT /latest/api/token first,     PUT's answer                    12:00Z"}: `time` is the
                   with X-aws-ec2-metadata-token-ttl-seconds)                                deadline ("stop" too)
    GCP (30 s)     GET http://metadata.google.internal       Metadata-Flavor: 200 FALSE      200 TRUE, no time: the
                   /computeMetadata/v1/instance/preempted    Google (answers                 deadline is when seen
                                                             carry it too)                   + 30 s
    Azure (30 s+)  GET http://169.254.169.254/metadata       Metadata: true   200            an event "EventType":
                   /scheduledevents?api-version=2020-07-01                    {"Events": []} "Preempt" naming this VM
                                                                                             in Resources; NotBefore
                                                                                             (RFC 1123): the deadline

Read from the providers' documentation (EC2 "Spot Instance interruption notices" and "Use IMDSv2"; Compute Engine
"Detect if a VM was preempted"; Azure "Scheduled Events for Linux VMs"). The first request to Azure's scheduled
events turns the service on for the VM and may answer slowly: a poll that times out is simply tried again.

A node's cloud is found by asking each in turn (`detect`): the first whose service answers as that cloud's does. A
machine with none (a laptop, a Slurm node) gets None and no watcher. Tests stand a double of these services on
127.0.0.1 in for the clouds' (GPUFLOW_METADATA_URL, cluster/config.py): same paths, same answers.
"""

from __future__ import annotations

import email.utils
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

AWS_TOKEN_TTL_S = 21600
GCP_LEAD_S = 30.0  # GCP's notice says no time: the node goes about this long after it is given
AZURE_LEAD_S = 30.0  # a Preempt event without NotBefore


@dataclass(frozen=True)
class Notice:
    """A cloud's word that it takes this node: by when (epoch seconds), and what it said."""

    cloud: str
    deadline_s: float
    said: str


class NotThisCloud(Exception):
    """The service answered, but not as this cloud's would: another cloud, or no cloud at all."""


def aws_notice(status: int, body: bytes, seen_s: float) -> Notice | None:
    if status == 404:
        return None
    try:
        action = json.loads(body)
        deadline = datetime.fromisoformat(action["time"].replace("Z", "+00:00")).timestamp()
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise NotThisCloud(f"instance-action is not AWS's JSON: {body[:200]!r}") from exc
    return Notice("aws", deadline, f"{action.get('action', '?')} at {action['time']}")


def gcp_notice(status: int, body: bytes, seen_s: float) -> Notice | None:
    answer = body.decode(errors="replace").strip().upper()
    if status != 200 or answer not in ("TRUE", "FALSE"):
        raise NotThisCloud(f"preempted is not GCP's TRUE/FALSE: {status} {body[:200]!r}")
    return Notice("gcp", seen_s + GCP_LEAD_S, "preempted=TRUE") if answer == "TRUE" else None


def azure_notice(status: int, body: bytes, seen_s: float, vm_name: str | None = None) -> Notice | None:
    try:
        events = json.loads(body)["Events"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NotThisCloud(f"scheduledevents is not Azure's JSON: {status} {body[:200]!r}") from exc
    for event in events:
        if event.get("EventType") != "Preempt" or (vm_name and vm_name not in event.get("Resources", [vm_name])):
            continue
        not_before = event.get("NotBefore")
        deadline = email.utils.parsedate_to_datetime(not_before).timestamp() if not_before else seen_s + AZURE_LEAD_S
        return Notice("azure", deadline, f"Preempt {event.get('EventId', '?')} not before {not_before or '?'}")
    return None


@dataclass(frozen=True)
class Cloud:
    name: str
    base_url: str  # the node's own metadata service
    path: str
    headers: dict[str, str]
    parse: Callable[..., Notice | None]
    lead_s: float  # how long before the node goes a notice usually comes
    answer_header: tuple[str, str] | None = None  # what the service's answers carry (GCP's do)


CLOUDS = {
    "aws": Cloud("aws", "http://169.254.169.254", "/latest/meta-data/spot/instance-action", {}, aws_notice, 120.0),
    "gcp": Cloud(
        "gcp",
        "http://metadata.google.internal",
        "/computeMetadata/v1/instance/preempted",
        {"Metadata-Flavor": "Google"},
        gcp_notice,
        GCP_LEAD_S,
        ("Metadata-Flavor", "Google"),
    ),
    "azure": Cloud(
        "azure",
        "http://169.254.169.254",
        "/metadata/scheduledevents?api-version=2020-07-01",
        {"Metadata": "true"},
        azure_notice,
        AZURE_LEAD_S,
    ),
}


def fetch(url: str, headers: dict[str, str], timeout_s: float, method: str = "GET") -> tuple[int, bytes, dict]:
    """(status, body, headers) of one request; an HTTP error status is an answer too. Unreachable: OSError."""
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers or {})


@dataclass
class MetadataService:
    """One node's metadata service, asked for its cloud's notice. `base_url`: the cloud's own unless given."""

    cloud: Cloud
    base_url: str | None = None
    timeout_s: float = 2.0
    _token: str | None = field(default=None, repr=False)
    _vm_name: str | None = field(default=None, repr=False)

    @property
    def base(self) -> str:
        return (self.base_url or self.cloud.base_url).rstrip("/")

    def check(self) -> Notice | None:
        """The notice, if the cloud gave one. Raises NotThisCloud on a foreign answer, OSError if none came."""
        headers = dict(self.cloud.headers)
        if self.cloud.name == "aws":
            headers["X-aws-ec2-metadata-token"] = self._token or self.aws_token()
        status, body, answer_headers = fetch(self.base + self.cloud.path, headers, self.timeout_s)
        if status == 401 and self.cloud.name == "aws":  # the token expired: one new one
            self._token = None
            return self.check()
        if status not in (200, 404):
            raise NotThisCloud(f"{self.cloud.name}: {status} from {self.base + self.cloud.path}")
        if self.cloud.answer_header:
            name, value = self.cloud.answer_header
            if {k.lower(): v for k, v in answer_headers.items()}.get(name.lower()) != value:
                raise NotThisCloud(f"{self.cloud.name}: the answer lacks {name}: {value}")
        if self.cloud.name == "azure":
            return azure_notice(status, body, time.time(), self.azure_vm_name())
        return self.cloud.parse(status, body, time.time())

    def aws_token(self) -> str:
        status, body, _ = fetch(
            f"{self.base}/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
            self.timeout_s,
            "PUT",
        )
        if status != 200 or not body:
            raise NotThisCloud(f"aws: no IMDSv2 token ({status})")
        self._token = body.decode().strip()
        return self._token

    def azure_vm_name(self) -> str | None:
        """This VM's name, which a Preempt event lists among its Resources (None: any Preempt event counts)."""
        if self._vm_name is None:
            try:
                url = f"{self.base}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
                status, body, _ = fetch(url, {"Metadata": "true"}, self.timeout_s)
                self._vm_name = body.decode().strip() if status == 200 else ""
            except OSError:
                return None
        return self._vm_name or None


def detect(
    base_url: str | None = None, clouds: tuple[str, ...] = tuple(CLOUDS), timeout_s: float = 2.0
) -> MetadataService | None:
    """The service of the first cloud that answers as itself (its first answer already checked), or None."""
    for name in clouds:
        service = MetadataService(CLOUDS[name], base_url, timeout_s)
        try:
            service.check()
        except (NotThisCloud, OSError):
            continue
        return service
    return None
