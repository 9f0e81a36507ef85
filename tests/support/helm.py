"""The real helm (fetched by tests/helm.sh) run on charts/crihook, and the value combinations the
chart documents, for tests/deploy.

`rendered(combo, version)` is `helm template` of one combination for one Kubernetes version, parsed;
`deploy_documents()` is deploy/, the chart's rendering checked in. Both give (where, document) pairs.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "crihook"
DEPLOY = ROOT / "deploy"

_spec = importlib.util.spec_from_file_location("crihook_deploy_render", DEPLOY / "render.py")
assert _spec is not None and _spec.loader is not None
render = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = render
_spec.loader.exec_module(render)

NEWEST = kubernetes_validate.latest_version()
# the oldest the chart admits: Chart.yaml's kubeVersion, ">=X.Y.Z-0"
OLDEST = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"].removeprefix(">=").split("-")[0]
SERVICE_MONITOR = "monitoring.coreos.com/v1/ServiceMonitor"
POD_MONITOR = "monitoring.coreos.com/v1/PodMonitor"

# the CA of the given-certificate combination: a throwaway self-signed one, its key not kept
GIVEN_CA = """-----BEGIN CERTIFICATE-----
MIIBjDCCATGgAwIBAgIUCi5Uik23bUby9jU1+Awu3PYKlVIwCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPZXhhbXBsZS1jb3JwLWNhMCAXDTI2MTEyNzIwNTM1M1oYDzIx
MjYxMTAzMjA1MzUzWjAaMRgwFgYDVQQDDA9leGFtcGxlLWNvcnAtY2EwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAATQ1tKl9zMHZIoZfq3Ltm01kd/waaOQz/D/L1PW
zJ7lFV32FYpmdiiDVJfOG0wF7bLmfAqZprx7g1Tt0GZrnZQJo1MwUTAdBgNVHQ4E
FgQUdOi4ifayEYozBdjnS3+7bfj/keQwHwYDVR0jBBgwFoAUdOi4ifayEYozBdjn
S3+7bfj/keQwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBGAiEAinkj
m5OBZWnaCTx51/Pd7bo/HgQRCli2Sz6DLhx6tUoCIQD72GKUqoxVTseqJOIMNd6L
jO6jyXlgctD7wZuP3quEDg==
-----END CERTIFICATE-----
"""


@dataclass(frozen=True)
class Combo:
    """One documented way to install the chart: values, and what the cluster has."""

    values: dict[str, Any] = field(default_factory=dict)
    release: str = "crihook"
    namespace: str = "crihook"
    api_versions: tuple[str, ...] = ()


COMBOS: dict[str, Combo] = {
    # the defaults: a generated certificate, a second kube-scheduler, the node DaemonSet
    "defaults": Combo(),
    "cert-manager": Combo({"tls": {"mode": "certManager"}}),
    "cert-manager-issuer": Combo(
        {"tls": {"mode": "certManager", "certManager": {"issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}}}}
    ),
    "cert-manager-external-issuer": Combo(
        {
            "tls": {
                "mode": "certManager",
                "certManager": {
                    "issuerRef": {"group": "awspca.cert-manager.io", "kind": "AWSPCAClusterIssuer", "name": "pca"}
                },
            }
        }
    ),
    "given-certificate": Combo(
        {"tls": {"mode": "secret", "secret": {"name": "corp-tls", "caBundle": GIVEN_CA, "clientSecretName": "corp-ks"}}}
    ),
    "given-certificate-no-ca": Combo(
        {"tls": {"mode": "secret", "secret": {"name": "corp-tls", "clientSecretName": "corp-ks"}}}
    ),
    "extender-stanza": Combo({"kubeScheduler": {"mode": "extender"}}),
    # extender mode with the scoring-only entry that claim pods reach crihook through
    "extender-score-claim-pods": Combo(
        {
            "kubeScheduler": {
                "mode": "extender",
                "scoreClaimPods": {"enabled": True, "weight": 3, "httpTimeout": "500ms"},
            }
        }
    ),
    "network-policy": Combo({"networkPolicy": {"enabled": True}}),
    "no-node": Combo({"node": {"enabled": False}}),
    "dra": Combo({"dra": {"enabled": True, "extendedResourceName": "nvidia.com/gpu", "consumableCapacity": "on"}}),
    "dra-convert": Combo(
        {"dra": {"enabled": True, "convert": {"enabled": True, "nodePool": "pool=dra", "gpuMemory": "80Gi"}}}
    ),
    # nodes that run `crihook serve` and `crihook dra` from install.sh: the DeviceClass only
    "dra-no-node": Combo({"node": {"enabled": False}, "dra": {"enabled": True}}),
    "node-without-reporter": Combo(
        {
            "node": {"reporter": {"enabled": False}, "driverRoot": "", "runtimeSocket": ""},
            "metrics": {"node": {"port": 0}},
        }
    ),
    "node-gpu-operator": Combo(
        {
            "node": {
                "driverRoot": "/run/nvidia/driver",
                "nri": {"pluginIndex": 20},
                "updateStrategy": {"type": "OnDelete"},
                "nodeSelector": {"pool": "gpu"},
            }
        }
    ),
    "service-monitor": Combo(api_versions=(SERVICE_MONITOR, POD_MONITOR)),
    "node-metrics-loopback": Combo({"metrics": {"node": {"port": 0}}}, api_versions=(POD_MONITOR,)),
    "node-metrics-given-certificate": Combo(
        {"metrics": {"node": {"tls": {"mode": "secret", "secret": {"name": "metrics-tls"}, "serverName": "gpu.corp"}}}},
        api_versions=(POD_MONITOR,),
    ),
    "node-metrics-cert-manager": Combo(
        {"tls": {"mode": "certManager"}, "metrics": {"node": {"tls": {"mode": "certManager"}}}},
        api_versions=(POD_MONITOR,),
    ),
    "kube-system": Combo(namespace="kube-system", values={"webhooks": {"excludeNamespaces": ["monitoring"]}}),
    "other-release-name": Combo(release="gpu", values={"scheduler": {"replicas": 3}}),
    "scheduler-spread-preferred": Combo({"scheduler": {"antiAffinity": "preferred"}}),
    "scheduler-spread-none": Combo({"scheduler": {"antiAffinity": "none"}}),
    # Helm's longest release name (53), with every object the chart can make
    "long-release-name": Combo(release="a" * 53, api_versions=(SERVICE_MONITOR, POD_MONITOR)),
    "everything-set": Combo(
        {
            "imagePullSecrets": [{"name": "regcred"}],
            "scheduler": {"podLabels": {"team": "ml"}, "podAnnotations": {"a": "b"}, "priorityClassName": ""},
            "webhooks": {
                "mutating": {"failurePolicy": "Ignore"},
                "timeoutSeconds": 10,
                "namespaceSelector": [{"key": "gpu", "operator": "In", "values": ["yes"]}],
                "objectSelector": {"matchLabels": {"gpu": "yes"}},
            },
            "kubeScheduler": {
                "deployment": {"image": {"tag": "v1.33.2"}, "tolerations": [{"operator": "Exists"}]},
                "scoreClaimPods": {"enabled": True},
            },
            "node": {"runtimeClassName": "nvidia", "config": {"proxy": {"log_level": "debug"}}},
            "metrics": {"podAnnotations": False, "serviceMonitor": {"labels": {"release": "prom"}}},
            "networkPolicy": {
                "enabled": True,
                "from": [
                    {"ipBlock": {"cidr": "10.0.0.0/24"}},
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
                ],
            },
        },
        api_versions=(SERVICE_MONITOR,),
    ),
}


def helm() -> str:
    """The helm binary, or the test is skipped with tests/helm.sh's reason."""
    cache = Path(render.helm_binary()).parent
    binary = cache / "helm"
    if not binary.is_file():
        why = (cache / "unavailable").read_text().strip() if (cache / "unavailable").is_file() else "not fetched"
        pytest.skip(f"no helm ({why}): bash tests/helm.sh fetches it")
    return str(binary)


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([helm(), *args], capture_output=True, text=True)
    assert not check or out.returncode == 0, f"helm {' '.join(args)}: {out.stderr}"
    return out


