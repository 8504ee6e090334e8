"""A double of a cloud's node metadata service (AWS's or GCP's) on 127.0.0.1, for the spot-notice tests.

    with metadata_double("aws") as double:          # GPUFLOW_METADATA_URL=double.url
        double.notify(node_id, in_s=30)             # the cloud's notice for that node, due in 30 s

It answers as the cloud's own does, on the same paths (cluster/job/notices.py has the table): AWS gives an IMDSv2
token to a PUT with a TTL header and refuses a GET without it (401), then 404 on spot/instance-action until a notice,
then its JSON with the time; GCP wants `Metadata-Flavor: Google` (403 without), says it on every answer, and answers
FALSE, then TRUE. Every node of a local cluster shares this one service: node N's is under <url>/<N> (a path with no
node is node ""). Nothing else is emulated: any other path is a 404, as on the clouds.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOTS = ("latest", "computeMetadata", "metadata")  # a path's first part that is the cloud's, not a node's
AWS_ACTION = "/latest/meta-data/spot/instance-action"
AWS_TOKEN = "/latest/api/token"
GCP_PREEMPTED = "/computeMetadata/v1/instance/preempted"


class MetadataDouble:
    def __init__(self, cloud: str):
        assert cloud in ("aws", "gcp"), cloud
        self.cloud = cloud
        self.deadlines: dict[str, float] = {}  # node -> when the cloud takes it (epoch seconds)
        self.polls: dict[str, int] = {}  # node -> notice requests answered
        self.tokens: set[str] = set()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def notify(self, node: str = "", in_s: float = 30.0) -> float:
        """The cloud's notice that it takes `node` in `in_s` seconds; returns the deadline (epoch seconds). AWS's
        notice says the time to the second."""
        deadline = time.time() + in_s
        self.deadlines[node] = float(int(deadline)) if self.cloud == "aws" else deadline
        return self.deadlines[node]

    def taken(self, node: str = "") -> None:
        """The cloud took `node`: a node started after it (a replacement asking the same URL, as the nodes of
        successive SkyPilot clusters on one machine do) has a service of its own, without the notice."""
        self.deadlines.pop(node, None)

    # -- the service --------------------------------------------------------------------------------------------
    def answer(self, method: str, path: str, headers) -> tuple[int, dict[str, str], bytes]:
        parts = path.split("?")[0].split("/")
        node, rest = ("", path) if len(parts) < 2 or parts[1] in ROOTS else (parts[1], "/" + "/".join(parts[2:]))
        if self.cloud == "aws":
            return self.aws(method, node, rest, headers)
        return self.gcp(method, node, rest, headers)

    def aws(self, method, node, path, headers):
        if method == "PUT" and path == AWS_TOKEN:
            if not headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return 400, {}, b""
            token = secrets.token_urlsafe(16)
            self.tokens.add(token)
            return 200, {"Content-Type": "text/plain"}, token.encode()
        if method != "GET" or not path.startswith("/latest/"):
            return 404, {}, b""
        if headers.get("X-aws-ec2-metadata-token") not in self.tokens:
            return 401, {}, b""
        if path != AWS_ACTION:
            return 404, {}, b""
        self.polls[node] = self.polls.get(node, 0) + 1
        if node not in self.deadlines:
            return 404, {"Content-Type": "text/html"}, b'<?xml version="1.0"?>Not Found'
        at = datetime.fromtimestamp(self.deadlines[node], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return 200, {"Content-Type": "text/plain"}, json.dumps({"action": "terminate", "time": at}).encode()

    def gcp(self, method, node, path, headers):
        google = {"Metadata-Flavor": "Google"}
        if path.startswith("/computeMetadata/") and headers.get("Metadata-Flavor") != "Google":
            return 403, google, b"Missing Metadata-Flavor:Google header."
        if method != "GET" or path != GCP_PREEMPTED:
            return 404, google, b""
        self.polls[node] = self.polls.get(node, 0) + 1
        return 200, {**google, "Content-Type": "application/text"}, b"TRUE" if node in self.deadlines else b"FALSE"

    def start(self) -> MetadataDouble:
        double = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self):
                status, headers, body = double.answer(self.command, self.path, self.headers)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = reply

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name=f"{self.cloud}-metadata", daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def metadata_double(cloud: str):
    """The double, serving until the block ends (then stopped: its port closed)."""
    double = MetadataDouble(cloud).start()
    try:
        yield double
    finally:
        double.stop()
