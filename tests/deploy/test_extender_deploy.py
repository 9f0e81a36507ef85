"""The cluster manifests, deploy/ and the chart's rendering of every documented value combination:
every manifest parses and fits a minimal schema of its kind (the fields the API server or
kube-scheduler would refuse it without), the pieces agree with each other and with the code (names,
ports, paths, verbs, resource names, RBAC against what the scheduler calls), and every example pod
goes through the admission webhook and the allocator's PreFilter."""

from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from crihook.scheduler import ha, server, webhook
from crihook.scheduler.extender import Extender
from crihook.scheduler.pod import pod_from_json
from crihook.scheduler.request import DEVICE_RESOURCES
from tests.support import helm
from tests.support.extender import cluster_plugin
from tests.support.fakekube import json_patch

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = DEPLOY / "examples"
# the pods the extender places, one file per seed; the DRA driver's claims and pods (005-dra.yaml) are
# placed by kube-scheduler's own allocator and checked against Kubernetes' schemas in test_dra.py
EXTENDER_EXAMPLES = [p for p in sorted(EXAMPLES.glob("*.yaml")) if not p.name.endswith("-dra.yaml")]
Docs = list[tuple[str, dict[str, Any]]]

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
META = {"type": "object", "required": ["name"], "properties": {"name": NAME, "namespace": NAME}}
NAMESPACED_META = {**META, "required": ["name", "namespace"]}
QUANTITY = {"type": ["string", "integer"]}
CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": NAME,
        "image": {"type": "string", "minLength": 1},
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "limits": {"type": "object", "additionalProperties": QUANTITY},
                "requests": {"type": "object", "additionalProperties": QUANTITY},
                "claims": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            },
        },
    },
}
POD_SPEC = {
    "type": "object",
    "required": ["containers"],
    "properties": {"containers": {"type": "array", "minItems": 1, "items": CONTAINER}},
}
# a rule on resources, or on non-resource URLs (reading /metrics, nothing else)
NON_RESOURCE_RULE = {
    "type": "object",
    "required": ["nonResourceURLs", "verbs"],
    "additionalProperties": False,
    "properties": {"nonResourceURLs": {"const": ["/metrics"]}, "verbs": {"const": ["get"]}},
}
RESOURCE_RULE = {
    "type": "object",
    "required": ["apiGroups", "resources", "verbs"],
    "properties": {
        "apiGroups": {"type": "array", "items": {"type": "string"}},
        "resources": {"type": "array", "items": {"type": "string", "not": {"const": "*"}}},
        "verbs": {
            "type": "array",
            "items": {"enum": ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]},
        },
    },
}
RULE = {"oneOf": [RESOURCE_RULE, NON_RESOURCE_RULE]}
WEBHOOK = {
    "type": "object",
    "required": ["name", "admissionReviewVersions", "sideEffects", "clientConfig", "rules"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9-]+(\.[a-z0-9-]+){2,}$"},
        "admissionReviewVersions": {"type": "array", "contains": {"const": "v1"}},
        "sideEffects": {"enum": ["None", "NoneOnDryRun"]},
        "failurePolicy": {"enum": ["Fail", "Ignore"]},
        "timeoutSeconds": {"type": "integer", "minimum": 1, "maximum": 30},
        "clientConfig": {
            "type": "object",
            "required": ["service"],
            "properties": {"service": {"type": "object", "required": ["name", "namespace", "path"]}},
        },
    },
}
SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("v1", "Pod"): {"required": ["metadata", "spec"], "properties": {"metadata": META, "spec": POD_SPEC}},
    ("v1", "ServiceAccount"): {"required": ["metadata"], "properties": {"metadata": NAMESPACED_META}},
    ("v1", "Service"): {
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": NAMESPACED_META,
            "spec": {
                "type": "object",
                "required": ["selector", "ports"],
                "properties": {
                    "ports": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["port"]}}
                },
            },
        },
    },
    ("apps/v1", "Deployment"): {
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": NAMESPACED_META,
            "spec": {
                "type": "object",
                "required": ["selector", "template"],
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "template": {"type": "object", "required": ["metadata", "spec"], "properties": {"spec": POD_SPEC}},
                },
            },
        },
    },
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): {
        "required": ["metadata", "rules"],
        "properties": {"metadata": META, "rules": {"type": "array", "items": RULE}},
    },
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): {
        "required": ["metadata", "roleRef", "subjects"],
        "properties": {
            "metadata": META,
            "roleRef": {"type": "object", "required": ["apiGroup", "kind", "name"]},
            "subjects": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["kind", "name"]}},
        },
    },
    ("rbac.authorization.k8s.io/v1", "Role"): {
        "required": ["metadata", "rules"],
        "properties": {"metadata": NAMESPACED_META, "rules": {"type": "array", "items": RULE}},
    },
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): {
        "required": ["metadata", "roleRef", "subjects"],
        "properties": {
            "metadata": NAMESPACED_META,
            "roleRef": {"type": "object", "required": ["apiGroup", "kind", "name"]},
            "subjects": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["kind", "name"]}},
        },
    },
    ("policy/v1", "PodDisruptionBudget"): {
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": NAMESPACED_META,
            "spec": {
                "type": "object",
                "required": ["selector"],
                "properties": {"selector": {"required": ["matchLabels"]}},
            },
        },
    },
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): {
        "required": ["metadata", "webhooks"],
        "properties": {"metadata": META, "webhooks": {"type": "array", "minItems": 1, "items": WEBHOOK}},
    },
    ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration"): {
        "required": ["metadata", "webhooks"],
        "properties": {"metadata": META, "webhooks": {"type": "array", "minItems": 1, "items": WEBHOOK}},
    },
    # the fields of KubeSchedulerConfiguration, LeaderElectionConfiguration and KubeSchedulerProfile
    # (k8s.io/kube-scheduler/config/v1/types.go, k8s.io/component-base/config/v1alpha1/types.go):
    # kube-scheduler's strict decoding refuses any other
    ("kubescheduler.config.k8s.io/v1", "KubeSchedulerConfiguration"): {
        "required": ["extenders"],
        "additionalProperties": False,
        "properties": {
            **{
                k: {}
                for k in (
                    "apiVersion",
                    "kind",
                    "parallelism",
                    "clientConnection",
                    "enableProfiling",
                    "enableContentionProfiling",
                    "percentageOfNodesToScore",
                    "podInitialBackoffSeconds",
                    "podMaxBackoffSeconds",
                    "delayCacheUntilActive",
                )
            },
            "leaderElection": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    k: {}
                    for k in (
                        "leaderElect",
                        "leaseDuration",
                        "renewDeadline",
                        "retryPeriod",
                        "resourceLock",
                        "resourceName",
                        "resourceNamespace",
                    )
                },
            },
            "profiles": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        k: {} for k in ("schedulerName", "percentageOfNodesToScore", "plugins", "pluginConfig")
                    },
                },
            },
            "extenders": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["urlPrefix"],
                    "additionalProperties": False,  # a misspelt key would be silently ignored by kube-scheduler
                    "properties": {
                        k: {}
                        for k in (
                            "urlPrefix",
                            "filterVerb",
                            "preemptVerb",
                            "prioritizeVerb",
                            "bindVerb",
                            "weight",
                            "enableHTTPS",
                            "tlsConfig",
                            "httpTimeout",
                            "nodeCacheCapable",
                            "managedResources",
                            "ignorable",
                        )
                    },
                },
            },
        },
    },
}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_docs(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in paths for d in docs(p)]


