"""JSON calls to the API server over the `kubernetes` client's connection pool, with the TLS, proxy
and credentials it set up from kubeconfig or in-cluster config, but not through its generated
methods.

Those methods validate every argument, build and walk models and header tables, and parse headers
again into a response object: a bind's five calls through them cost 4 ms of CPU in the scheduler,
more than filter and prioritize together at 5,000 nodes, and the verbs waited for the cores and
the GIL behind it (docs/scheduler.md, "Serving"). Here a call is one urllib3 request on the same
pool, with the same headers the generated code would send.
"""

from __future__ import annotations

import json
from typing import Any

import urllib3

from crihook.scheduler.extender import ApiFailure

JSON_TYPE = "application/json"
MERGE_PATCH = "application/strategic-merge-patch+json"  # what the generated client sends for a dict


def failure(status: int, reason: str, body: bytes) -> ApiFailure:
    """ApiFailure with the message of the API server's Status, else the HTTP reason."""
    try:
        message = json.loads(body).get("message") or reason
    except (TypeError, ValueError, AttributeError):
        message = reason
    return ApiFailure(status, f"{status} {message}")


class ApiJson:
    """Calls through `api_client` (a kubernetes.client.ApiClient), each given up after `timeout` seconds."""

    def __init__(self, api_client: Any, timeout: float) -> None:
        self.api_client = api_client
        self.timeout = urllib3.Timeout(total=timeout)

    def call(self, method: str, path: str, body: Any = None, content_type: str = JSON_TYPE) -> dict[str, Any]:
        """The decoded answer. ApiFailure for an error status, or with code 0 when no answer came
        (refused, reset, timed out). The bearer token is read for each call, as the generated
        methods read it: kubeconfig's exec plugins and in-cluster config refresh it there."""
        api = self.api_client
        cfg = api.configuration
        headers = {**api.default_headers, "Accept": JSON_TYPE}
        if api.cookie:
            headers["Cookie"] = api.cookie
        auth = cfg.auth_settings().get("BearerToken")
        if auth and auth.get("value"):
            headers[auth["key"]] = auth["value"]
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body, separators=(",", ":")).encode()
        try:
            resp = api.rest_client.pool_manager.request(
                method, cfg.host + path, body=data, headers=headers, timeout=self.timeout
            )
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ApiFailure(0, f"{type(e).__name__}: {e}") from None
        if not 200 <= resp.status < 300:
            raise failure(resp.status, resp.reason or "", resp.data)
        doc: dict[str, Any] = json.loads(resp.data)
        return doc
