"""Who may read the node's metrics, decided as kube-rbac-proxy decides it: the caller's bearer token
goes to the API server's TokenReview, and the user it names to a SubjectAccessReview for `get` on
the non-resource URL (`/metrics`). Prometheus' service account holds that permission in the usual
setups (a ClusterRole with `nonResourceURLs: ["/metrics"]`), so a Kubernetes scrape configuration
works unchanged, and nobody else on the pod network reads the pod and namespace names the series
carry.

Answers are cached per token (a hash of it) for a minute, refusals for ten seconds, so a scrape
every few seconds costs the API server two calls a minute at most; the cache is bounded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("crihook.kubeauth")

ALLOWED_TTL = 60.0
REFUSED_TTL = 10.0
CACHE_SIZE = 256
REQUEST_TIMEOUT = 5.0


@dataclass(frozen=True)
class Verdict:
    """200 (allowed), 401 (no valid token) or 403 (a valid token, not allowed); `why` for the log."""

    code: int
    why: str = ""


class KubeAuthorizer:
    """`check(token)` -> Verdict, blocking (call it from a thread). `api_client` is a kubernetes
    ApiClient with the right to create tokenreviews and subjectaccessreviews (the
    system:auth-delegator ClusterRole)."""

    def __init__(
        self, api_client: Any, path: str = "/metrics", verb: str = "get", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api_client = api_client
        self.path = path
        self.verb = verb
        self.clock = clock
        self._cache: OrderedDict[str, tuple[float, Verdict]] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, token: str) -> Verdict:
        if not token:
            return Verdict(401, "no bearer token")
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        verdict = self._review(token)
        if verdict.code in (200, 401, 403):
            with self._lock:
                self._cache[key] = (now + (ALLOWED_TTL if verdict.code == 200 else REFUSED_TTL), verdict)
                self._cache.move_to_end(key)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return verdict

    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(resp.data)
        return doc

    def _review(self, token: str) -> Verdict:
        from kubernetes import client

        opts: dict[str, Any] = {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT}
        try:
            # raw JSON bodies, as the client sends them (its models would be a round trip for nothing)
            token_review: Any = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            }
            review = self._json(client.AuthenticationV1Api(self.api_client).create_token_review(token_review, **opts))
            status = review.get("status") or {}
            if not status.get("authenticated"):
                return Verdict(401, status.get("error") or "token not authenticated")
            user = status.get("user") or {}
            spec: dict[str, Any] = {
                "user": user.get("username", ""),
                "groups": user.get("groups") or [],
                "nonResourceAttributes": {"path": self.path, "verb": self.verb},
            }
            if user.get("uid"):
                spec["uid"] = user["uid"]
            if user.get("extra"):
                spec["extra"] = user["extra"]
            access_review: Any = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}
            access = self._json(
                client.AuthorizationV1Api(self.api_client).create_subject_access_review(access_review, **opts)
            )
        except Exception as e:  # the API server away or refusing us: this scrape fails, the next asks again
            log.warning("metrics caller not checked: the API server did not answer", extra={"error": str(e)})
            return Verdict(503, f"authorization unavailable: {e}")
        if (access.get("status") or {}).get("allowed"):
            return Verdict(200, spec["user"])
        return Verdict(403, f"{spec['user']} may not {self.verb} {self.path}")