SOURCES = ["deploy", *helm.COMBOS]


@pytest.fixture(params=SOURCES)
def manifests(request: pytest.FixtureRequest) -> Docs:
    """deploy/, or the chart rendered with one documented combination of values."""
    return helm.deploy_documents() if request.param == "deploy" else helm.rendered(request.param)


def checked_documents(found: Docs) -> Docs:
    """The documents this file has a schema for, with the kube-scheduler configurations out of
    their ConfigMaps."""
    configs = [(f"{w} (config.yaml)", c) for w, d in found for c in helm.scheduler_configs([(w, d)])]
    return [(w, d) for w, d in found if (d.get("apiVersion"), d.get("kind")) in SCHEMAS] + configs


def test_manifest_schema(manifests: Docs) -> None:
    found = checked_documents(manifests)
    kinds = {d["kind"] for _, d in found}
    assert {"Deployment", "Service", "KubeSchedulerConfiguration", "MutatingWebhookConfiguration"} <= kinds
    for where, doc in found:
        try:
            jsonschema.validate(doc, {"type": "object", **SCHEMAS[(doc["apiVersion"], doc["kind"])]})
        except jsonschema.ValidationError as e:
            pytest.fail(f"{where}: {e.message}")


@pytest.mark.parametrize("path", EXTENDER_EXAMPLES, ids=lambda p: p.name)
def test_example_schema(path: Path) -> None:
    found = docs(path)
    assert found, f"{path.name} is empty"
    for doc in found:
        jsonschema.validate(doc, {"type": "object", **SCHEMAS[(doc["apiVersion"], doc["kind"])]})


