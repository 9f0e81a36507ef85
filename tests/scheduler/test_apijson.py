"""ApiJson: the bind path's and the Lease's calls to the API server without the generated client,
sending what the generated client would (credentials, content types) and failing the same way."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from crihook.scheduler.apijson import MERGE_PATCH, ApiJson
from crihook.scheduler.cache import KubeApi
from crihook.scheduler.extender import ApiFailure
from tests.support.fakekube import FakeKube
from tests.support.tlsburst import make_ca, make_certs


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as k:
        k.create("pods", {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": []}}, "ns")
        yield k


def test_the_token_is_read_for_every_call_as_the_generated_client_reads_it(kube: FakeKube) -> None:
    """kubeconfig's exec plugins and in-cluster config renew the token through refresh_api_key_hook."""
    cfg = kube.configuration()
    tokens = iter(["one", "two"])

    def refresh(c: client.Configuration) -> None:
        c.api_key["BearerToken"] = next(tokens)

    cfg.api_key["BearerToken"] = "zero"  # as the loaders leave it
    cfg.api_key_prefix["BearerToken"] = "Bearer"
    cfg.refresh_api_key_hook = refresh
    api = ApiJson(client.ApiClient(cfg), 5.0)
    api.call("GET", "/api/v1/namespaces/ns/pods/p")
    api.call("GET", "/api/v1/namespaces/ns/pods/p")
    sent = [r.headers for r in kube.requests]
    assert [h.get("authorization") for h in sent] == ["Bearer one", "Bearer two"]
    assert all(h.get("User-Agent", "").startswith("OpenAPI-Generator/") for h in sent)
    assert all(h.get("Accept") == "application/json" for h in sent)


def test_no_credentials_no_authorization_header(kube: FakeKube) -> None:
    ApiJson(kube.api_client(), 5.0).call("GET", "/api/v1/namespaces/ns/pods/p")
    assert "authorization" not in {k.lower() for k in kube.requests[-1].headers}


def test_writes_go_as_the_generated_client_sends_them(kube: FakeKube) -> None:
    api = KubeApi(kube.api_client())
    pod = api.get_pod("ns", "p")
    meta = pod["metadata"]
    rv = api.annotate_pod("ns", "p", meta["uid"], {"a": "1"}, meta["resourceVersion"], {"l": "v"})
    assert rv != meta["resourceVersion"]
    patch = kube.requests[-1]
    assert (patch.method, patch.content_type) == ("PATCH", MERGE_PATCH)
    api.bind_pod("ns", "p", meta["uid"], "node-1", rv)
    binding = kube.requests[-1]
    assert (binding.method, binding.path, binding.content_type) == (
        "POST",
        "/api/v1/namespaces/ns/pods/p/binding",
        "application/json",
    )
    assert binding.body["metadata"] == {"name": "p", "namespace": "ns", "uid": meta["uid"], "resourceVersion": rv}
    assert kube.get("pods", "p", "ns")["spec"]["nodeName"] == "node-1"


def test_an_error_status_carries_the_api_servers_code_and_message(kube: FakeKube) -> None:
    api = KubeApi(kube.api_client())
    with pytest.raises(ApiFailure) as e:
        api.get_pod("ns", "missing")
    assert e.value.code == 404 and str(e.value) == '404 pods "missing" not found'
    uid = api.get_pod("ns", "p")["metadata"]["uid"]
    with pytest.raises(ApiFailure) as e:
        api.annotate_pod("ns", "p", uid, {"a": "1"}, "1")  # a stale resourceVersion
    assert e.value.code == 409 and "the object has been modified" in str(e.value)


def test_no_answer_is_code_0_not_an_exception_of_the_http_library() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    cfg.retries = False
    with pytest.raises(ApiFailure) as e:
        ApiJson(client.ApiClient(cfg), 2.0).call("GET", "/api/v1/namespaces/ns/pods/p")
    assert e.value.code == 0


def test_mutual_tls_and_token_from_a_kubeconfig(tmp_path: Path) -> None:
    """TLS is the client's, as load_kube_config builds it: the API server's CA, a client certificate."""
    certs = make_certs(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server_cert, certs.server_key)
    ctx.load_verify_locations(certs.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    with FakeKube(tls=ctx) as kube:
        kube.create("pods", {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": []}}, "ns")

        def api(ca: str) -> KubeApi:
            user = {"token": "secret", "client-certificate": certs.client_cert, "client-key": certs.client_key}
            doc = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": kube.url, "certificate-authority": ca}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
            path = tmp_path / "kubeconfig"
            path.write_text(yaml.safe_dump(doc))
            cfg = client.Configuration()
            config.load_kube_config(config_file=str(path), client_configuration=cfg)
            cfg.retries = False
            return KubeApi(client.ApiClient(cfg), timeout=5.0)

        assert api(certs.ca).get_pod("ns", "p")["metadata"]["name"] == "p"
        assert kube.requests[-1].headers.get("authorization") == "Bearer secret"
        other = make_ca(tmp_path, "other")[0]  # a CA that did not sign the server's certificate
        with pytest.raises(ApiFailure) as e:
            api(str(other)).get_pod("ns", "p")
        assert e.value.code == 0 and "CERTIFICATE_VERIFY_FAILED" in str(e.value)
