"""One HTTP probe for every server gpuflow asks whether it is up (a tracking server, Prefect's API)."""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request

NOT_HTTP = "not an HTTP server"


def probe(url: str, timeout_s: float) -> tuple[int | None, str]:
    """The status a GET of `url` gets (any status counts as an answer: a 401 means up, behind auth), or None and why
    nothing answered. A reply that is not HTTP/1 (another server took the port: one of Ray's gRPC servers) is
    `NOT_HTTP`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, ""
    except http.client.HTTPException:
        return None, NOT_HTTP
    except (OSError, ValueError) as exc:  # URLError is an OSError
        return None, str(getattr(exc, "reason", exc))