@dataclass(frozen=True)
class Scheduler:
    """The objects of `crihook scheduler`: found by the container that runs it, then by name."""

    deployment: dict[str, Any]
    container: dict[str, Any]
    service: dict[str, Any]  # the leader's, for kube-scheduler
    webhook_service: dict[str, Any]  # every replica's, for the API server
    account: dict[str, Any]
    cluster_role: dict[str, Any]
    cluster_binding: dict[str, Any]
    leader_role: dict[str, Any]
    leader_binding: dict[str, Any]


def scheduler_objects(found: Docs) -> Scheduler:
    ((dep, c),) = [
        (d, c)
        for d in helm.of_kind(found, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        if (c.get("args") or [""])[0] == "scheduler"
    ]
    account = dep["spec"]["template"]["spec"]["serviceAccountName"]
    ns = dep["metadata"]["namespace"]
    subject = {"kind": "ServiceAccount", "name": account, "namespace": ns}

    def only(kind: str, where: dict[str, Any] | None = None, **meta: str) -> dict[str, Any]:
        (doc,) = [
            d
            for d in helm.of_kind(found, kind)
            if meta.items() <= d["metadata"].items() and (where is None or subject in d.get("subjects", []))
        ]
        return doc

    (svc,) = [s for s in helm.of_kind(found, "Service") if ha.LEADER_LABEL in s["spec"].get("selector", {})]
    pods = dep["spec"]["selector"]["matchLabels"]
    (every,) = [
        s for s in helm.of_kind(found, "Service") if s["spec"].get("selector") == pods and "clusterIP" not in s["spec"]
    ]
    crb = only("ClusterRoleBinding", subject)
    rb = only("RoleBinding", subject)
    return Scheduler(
        dep,
        c,
        svc,
        every,
        only("ServiceAccount", name=account, namespace=ns),
        only("ClusterRole", name=crb["roleRef"]["name"]),
        crb,
        only("Role", name=rb["roleRef"]["name"], namespace=ns),
        rb,
    )


def test_deployment_service_and_server_agree(manifests: Docs) -> None:
    s = scheduler_objects(manifests)
    dep, svc, c = s.deployment, s.service, s.container
    labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    # replicas with leader election (docs/scheduler.md, "Leadership"): the Service selects the label
    # the leader puts on its own pod, and learns the pod's name from the downward API
    assert svc["spec"]["selector"] == {**selector, ha.LEADER_LABEL: "true"}
    assert svc["metadata"]["namespace"] == dep["metadata"]["namespace"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--pod-name" not in " ".join(c["args"])  # ha.add_arguments reads $POD_NAME
    # every replica that serves is Ready, so the rollout and the PDB may take one at a time, and no
    # surge: the anti-affinity (required unless scheduler.antiAffinity says otherwise) wants a node
    # per replica
    strategy = dep["spec"]["strategy"]
    assert dep["spec"]["replicas"] >= 2 and strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    rules = dep["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
    terms = [t.get("podAffinityTerm", t) for rule in rules.values() for t in rule]
    assert all(t["labelSelector"]["matchLabels"] == selector for t in terms)
    (pdb,) = helm.of_kind(manifests, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == dep["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    args = dict(a.partition("=")[::2] for a in c["args"][1:])
    assert c["args"][0] == "scheduler"
    assert (
        server.check_listen(
            args["--listen"], server.TlsFiles(args["--tls-cert"], args["--tls-key"], args["--client-ca"]), False
        )[1]
        == ports["https"]
    )
    sa = s.account
    assert args["--scheduler-user"] == f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    if sa["metadata"] == {**sa["metadata"], "namespace": "kube-system", "name": "crihook-scheduler"}:
        assert args["--scheduler-user"] == server.DEFAULT_SCHEDULER_USER
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
        assert c[probe]["timeoutSeconds"] >= 5, probe  # a slow answer on a busy node is still an answer
    # Ready while serving, standby too: with readiness tied to leadership the PDB never let the leader go
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_rbac_is_exactly_what_the_scheduler_uses(manifests: Docs) -> None:
    s = scheduler_objects(manifests)
    granted = {
        (g, r, v)
        for rule in s.cluster_role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    watched = {
        (g, r, v)
        for g, r in [("scheduling.koordinator.sh", "devices"), ("", "nodes"), ("", "pods")]
        for v in ("get", "list", "watch")
    }
    dra = {("resource.k8s.io", r, v) for r in ("resourceslices", "resourceclaims") for v in ("list", "watch")}
    dra |= {("resource.k8s.io", "resourceclaims", "get"), ("resource.k8s.io", "resourceclaimtemplates", "create")}
    assert granted == watched | dra | {("", "pods", "patch"), ("", "pods/binding", "create")}
    args = dict(a.partition("=")[::2] for a in s.container["args"][1:])
    lease_name = args.get("--lease-name", ha.DEFAULT_LEASE)
    lease = {  # leader election: the Lease scheduler/leader.py reads, creates and replaces
        (g, r, v, tuple(rule.get("resourceNames", ())))
        for rule in s.leader_role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert lease == {("coordination.k8s.io", "leases", "create", ())} | {
        ("coordination.k8s.io", "leases", v, (lease_name,)) for v in ("get", "update")
    }
    assert s.leader_binding["subjects"] == s.cluster_binding["subjects"]
    assert args["--lease-namespace"] == s.leader_role["metadata"]["namespace"]
    assert s.cluster_binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": s.account["metadata"]["name"],
            "namespace": s.account["metadata"]["namespace"],
        }
    ]


def test_scheduler_config_extender_stanza(manifests: Docs) -> None:
    ((ext, *scoring),) = [c["extenders"] for c in helm.scheduler_configs(manifests)]
    svc = scheduler_objects(manifests).service
    assert ext["urlPrefix"] == (
        f"https://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{svc['spec']['ports'][0]['port']}"
    )
    routes = server.App(Extender(cluster_plugin()), webhook.WebhookConfig(), lambda: True).routes
    for verb in ("filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb"):
        assert "/" + ext[verb] in routes
    # the certificate names the webhooks' Service, which kube-scheduler checks whatever address it calls
    every = scheduler_objects(manifests).webhook_service
    assert ext["tlsConfig"]["serverName"] == f"{every['metadata']['name']}.{every['metadata']['namespace']}.svc"
    assert ext["nodeCacheCapable"] is True and ext["enableHTTPS"] is True and 1 <= ext["weight"] <= 100
    assert [m["name"] for m in ext["managedResources"]] == list(DEVICE_RESOURCES)
    assert all(m["ignoredByScheduler"] is True for m in ext["managedResources"])
    # kubeScheduler.scoreClaimPods: the same server and connection, scoring only, sent every pod
    for entry in scoring:
        assert "/" + entry["prioritizeVerb"] in routes and entry["prioritizeVerb"] != ext["prioritizeVerb"]
        assert not entry.keys() & {"filterVerb", "preemptVerb", "bindVerb", "managedResources"}
        assert entry["ignorable"] is True and 1 <= entry["weight"] <= 100
        same = ("urlPrefix", "enableHTTPS", "tlsConfig", "nodeCacheCapable")
        assert {k: entry[k] for k in same} == {k: ext[k] for k in same}


def test_webhooks_point_at_the_server(manifests: Docs) -> None:
    """The webhooks' Service selects every replica, leader or not: a failover never refuses pod writes."""
    svc = scheduler_objects(manifests).webhook_service
    ns = svc["metadata"]["namespace"]
    paths: dict[str, list[tuple[str, list[str]]]] = {}
    routes = server.App(Extender(cluster_plugin()), webhook.WebhookConfig(), lambda: True).routes
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (config,) = helm.of_kind(manifests, kind)
        for wh in config["webhooks"]:
            s = wh["clientConfig"]["service"]
            assert (s["name"], s["namespace"], s["port"]) == (
                svc["metadata"]["name"],
                ns,
                svc["spec"]["ports"][0]["port"],
            )
            assert wh["rules"][0]["resources"] == ["pods"]
            # the scheduler's own namespace and kube-system never wait for the webhooks
            (excluded,) = [
                e["values"]
                for e in wh["namespaceSelector"]["matchExpressions"]
                if e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "NotIn"
            ]
            assert {ns, "kube-system"} <= set(excluded)
            assert s["path"] in routes
            paths.setdefault(kind, []).append((s["path"], wh["rules"][0]["operations"]))
    convert = [("/mutate-dra", ["CREATE"])] if len(paths["MutatingWebhookConfiguration"]) > 1 else []
    assert paths == {
        "MutatingWebhookConfiguration": [("/mutate", ["CREATE"]), *convert],
        "ValidatingWebhookConfiguration": [("/validate", ["CREATE", "UPDATE"])],
    }


def as_api_server_sends(pod: dict[str, Any]) -> dict[str, Any]:
    """What admission sees after the API server's defaulting: quantities as strings, and requests of
    extended resources defaulted from limits."""
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("namespace", "default")
    for c in pod["spec"]["containers"]:
        res = c.setdefault("resources", {})
        res["limits"] = {k: str(v) for k, v in (res.get("limits") or {}).items()}
        res["requests"] = {**res["limits"], **{k: str(v) for k, v in (res.get("requests") or {}).items()}}
    return pod


def admitted(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod after the mutating webhook, checked allowed by the validating one."""
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "operation": "CREATE",
            "namespace": "default",
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "userInfo": {"username": "alice"},
            "object": pod,
        },
    }
    resp = webhook.mutate(review, webhook.WebhookConfig())["response"]
    assert resp["allowed"] is True and resp["uid"] == "u-1"
    if "patch" in resp:
        pod = json_patch(pod, json.loads(base64.b64decode(resp["patch"])))
    review["request"]["object"] = pod
    v = webhook.validate(review, webhook.WebhookConfig())["response"]
    assert v["allowed"] is True, v.get("status")
    return pod


EXAMPLE_PODS = [(p.name, d) for p, d in all_docs(EXTENDER_EXAMPLES)]


def test_every_seed_has_examples() -> None:
    assert {n.split("-")[0] for n, _ in EXAMPLE_PODS} == {"000", "001", "002", "004"}


@pytest.mark.parametrize(("file", "pod"), EXAMPLE_PODS, ids=[d["metadata"]["name"] for _, d in EXAMPLE_PODS])
def test_example_pods_admit_and_prefilter(file: str, pod: dict[str, Any]) -> None:
    plugin = cluster_plugin()  # gpu-node-1: 8 x A100 80GB, gpu-node-2: 4 x V100 32GB, no RDMA NICs
    final = admitted(as_api_server_sends(pod))
    final["metadata"]["uid"] = "uid-" + final["metadata"]["name"]
    req = plugin.pre_filter(pod_from_json(final))
    assert req.wants_devices
    fit, failed = plugin.filter_nodes(req, ["gpu-node-1", "gpu-node-2"])
    if req.rdma:
        assert fit == [] and all("RDMA" in r for r in failed.values())
    else:
        assert fit, failed