def values_args(values: dict[str, Any]) -> list[str]:
    """Values as helm's --set-json, one top-level key each (JSON keeps types exact)."""
    return [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]


def template_text(combo: Combo, version: str, *extra: str) -> str:
    args = ["template", combo.release, str(CHART), "--namespace", combo.namespace, "--kube-version", version]
    for api in combo.api_versions:
        args += ["--api-versions", api]
    return run(*args, *values_args(combo.values), *extra).stdout


def documents_of(text: str, where: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{where}#{i}", d) for i, d in enumerate(yaml.safe_load_all(text)) if d is not None]


@functools.cache
def rendered(name: str, version: str = NEWEST) -> list[tuple[str, dict[str, Any]]]:
    return documents_of(template_text(COMBOS[name], version), f"{name}@{version}")


def deploy_documents() -> list[tuple[str, dict[str, Any]]]:
    """deploy/'s manifests: the rendered ones and the examples (not the image build or the values)."""
    return [
        (f"{p.relative_to(DEPLOY)}#{i}", d)
        for p in sorted(DEPLOY.rglob("*.yaml"))
        if p != render.VALUES
        for i, d in enumerate(yaml.safe_load_all(p.read_text()))
        if d is not None
    ]


def of_kind(docs: list[tuple[str, dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [d for _, d in docs if d.get("kind") == kind]


def scheduler_configs(docs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The KubeSchedulerConfiguration files the ConfigMaps carry (kube-scheduler's --config)."""
    found = []
    for cm in of_kind(docs, "ConfigMap"):
        for text in (cm.get("data") or {}).values():
            doc = yaml.safe_load(text) if "KubeSchedulerConfiguration" in text else None
            if isinstance(doc, dict) and doc.get("kind") == "KubeSchedulerConfiguration":
                found.append(doc)
    return found


# Kinds of CRDs the chart uses but does not install, which kubernetes-validate has no schema for:
# the fields the chart sets, as the projects' CRDs define them (cert-manager's
# deploy/crds/crd-certificates.yaml and crd-issuers.yaml, cert-manager.io/v1; prometheus-operator's
# example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml), and no others, so a
# misspelt field fails here as the API server would refuse it.
def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": list(required)}


_STR = {"type": "string"}
_META = {"type": "object", "required": ["name"]}
_PROMETHEUS_DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_ISSUER_REF = _strict({"name": _STR, "kind": _STR, "group": _STR}, ("name",))
_USAGES = [
    "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
    "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
    "server auth", "client auth", "code signing", "email protection", "s/mime", "ipsec end system",
    "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
]  # fmt: skip
CRD_KINDS: dict[tuple[str, str], dict[str, Any]] = {
    ("cert-manager.io/v1", "Certificate"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": _strict(
                {
                    "secretName": _STR,
                    "issuerRef": _ISSUER_REF,
                    "dnsNames": {"type": "array", "items": _STR},
                    "commonName": _STR,
                    "isCA": {"type": "boolean"},
                    "duration": _STR,
                    "renewBefore": _STR,
                    "usages": {"type": "array", "items": {"enum": _USAGES}},
                    "privateKey": _strict(
                        {"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"}}
                    ),
                },
                ("secretName", "issuerRef"),
            ),
        },
        ("metadata", "spec"),
    ),
    ("cert-manager.io/v1", "Issuer"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": {
                "oneOf": [
                    _strict({"selfSigned": {"type": "object"}}, ("selfSigned",)),
                    _strict({"ca": _strict({"secretName": _STR}, ("secretName",))}, ("ca",)),
                ]
            },
        },
        ("metadata", "spec"),
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": _strict(
                {
                    "selector": {"type": "object"},
                    "endpoints": {
                        "type": "array",
                        "items": _strict(
                            {
                                "port": _STR,
                                "scheme": {"enum": ["http", "https"]},
                                "path": _STR,
                                "interval": {"type": "string", "pattern": _PROMETHEUS_DURATION},
                                "tlsConfig": _strict(
                                    {
                                        "serverName": _STR,
                                        "ca": _strict({"secret": _strict({"name": _STR, "key": _STR}, ("key",))}),
                                    }
                                ),
                            }
                        ),
                    },
                },
                ("selector",),
            ),
        },
        ("metadata", "spec"),
    ),
    # the fields of prometheus-operator's PodMonitor CRD the chart writes (monitoring.coreos.com_podmonitors.yaml)
    ("monitoring.coreos.com/v1", "PodMonitor"): _strict(
        {
            "apiVersion": _STR,
            "kind": _STR,
            "metadata": _META,
            "spec": _strict(
                {
                    "selector": {"type": "object"},
                    "podMetricsEndpoints": {
                        "type": "array",
                        "items": _strict(
                            {
                                "port": _STR,
                                "scheme": {"enum": ["http", "https"]},
                                "path": _STR,
                                "interval": {"type": "string", "pattern": _PROMETHEUS_DURATION},
                                "honorLabels": {"type": "boolean"},
                                # SafeTLSConfig
                                "tlsConfig": _strict(
                                    {
                                        "serverName": _STR,
                                        "insecureSkipVerify": {"type": "boolean"},
                                        "ca": _strict({"secret": _strict({"name": _STR, "key": _STR}, ("key",))}),
                                    }
                                ),
                                "authorization": _strict(
                                    {
                                        "type": _STR,
                                        "credentials": _strict({"name": _STR, "key": _STR}, ("key",)),
                                    }
                                ),
                            }
                        ),
                    },
                },
                ("selector",),
            ),
        },
        ("metadata", "spec"),
    ),
}


def api_problem(doc: dict[str, Any], version: str) -> str | None:
    """Why the API server of that Kubernetes version would refuse the document, or None."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_KINDS:
        try:
            jsonschema.validate(doc, CRD_KINDS[key])  # type: ignore[index]
        except jsonschema.ValidationError as e:
            return f"{key} invalid: {e.message}"
        return None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{key} invalid for Kubernetes {version}: {e}"
    except kubernetes_validate.SchemaNotFoundError:
        return f"Kubernetes {version} has no {key}"
    return None
