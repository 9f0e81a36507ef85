"""charts/crihook through the real helm (tests/helm.sh fetches it; without it these are skipped with
the reason): `helm lint --strict` and `helm template` of the defaults and of every documented value
combination (tests/support/helm.py, COMBOS), each document valid for the API server of the newest
Kubernetes kubernetes-validate knows and of the oldest the chart admits; values.yaml documented and
mirrored by the schema that makes a misspelt key fail; the packaged archive; deploy/ in sync with
the chart; the generated certificate; what `helm upgrade` restarts; and the node and kube-scheduler
workloads against the commands they run. test_extender_deploy.py and test_manifests.py check every
rendering against what `crihook scheduler` serves."""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import re
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from crihook import __version__
from crihook.base import config as crihook_config
from crihook.cli import COMMANDS
from tests.support import helm
from tests.support.helm import CHART, COMBOS, NEWEST, OLDEST, Combo
from tests.support.helmkube import HelmKube, object_path
from tests.support.image_build import offline

Docs = list[tuple[str, dict[str, Any]]]
WORKLOADS = ("Deployment", "DaemonSet")


def lint(*args: str) -> subprocess.CompletedProcess[str]:
    return helm.run("lint", "--strict", str(CHART), "--kube-version", NEWEST, *args, check=False)


@pytest.mark.parametrize("name", COMBOS)
def test_lint_strict(name: str) -> None:
    combo = COMBOS[name]
    out = lint("--namespace", combo.namespace, *helm.values_args(combo.values))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "values",
    [
        {"scheduler": {"replicass": 3}},  # a misspelt key
        {"tls": {"mode": "selfSigned"}},  # a value no template knows
        {"scheduler": {"replicas": "two"}},  # the wrong type
        {"nodes": {"enabled": False}},  # a misspelt top-level key
        {"node": {"nri": {"pluginIndex": "7"}}},  # NRI wants two digits
        {"node": {"nri": {"pluginIndex": 100}}},  # or a number that fits in two
        {"webhooks": {"failurePolicy": "Ignore"}},  # the validating webhook's policy is not a value
        {"webhooks": {"mutating": {"failurePolicy": "Never"}}},
        {"node": {"updateStrategy": {"type": "Recreate"}}},  # a Deployment's, not a DaemonSet's
        {"metrics": {"node": {"port": 70000}}},
        {"scheduler": {"antiAffinity": "soft"}},  # required, preferred or none
    ],
    ids=json.dumps,
)
def test_lint_refuses_what_the_schema_does_not_allow(values: dict[str, Any]) -> None:
    out = lint(*helm.values_args(values))
    assert out.returncode != 0 and "schema" in (out.stdout + out.stderr).lower(), out.stdout + out.stderr


@pytest.mark.parametrize("version", [NEWEST, OLDEST])
@pytest.mark.parametrize("name", COMBOS)
def test_rendering_is_valid_for_the_api_server(name: str, version: str) -> None:
    docs = helm.rendered(name, version)
    assert docs
    problems = [f"{where}: {p}" for where, d in docs if (p := helm.api_problem(d, version))]
    assert not problems, "\n".join(problems)


def test_names_and_labels_fit_their_limits() -> None:
    """Service names are DNS labels (63), other names DNS subdomains (253), label values 63, even
    for Helm's longest release name."""
    label = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
    for where, d in helm.rendered("long-release-name"):
        meta = d["metadata"]
        assert len(meta["name"]) <= 253, where
        if d["kind"] == "Service":
            assert label.match(meta["name"]), (where, meta["name"])
        assert all(len(str(v)) <= 63 for v in meta.get("labels", {}).values()), where


def test_validation_can_fail() -> None:
    """The renderings are checked for real: a misspelt field, and a cert-manager one, are refused."""
    docs = helm.rendered("cert-manager")
    (dep, *_) = helm.of_kind(docs, "Deployment")
    dep = json.loads(json.dumps(dep))
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert helm.api_problem(dep, NEWEST)
    cert = json.loads(json.dumps(next(c for c in helm.of_kind(docs, "Certificate") if "dnsNames" in c["spec"])))
    cert["spec"]["dnsName"] = cert["spec"].pop("dnsNames")
    assert helm.api_problem(cert, NEWEST)


def test_chart_admits_managed_clusters_but_not_older_ones() -> None:
    """kubeVersion admits a provider's suffixed version and names it for kube-scheduler without the
    suffix; a version below the floor is refused before anything renders."""
    text = helm.template_text(Combo(), "v1.29.3-eks-1a2b3c")
    (ks,) = [
        d
        for d in helm.of_kind(helm.documents_of(text, "eks"), "Deployment")
        if d["metadata"]["name"].endswith("kube-scheduler")
    ]
    assert ks["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.k8s.io/kube-scheduler:v1.29.3"
    major, minor, _ = OLDEST.split(".")
    below = helm.run("template", "x", str(CHART), "--kube-version", f"{major}.{int(minor) - 1}.0", check=False)
    assert below.returncode != 0 and "kubeVersion" in below.stderr, below.stderr


def test_versions_and_image_are_the_projects() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__ == offline.version()
    for name in COMBOS:
        for dep in [d for k in WORKLOADS for d in helm.of_kind(helm.rendered(name), k)]:
            for c in dep["spec"]["template"]["spec"]["containers"]:
                if c["name"] != "kube-scheduler":
                    assert c["image"] == offline.ref(), (name, dep["metadata"]["name"], c["name"])


def test_package_makes_the_archive_that_installs(tmp_path: Path) -> None:
    out = helm.run("package", str(CHART), "--destination", str(tmp_path))
    archive = tmp_path / f"crihook-{__version__}.tgz"
    assert archive.is_file(), out.stdout
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {f"crihook/{n}" for n in ("Chart.yaml", "values.yaml", "values.schema.json", "templates/NOTES.txt")} <= names
    assert helm.run("lint", "--strict", str(archive)).returncode == 0
    from_archive = helm.run("template", "crihook", str(archive), "--namespace", "crihook", "--kube-version", NEWEST)
    kinds = {d["kind"] for _, d in helm.documents_of(from_archive.stdout, "archive")}
    assert {"CustomResourceDefinition", "Deployment", "DaemonSet", "MutatingWebhookConfiguration"} <= kinds


def test_deploy_is_the_charts_rendering() -> None:
    assert helm.render.render(helm.helm()) == helm.render.on_disk(), (
        "deploy/ is stale: python3 deploy/render.py rewrites it from the chart"
    )


# -- values.yaml and its schema ---------------------------------------------------------------------


def keys_with_comments(text: str) -> list[tuple[str, bool]]:
    """(dotted key, whether a comment line stands right above it) for every key of values.yaml's
    nested maps (not inside list items, which are examples of a value)."""
    out: list[tuple[str, bool]] = []
    path: list[str] = []
    commented, item_indent = False, -1
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped:
            commented = False
            continue
        if stripped.startswith("#"):
            commented = True
            continue
        if stripped.startswith("- ") or (item_indent >= 0 and indent > item_indent):
            item_indent = indent if stripped.startswith("- ") and item_indent < 0 else item_indent
            commented = False
            continue
        item_indent = -1
        m = re.match(r"^( *)([A-Za-z][\w./-]*):", line)
        assert m is not None, line
        path = [*path[: len(m[1]) // 2], m[2]]
        out.append((".".join(path), commented))
        commented = False
    return out


def test_every_value_is_documented() -> None:
    """Each key of the first two levels has its own comment; a deeper key is covered by the comment
    of the block it sits in."""
    keys = dict(keys_with_comments((CHART / "values.yaml").read_text()))
    assert "node.nri.pluginIndex" in keys and not any(k.startswith("node.tolerations.") for k in keys)

    def documented(key: str) -> bool:
        parts = key.split(".")
        if keys[key]:
            return True
        return len(parts) > 2 and any(keys[".".join(parts[:n])] for n in range(2, len(parts)))

    undocumented = [k for k in keys if not documented(k)]
    assert not undocumented, f"values.yaml keys without a comment: {undocumented}"


def schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, sub in schema.get("properties", {}).items():
        out.add(prefix + key)
        if sub.get("type") == "object" and sub.get("additionalProperties") is False:
            out |= schema_paths(sub, f"{prefix}{key}.")
    return out


def value_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, v in values.items():
        out.add(prefix + key)
        sub = schema.get("properties", {}).get(key, {})
        if isinstance(v, dict) and sub.get("additionalProperties") is False:
            # an empty default ({}) of fixed keys is a place for optional ones
            out |= value_paths(v, sub, f"{prefix}{key}.") if v else schema_paths(sub, f"{prefix}{key}.")
    return out


def test_schema_is_closed_and_mirrors_values_yaml() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert value_paths(values, schema) == schema_paths(schema)

    def closed(s: dict[str, Any], where: str) -> None:  # every object of fixed keys refuses others
        if "properties" in s:
            assert s.get("additionalProperties") is False, where
        for k, sub in s.get("properties", {}).items():
            closed(sub, f"{where}.{k}")

    closed(schema, "values")


# -- the generated certificate ----------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_generated_certificate_is_the_webhooks_ca_and_names_the_service(tmp_path: Path) -> None:
    docs = helm.rendered("defaults")
    (secret,) = helm.of_kind(docs, "Secret")
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (config,) = helm.of_kind(docs, kind)
        assert base64.b64decode(config["webhooks"][0]["clientConfig"]["caBundle"]) == data["ca.crt"]
    (tmp_path / "ca.crt").write_bytes(data["ca.crt"])
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", tmp_path / "ca.crt", tmp_path / "tls.crt"], capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # kube-scheduler's client certificate: the same CA, good for TLS client authentication
    (tmp_path / "client.crt").write_bytes(data["client.crt"])
    client = subprocess.run(
        ["openssl", "verify", "-purpose", "sslclient", "-CAfile", tmp_path / "ca.crt", tmp_path / "client.crt"],
        capture_output=True,
        text=True,
    )
    assert client.returncode == 0, client.stdout + client.stderr
    svc = next(s for s in helm.of_kind(docs, "Service") if s["metadata"]["name"].endswith("-scheduler"))
    name = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    check = subprocess.run(
        ["openssl", "x509", "-noout", "-checkhost", name, "-in", tmp_path / "tls.crt"], capture_output=True, text=True
    )
    assert "does match" in check.stdout, check.stdout + check.stderr
    (dep,) = [d for d in helm.of_kind(docs, "Deployment") if d["metadata"]["name"] == svc["metadata"]["name"]]
    assert dep["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"] == secret["metadata"]["name"]


def generated(docs: Docs) -> tuple[dict[str, str], set[str]]:
    """(the TLS Secret's data, the webhooks' caBundles)."""
    (secret,) = helm.of_kind(docs, "Secret")
    bundles = {
        w["clientConfig"]["caBundle"]
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
        for c in helm.of_kind(docs, kind)
        for w in c["webhooks"]
    }
    return secret["data"], bundles


def test_upgrade_keeps_the_generated_certificate(tmp_path: Path) -> None:
    """With the Secret in the cluster, the chart's lookup reads it back: the same CA, certificate and
    key, and the caBundle still theirs (what `helm upgrade` renders). Without it, a new one."""
    first, _ = generated(helm.rendered("defaults"))
    (secret,) = json.loads(json.dumps(helm.of_kind(helm.rendered("defaults"), "Secret")))
    # what Helm itself put on the object at install, and checks before it renders over it
    # (helm pkg/action/validate.go: the managed-by label and the release annotations)
    secret["metadata"]["annotations"] = {
        "meta.helm.sh/release-name": "crihook",
        "meta.helm.sh/release-namespace": secret["metadata"]["namespace"],
    }

    def against(objects: list[dict[str, Any]], work: Path) -> tuple[dict[str, str], set[str]]:
        work.mkdir()
        with HelmKube(objects, work, NEWEST) as kube:
            text = helm.template_text(
                COMBOS["defaults"],
                NEWEST,
                "--dry-run=server",
                "--disable-openapi-validation",  # the fake serves no OpenAPI document
                "--kubeconfig",
                str(kube.kubeconfig),
            )
            assert object_path(secret) in kube.gets  # the lookup asked for it
        return generated(helm.documents_of(text, "upgrade"))

    kept, bundles = against([secret], tmp_path / "kept")
    assert kept == first and bundles == {first["ca.crt"]}
    fresh, bundles = against([], tmp_path / "fresh")
    assert fresh["ca.crt"] != first["ca.crt"] and bundles == {fresh["ca.crt"]}
    # a Secret without kube-scheduler's client certificate (made before the chart made one): the CA's
    # key is not kept, so everything is made anew, consistently
    older = json.loads(json.dumps(secret))
    for key in ("client.crt", "client.key"):
        del older["data"][key]
    renewed, bundles = against([older], tmp_path / "older")
    assert renewed["ca.crt"] != first["ca.crt"] and bundles == {renewed["ca.crt"]} and "client.key" in renewed


def test_given_certificate_ca_goes_to_the_webhooks_and_kube_scheduler() -> None:
    docs = helm.rendered("given-certificate")
    assert not helm.of_kind(docs, "Secret")  # the user's Secret is theirs
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (config,) = helm.of_kind(docs, kind)
        assert base64.b64decode(config["webhooks"][0]["clientConfig"]["caBundle"]).decode() == helm.GIVEN_CA
    (cm,) = [c for c in helm.of_kind(docs, "ConfigMap") if "ca.crt" in c["data"]]
    assert cm["data"]["ca.crt"] == helm.GIVEN_CA
    secrets = {
        v["secret"]["secretName"]
        for d in helm.of_kind(docs, "Deployment")
        for v in d["spec"]["template"]["spec"]["volumes"]
        if "secret" in v
    }
    assert secrets == {"corp-tls"}


def test_cert_manager_injects_the_ca() -> None:
    docs = helm.rendered("cert-manager")
    (serving,) = [c for c in helm.of_kind(docs, "Certificate") if "server auth" in c["spec"].get("usages", [])]
    ns = serving["metadata"]["namespace"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (config,) = helm.of_kind(docs, kind)
        assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
            f"{ns}/{serving['metadata']['name']}"
        )
        assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    issuers = {(i["kind"], i["metadata"]["name"]) for i in helm.of_kind(docs, "Issuer")}
    assert (serving["spec"]["issuerRef"]["kind"], serving["spec"]["issuerRef"]["name"]) in issuers
    given = helm.rendered("cert-manager-issuer")
    assert not helm.of_kind(given, "Issuer")
    for cert in helm.of_kind(given, "Certificate"):  # the scheduler's, and kube-scheduler's client certificate
        assert cert["spec"]["issuerRef"] == {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "corp-ca"}


# -- helm upgrade -------------------------------------------------------------------------------------


def pod_templates(docs: Docs) -> dict[str, Any]:
    return {d["metadata"]["name"]: d["spec"]["template"] for k in WORKLOADS for d in helm.of_kind(docs, k)}


def changed(values: dict[str, Any]) -> set[str]:
    """The workloads whose pods `helm upgrade` from the defaults to these values would replace."""
    base = pod_templates(helm.documents_of(helm.template_text(Combo(), NEWEST), "a"))
    new = pod_templates(helm.documents_of(helm.template_text(Combo(values), NEWEST), "b"))
    assert base.keys() == new.keys()
    return {name.removeprefix("crihook-") for name in base if base[name] != new[name]}


def test_upgrade_restarts_only_what_changed() -> None:
    """Pod templates hold nothing random (a new certificate is no restart: the scheduler reloads
    it), and each configuration change reaches the pods that read it through a checksum."""
    assert changed({}) == set()
    assert changed({"node": {"config": {"proxy": {"log_level": "debug"}}}}) == {"node"}
    assert changed({"kubeScheduler": {"weight": 10}}) == {"kube-scheduler"}
    assert changed({"scheduler": {"strategy": "binpack"}}) == {"scheduler"}
    assert changed({"webhooks": {"timeoutSeconds": 10}}) == set()


# -- the node DaemonSet and the second kube-scheduler against what they run -----------------------------


def parse_args(command: str, args: list[str]) -> argparse.Namespace:
    """A container's args as `crihook <command>` parses them (an unknown flag exits)."""
    parser = argparse.ArgumentParser(prog=f"crihook {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser.parse_args(args)


def node_pod(name: str = "defaults") -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """(pod spec, containers by name, the crihook config file) of the node DaemonSet."""
    docs = helm.rendered(name)
    (ds,) = helm.of_kind(docs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (cm,) = [
        c for c in helm.of_kind(docs, "ConfigMap") if c["metadata"]["name"] == spec["volumes"][0]["configMap"]["name"]
    ]
    return spec, {c["name"]: c for c in spec["containers"]}, tomllib.loads(cm["data"]["config.toml"])


def host_paths(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """host path -> (where the container sees it, read-only)."""
    hosts = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    return {
        hosts[m["name"]]: (m["mountPath"], m.get("readOnly", False))
        for m in container["volumeMounts"]
        if m["name"] in hosts
    }


def test_node_pods_mount_exactly_what_they_need() -> None:
    spec, containers, config = node_pod()
    assert set(containers) == {"nri", "report"}
    assert host_paths(spec, containers["nri"]) == {
        "/var/run/nri": ("/var/run/nri", False),
        "/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", True),
        "/var/lib/kubelet": ("/var/lib/kubelet", True),
        "/etc/cdi": ("/etc/cdi", True),
        "/var/run/cdi": ("/var/run/cdi", True),
        "/dev": ("/dev", True),
        "/var/lib/crihook": ("/var/lib/crihook", False),
        "/": ("/run/crihook/driver", True),
        "/run/containerd": ("/run/containerd", True),
    }
    assert host_paths(spec, containers["report"]) == {
        "/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", True),
        "/dev": ("/dev", True),
        "/sys": ("/sys", True),
        "/": ("/run/crihook/driver", True),
    }
    # kubelet must still be able to unmount pod volumes under its root dir (mounted whole: its DRA
    # checkpoint is replaced by a rename); a driver the GPU operator installs or upgrades, and a
    # socket containerd makes anew, must be seen in the pod
    for c in containers.values():
        for m in c["volumeMounts"]:
            if m["mountPath"] in ("/var/lib/kubelet", "/run/crihook/driver", "/run/containerd"):
                assert m["mountPropagation"] == "HostToContainer", (c["name"], m["mountPath"])
    # the config file names the paths as mounted, and crihook accepts it
    crihook_config.parse(config, "config.toml")
    assert config["hooks"]["gpu"]["kubelet_pods_dir"] == "/var/lib/kubelet/pods"
    assert config["hooks"]["gpu"]["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    # HAMi-core's directories, which crihook makes, are below the state dir the pods may write; its
    # library and preload file are where HAMi installs them on the host
    assert config["hooks"]["gpu"]["hami_core"] == {
        "cache_root": "/var/lib/crihook/hami-core/containers",
        "lock_dir": "/var/lib/crihook/hami-core/lock",
        "library": "/usr/local/vgpu/libvgpu.so",
        "preload_file": "/usr/local/vgpu/ld.so.preload",
        # checked for under the host's / as the pod sees it: here the driver's mount of it
        "host_root": "/run/crihook/driver",
    }
    libraries = config["node"]["nvml_library"].split(":")
    assert "/run/crihook/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in libraries  # Debian, Ubuntu
    assert "/run/crihook/driver/usr/lib64/libnvidia-ml.so.1" in libraries  # RHEL
    assert "/run/crihook/driver/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1" in libraries  # arm64
    # the catch-up and eviction reach containerd's CRI socket where it is mounted
    assert config["node"]["runtime_endpoint"] == "unix:///run/containerd/containerd.sock"
    # the token reaches the reporter alone; crihook's own hooks skip these pods
    assert spec["automountServiceAccountToken"] is False
    token = [c["name"] for c in containers.values() for m in c["volumeMounts"] if m["name"] == "kube-api"]
    assert token == ["nri", "report"]  # the metrics' callers checked; the reporter's writes
    (ds,) = helm.of_kind(helm.rendered("defaults"), "DaemonSet")
    assert ds["spec"]["template"]["metadata"]["labels"]["runtimeproxy.koordinator.sh/skip-hookserver"] == "true"
    assert "nodeSelector" not in spec


def test_host_pid_namespace_only_for_gpu_usage() -> None:
    """crihook's usage collector reads the cgroup of the host PIDs NVML names; without it the pod
    keeps its own PID namespace."""
    spec, _, config = node_pod()
    assert crihook_config.parse(config, "config.toml").usage.enabled and spec["hostPID"] is True
    off = {"node": {"config": {"usage": {"enabled": False}}}}
    (ds,) = helm.of_kind(helm.documents_of(helm.template_text(Combo(off), NEWEST), "off"), "DaemonSet")
    assert "hostPID" not in ds["spec"]["template"]["spec"]


def test_node_without_reporter_has_no_api_access() -> None:
    name = "node-without-reporter"
    spec, containers, _ = node_pod(name)
    assert set(containers) == {"nri"}
    assert "serviceAccountName" not in spec and "hostNetwork" not in spec
    roles = [d for k in ("ClusterRole", "ClusterRoleBinding") for d in helm.of_kind(helm.rendered(name), k)]
    assert not [r for r in roles if r["metadata"]["name"].endswith("-node")]
    assert not {"/run/crihook/driver", "/run/containerd"} & {m["mountPath"] for m in containers["nri"]["volumeMounts"]}


def test_hami_core_paths_are_values_and_the_config_keys_override_them() -> None:
    """node.hamiCore names the host paths of HAMi-core's library and preload file; the hook's
    configuration carries them (and allows them), and node.config's own keys still win."""
    vgpu = {"node": {"hamiCore": {"library": "/opt/hami/libvgpu.so", "preloadFile": "/opt/hami/ld.so.preload"}}}
    docs = helm.documents_of(helm.template_text(Combo(vgpu), NEWEST), "hami")
    (cm,) = [c for c in helm.of_kind(docs, "ConfigMap") if "config.toml" in c["data"]]
    config = tomllib.loads(cm["data"]["config.toml"])
    crihook_config.parse(config, "config.toml")
    paths = config["hooks"]["gpu"]["hami_core"]
    assert (paths["library"], paths["preload_file"]) == ("/opt/hami/libvgpu.so", "/opt/hami/ld.so.preload")
    assert paths["cache_root"] == "/var/lib/crihook/hami-core/containers"
    over = {"node": {**vgpu["node"], "config": {"hooks": {"gpu": {"hami_core": {"library": "/srv/libvgpu.so"}}}}}}
    docs = helm.documents_of(helm.template_text(Combo(over), NEWEST), "hami-over")
    (cm,) = [c for c in helm.of_kind(docs, "ConfigMap") if "config.toml" in c["data"]]
    assert tomllib.loads(cm["data"]["config.toml"])["hooks"]["gpu"]["hami_core"]["library"] == "/srv/libvgpu.so"


def test_node_config_keeps_integers_and_merges_user_keys() -> None:
    values = {"node": {"config": {"proxy": {"max_message_bytes": 16777216, "drain_seconds": 2.5}}}}
    docs = helm.documents_of(helm.template_text(Combo(values), NEWEST), "config")
    (cm,) = [c for c in helm.of_kind(docs, "ConfigMap") if "config.toml" in c["data"]]
    config = tomllib.loads(cm["data"]["config.toml"])
    parsed = crihook_config.parse(config, "config.toml")
    assert parsed.proxy.max_message_bytes == 16777216 and parsed.proxy.drain_seconds == 2.5
    assert config["hooks"]["gpu"]["kubelet_pods_dir"] == "/var/lib/kubelet/pods"


def test_report_container_runs_crihook_report() -> None:
    _, containers, _ = node_pod()
    args = containers["report"]["args"]
    assert args[0] == "report"
    parsed = parse_args("report", args[1:])
    assert parsed.kubeconfig == "in-cluster" and parsed.config == "/etc/crihook/config.toml"


@pytest.mark.skipif("nri" not in COMMANDS, reason="crihook has no nri command yet")
def test_nri_container_runs_crihook_nri() -> None:
    _, containers, _ = node_pod()
    args = containers["nri"]["args"]
    assert args[0] == "nri"
    parse_args("nri", args[1:])


def test_nri_container_flags_are_the_documented_ones() -> None:
    """`crihook nri`'s flags as the design fixes them (--config, --nri-socket, --plugin-name,
    --plugin-index, --state-dir), with the socket in the directory mounted from the host, and the
    Kubernetes node's name (the metrics' node label; the host name may differ from it)."""
    _, containers, _ = node_pod()
    args = dict(a.split("=", 1) for a in containers["nri"]["args"][1:])
    assert args == {
        "--config": "/etc/crihook/config.toml",
        "--nri-socket": "/var/run/nri/nri.sock",
        "--plugin-name": "crihook",
        "--plugin-index": "10",
        "--state-dir": "/var/lib/crihook",
        "--node-name": "$(NODE_NAME)",
    }
    env = {e["name"]: e for e in containers["nri"]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"] for m in containers["nri"]["volumeMounts"]}
    assert str(Path(args["--nri-socket"]).parent) in mounts and args["--state-dir"] in mounts


def test_second_kube_scheduler_is_the_clusters_and_gets_the_gpu_pods() -> None:
    docs = helm.rendered("defaults")
    deps = {d["metadata"]["name"]: d for d in helm.of_kind(docs, "Deployment")}
    ks, sched = deps["crihook-kube-scheduler"], deps["crihook-scheduler"]
    (c,) = ks["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"registry.k8s.io/kube-scheduler:v{NEWEST}"
    (config,) = helm.scheduler_configs(docs)
    (profile,) = config["profiles"]
    # the webhook hands GPU pods of the default scheduler to this one
    assert f"--scheduler-name={profile['schedulerName']}" in sched["spec"]["template"]["spec"]["containers"][0]["args"]
    # its config and CA as the stanza names them
    assert "--config=/etc/kubernetes/crihook/config.yaml" in c["command"]
    assert config["extenders"][0]["tlsConfig"]["caFile"] == "/etc/kubernetes/crihook/ca.crt"
    (mount,) = c["volumeMounts"]
    assert mount["mountPath"] == "/etc/kubernetes/crihook"
    # leader election on a Lease its Role covers
    lease = config["leaderElection"]["resourceName"]
    roles = [r for r in helm.of_kind(docs, "Role") if any(lease in x.get("resourceNames", []) for x in r["rules"])]
    assert len(roles) == 1
    pinned = helm.of_kind(helm.rendered("everything-set"), "Deployment")
    assert "registry.k8s.io/kube-scheduler:v1.33.2" in {
        c["image"] for d in pinned for c in d["spec"]["template"]["spec"]["containers"]
    }
    extender_only = helm.of_kind(helm.rendered("extender-stanza"), "Deployment")
    assert [d["metadata"]["name"] for d in extender_only] == ["crihook-scheduler"]


def test_score_claim_pods_adds_a_scoring_only_entry() -> None:
    """kubeScheduler.scoreClaimPods off: the binding entry alone, which kube-scheduler sends only pods
    asking for its managedResources. On, in either mode: a second entry with no managedResources
    (HTTPExtender.IsInterested: every pod), prioritize only, ignorable, its own weight and timeout;
    the stanza still passes kube-scheduler's validateExtenders (one binder, each managed resource
    once, a positive weight wherever a prioritizeVerb is)."""
    for name in ("defaults", "extender-stanza"):
        ((only,),) = [c["extenders"] for c in helm.scheduler_configs(helm.rendered(name))]
        assert only["bindVerb"] and only["managedResources"]
    wanted = {"extender-score-claim-pods": (3, "500ms"), "everything-set": (5, "1s")}
    for name, (weight, timeout) in wanted.items():
        ((first, second),) = [c["extenders"] for c in helm.scheduler_configs(helm.rendered(name))]
        assert second["prioritizeVerb"] == "prioritize-claims" and second["ignorable"] is True
        assert (second["weight"], second["httpTimeout"]) == (weight, timeout)
        assert "managedResources" not in second and not {"filterVerb", "bindVerb", "preemptVerb"} & second.keys()
        assert second["urlPrefix"] == first["urlPrefix"] and second["tlsConfig"] == first["tlsConfig"]
        assert len([e for e in (first, second) if e.get("bindVerb")]) == 1
        assert all(e["weight"] > 0 for e in (first, second) if e.get("prioritizeVerb"))


def test_service_monitor_only_where_the_cluster_has_it() -> None:
    assert not helm.of_kind(helm.rendered("defaults"), "ServiceMonitor")
    docs = helm.rendered("service-monitor")
    (sm,) = helm.of_kind(docs, "ServiceMonitor")
    wanted = sm["spec"]["selector"]["matchLabels"].items()
    (svc,) = [s for s in helm.of_kind(docs, "Service") if s["metadata"]["labels"].items() >= wanted]
    (dep,) = [d for d in helm.of_kind(docs, "Deployment") if d["metadata"]["name"] == "crihook-scheduler"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]  # every replica, not just the leader


def test_notes_say_how_to_check_the_install() -> None:
    out = helm.run("install", "crihook", str(CHART), "--dry-run=client", "--namespace", "crihook").stdout
    notes = out.split("NOTES:", 1)[1]
    for what in ("kubectl get devices", "scheduler.crihook.io/leader=true", "crihook doctor", "get lease"):
        assert what in notes, what


@pytest.mark.parametrize(
    "values",
    [
        {"kubeScheduler": {"mode": "extender"}},
        {"kubeScheduler": {"mode": "extender"}, "tls": {"mode": "secret", "secret": {"name": "corp-tls"}}},
        {"kubeScheduler": {"mode": "extender"}, "tls": {"mode": "certManager"}},
    ],
    ids=json.dumps,
)
def test_notes_name_the_files_your_kube_scheduler_needs(values: dict[str, Any]) -> None:
    """In extender mode the notes say where the CA and kube-scheduler's client certificate are (and
    render without a client Secret where none is needed)."""
    out = helm.run(
        "install", "crihook", str(CHART), "--dry-run=client", "--namespace", "crihook", *helm.values_args(values)
    ).stdout
    notes = out.split("NOTES:", 1)[1]
    assert "ca.crt" in notes and "client certificate" in notes and "/etc/kubernetes/crihook/client.key" in notes


def test_network_policy_lets_kube_scheduler_reach_the_scheduler() -> None:
    """Off by default; on, it selects the scheduler's pods and lets the second kube-scheduler's pods
    and the configured peers reach the port the scheduler serves on."""
    assert not helm.of_kind(helm.rendered("defaults"), "NetworkPolicy")
    docs = helm.rendered("network-policy")
    (policy,) = helm.of_kind(docs, "NetworkPolicy")
    deployments = {d["metadata"]["name"]: d for d in helm.of_kind(docs, "Deployment")}
    scheduler = deployments["crihook-scheduler"]["spec"]
    kube_scheduler = deployments["crihook-kube-scheduler"]["spec"]
    assert policy["spec"]["podSelector"] == scheduler["selector"]
    (rule,) = policy["spec"]["ingress"]
    (port,) = rule["ports"]
    assert port["port"] in {p["name"] for p in scheduler["template"]["spec"]["containers"][0]["ports"]}
    assert {"podSelector": kube_scheduler["selector"]} in rule["from"]
    assert {"ipBlock": {"cidr": "0.0.0.0/0"}} in rule["from"]


def test_kube_scheduler_presents_the_client_certificate_the_scheduler_requires() -> None:
    """In every certificate mode the second kube-scheduler mounts a client certificate and key, and
    its extender stanza names them; the scheduler requires one signed by the CA it is given."""
    for name in ("defaults", "cert-manager", "cert-manager-external-issuer", "given-certificate"):
        docs = helm.rendered(name)
        ((ext,),) = [c["extenders"] for c in helm.scheduler_configs(docs)]
        deployments = {d["metadata"]["name"]: d for d in helm.of_kind(docs, "Deployment")}
        pod = deployments["crihook-kube-scheduler"]["spec"]["template"]["spec"]
        (mount,) = pod["containers"][0]["volumeMounts"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        paths = {i["path"] for s in volume["projected"]["sources"] for v in s.values() for i in v["items"]}
        for key in ("caFile", "certFile", "keyFile"):
            assert ext["tlsConfig"][key].startswith(mount["mountPath"] + "/"), (name, key)
            assert ext["tlsConfig"][key].removeprefix(mount["mountPath"] + "/") in paths, (name, key)
        args = deployments["crihook-scheduler"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--client-ca=/etc/crihook/tls/ca.crt" in args, name
    certificates = helm.of_kind(helm.rendered("cert-manager"), "Certificate")
    (client,) = [c for c in certificates if "client auth" in c["spec"].get("usages", [])]
    scheduler_args = helm.of_kind(helm.rendered("cert-manager"), "Deployment")
    assert any(
        f"--extender-client={client['spec']['commonName']}" in c["args"]
        for d in scheduler_args
        for c in d["spec"]["template"]["spec"]["containers"]
        if c.get("args")
    )
    external = [c for c in helm.of_kind(helm.rendered("cert-manager-external-issuer"), "Certificate")]
    assert {c["spec"]["issuerRef"]["group"] for c in external} == {"awspca.cert-manager.io"}


def node_affinity_matches(affinity: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' rule for requiredDuringScheduling node affinity: any term, all its expressions."""
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]

    def holds(e: dict[str, Any]) -> bool:
        if e["operator"] == "In":
            return labels.get(e["key"]) in e["values"]
        if e["operator"] == "Exists":
            return e["key"] in labels
        raise AssertionError(e)

    return any(all(holds(e) for e in t["matchExpressions"]) for t in terms)


@pytest.mark.parametrize(
    ("labels", "placed"),
    [
        ({"feature.node.kubernetes.io/pci-10de.present": "true"}, True),  # node feature discovery alone
        ({"nvidia.com/gpu.present": "true"}, True),  # GPU feature discovery, or by hand
        ({"feature.node.kubernetes.io/cpu-model.vendor_id": "NVIDIA"}, True),  # Tegra
        ({"kubernetes.io/hostname": "cpu-node"}, False),
        ({"feature.node.kubernetes.io/pci-10de.present": "false"}, False),
    ],
    ids=json.dumps,
)
def test_daemonset_placed_where_nvidias_charts_place_theirs(labels: dict[str, str], placed: bool) -> None:
    spec, _, _ = node_pod()
    assert node_affinity_matches(spec["affinity"], labels) is placed
    assert not spec.get("nodeSelector")


def test_own_node_affinity_replaces_the_gpu_rule() -> None:
    mine = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}
    values = {"node": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": mine}}}}
    (ds,) = helm.of_kind(helm.documents_of(helm.template_text(Combo(values), NEWEST), "mine"), "DaemonSet")
    affinity = ds["spec"]["template"]["spec"]["affinity"]
    assert node_affinity_matches(affinity, {"pool": "gpu"})
    assert not node_affinity_matches(affinity, {"nvidia.com/gpu.present": "true"})


SPREAD_TERM = {"topologyKey": "kubernetes.io/hostname"}
MINE = {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {"matchLabels": {"team": "ml"}}}


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        ({}, {"requiredDuringSchedulingIgnoredDuringExecution": [SPREAD_TERM]}),
        ({"antiAffinity": "required"}, {"requiredDuringSchedulingIgnoredDuringExecution": [SPREAD_TERM]}),
        (
            {"antiAffinity": "preferred"},
            {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": SPREAD_TERM}]},
        ),
        ({"antiAffinity": "none"}, None),
        (
            {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [MINE]}}},
            {"requiredDuringSchedulingIgnoredDuringExecution": [MINE]},
        ),
    ],
    ids=json.dumps,
)
def test_scheduler_replicas_spread_as_asked(scheduler: dict[str, Any], expected: dict[str, Any] | None) -> None:
    """scheduler.antiAffinity's rule keeps the replicas apart by node, on the scheduler's own pods;
    a podAntiAffinity of the user's replaces it, and a nodeAffinity beside it is kept."""
    pool = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["cpu"]}]}]}
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": pool}}
    values = {"scheduler": {**scheduler, "affinity": {**own, **scheduler.get("affinity", {})}}}
    assert lint(*helm.values_args(values)).returncode == 0
    docs = helm.documents_of(helm.template_text(Combo(values), NEWEST), "spread")
    (dep,) = [d for d in helm.of_kind(docs, "Deployment") if d["metadata"]["name"] == "crihook-scheduler"]
    spec = dep["spec"]["template"]["spec"]
    assert node_affinity_matches(spec["affinity"], {"pool": "cpu"})
    anti = spec["affinity"].get("podAntiAffinity")
    selector = {"matchLabels": dep["spec"]["selector"]["matchLabels"]}
    for rule in (anti or {}).values():  # the chart's own terms select exactly the scheduler's pods
        for term in rule:
            term = term.get("podAffinityTerm", term)
            if term != MINE:
                assert term.pop("labelSelector") == selector
    assert anti == expected


def test_gpu_operator_driver_root_plugin_index_number_and_update_strategy() -> None:
    spec, containers, config = node_pod("node-gpu-operator")
    assert host_paths(spec, containers["nri"])["/run/nvidia/driver"] == ("/run/crihook/driver", True)
    # the driver's root is not the host's: the host's / gets a mount of its own for HAMi-core's check,
    # as type Directory ("/" always exists: nothing is made on the host, the pod never waits for it)
    assert host_paths(spec, containers["nri"])["/"] == ("/run/crihook/host", True)
    assert config["hooks"]["gpu"]["hami_core"]["host_root"] == "/run/crihook/host"
    (host,) = [v for v in spec["volumes"] if v["name"] == "host"]
    assert host["hostPath"] == {"path": "/", "type": "Directory"}
    (mount,) = [m for m in containers["nri"]["volumeMounts"] if m["name"] == "host"]
    assert "mountPropagation" not in mount  # HostToContainer fails the pod where / is no shared mount
    assert "/" not in host_paths(spec, containers["report"])
    assert "--plugin-index=20" in containers["nri"]["args"]
    assert parse_args("nri", containers["nri"]["args"][1:]).plugin_index == "20"
    (ds,) = helm.of_kind(helm.rendered("node-gpu-operator"), "DaemonSet")
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert spec["nodeSelector"] == {"pool": "gpu"}


# Pod Security Admission's restricted level (k8s.io/pod-security-admission, policy/check_*.go), the
# checks a Deployment's pod template can fail
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_problems(spec: dict[str, Any]) -> list[str]:
    out = []
    pod_sc = spec.get("securityContext", {})
    for v in spec.get("volumes", []):
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(key)
    for c in spec["containers"]:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation")
        if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")) or sc.get("runAsUser") == 0:
            out.append(f"{c['name']}: runAsNonRoot")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or set(sc.get("capabilities", {}).get("add", [])) - {
            "NET_BIND_SERVICE"
        }:
            out.append(f"{c['name']}: capabilities")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: seccompProfile")
        if any("hostPort" in p for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
    return out


@pytest.mark.parametrize("name", ["defaults", "cert-manager", "given-certificate"])
def test_scheduler_pods_meet_the_restricted_pod_security_level(name: str) -> None:
    """The scheduler and the second kube-scheduler run in a namespace labelled
    pod-security.kubernetes.io/enforce=restricted; the node pods need privileged (docs/helm.md)."""
    for dep in helm.of_kind(helm.rendered(name), "Deployment"):
        assert restricted_problems(dep["spec"]["template"]["spec"]) == [], dep["metadata"]["name"]
    (ds,) = helm.of_kind(helm.rendered(name), "DaemonSet")
    assert restricted_problems(ds["spec"]["template"]["spec"])  # the check can fail


def test_installs_as_a_subchart_of_an_umbrella_chart(tmp_path: Path) -> None:
    """A parent chart depending on crihook, with global values and crihook's values under its name:
    lint, dependency build and template with the real helm; the schema accepts `global`."""
    umbrella = tmp_path / "platform"
    (umbrella / "charts").mkdir(parents=True)
    (umbrella / "templates").mkdir()
    (umbrella / "templates" / "settings.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: platform-settings\n"
        "data:\n  registry: {{ .Values.global.imageRegistry | quote }}\n"
    )
    (umbrella / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "1.0.0",
                "dependencies": [{"name": "crihook", "version": __version__, "repository": f"file://{CHART}"}],
            }
        )
    )
    (umbrella / "values.yaml").write_text(
        yaml.safe_dump(
            {
                "global": {"imageRegistry": "registry.example", "storageClass": "fast"},
                "crihook": {"scheduler": {"replicas": 3}},
            }
        )
    )
    helm.run("dependency", "build", str(umbrella))
    assert helm.run("lint", "--strict", str(umbrella), "--kube-version", NEWEST).returncode == 0
    text = helm.run("template", "platform", str(umbrella), "--namespace", "gpu", "--kube-version", NEWEST).stdout
    docs = helm.documents_of(text, "umbrella")
    (scheduler,) = [
        d for d in helm.of_kind(docs, "Deployment") if d["metadata"]["name"] == "platform-crihook-scheduler"
    ]
    assert scheduler["spec"]["replicas"] == 3
    problems = [f"{w}: {p}" for w, d in docs if (p := helm.api_problem(d, NEWEST))]
    assert not problems, "\n".join(problems)


def test_node_metrics_served_to_prometheus_with_each_scrape_checked() -> None:
    """The nri container serves its metrics on the chart's port with the token check on, probes
    /healthz there, and may ask the two reviews; a PodMonitor scrapes that port with a token of a
    reader allowed get /metrics, keeping crihook's own pod labels."""
    spec, containers, config = node_pod("service-monitor")
    parsed = crihook_config.parse(config, "config.toml")
    assert parsed.proxy.metrics_listen == "[::]:9317" and parsed.proxy.metrics_auth_kubeconfig == "in-cluster"
    nri = containers["nri"]
    assert {p["name"]: p["containerPort"] for p in nri["ports"]} == {"metrics": 9317}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert nri[probe]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTPS"}, probe
        assert nri[probe]["timeoutSeconds"] >= 5, probe  # a TLS handshake on a busy node, not 1 s
    assert parsed.proxy.metrics_tls_cert == ""  # each pod makes its own certificate
    docs = helm.rendered("service-monitor")
    bindings = {b["metadata"]["name"]: b for b in helm.of_kind(docs, "ClusterRoleBinding")}
    delegator = bindings["crihook-node-auth-delegator"]
    assert delegator["roleRef"]["name"] == "system:auth-delegator"
    assert delegator["subjects"][0]["name"] == spec["serviceAccountName"]
    (monitor,) = helm.of_kind(docs, "PodMonitor")
    (ds,) = helm.of_kind(docs, "DaemonSet")
    assert monitor["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    secret_name = endpoint["authorization"]["credentials"]["name"]
    (secret,) = [s for s in helm.of_kind(docs, "Secret") if s["metadata"]["name"] == secret_name]
    reader = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
    assert secret["type"] == "kubernetes.io/service-account-token"
    (role,) = [r for r in helm.of_kind(docs, "ClusterRole") if r["metadata"]["name"].endswith("-metrics-reader")]
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    assert {"kind": "ServiceAccount", "name": reader, "namespace": "crihook"} in bindings[reader]["subjects"]
    assert bindings[reader]["roleRef"]["name"] == role["metadata"]["name"]
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9317" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/scheme"] == "https"


@pytest.mark.parametrize(
    ("combo", "secret", "server_name"),
    [
        ("node-metrics-given-certificate", "metrics-tls", "gpu.corp"),
        ("node-metrics-cert-manager", "crihook-node-metrics-tls", "crihook-node-metrics"),
    ],
)
def test_node_metrics_served_with_a_certificate_prometheus_verifies(combo: str, secret: str, server_name: str) -> None:
    """With a certificate of a Secret (given, or cert-manager's), the nri container serves it from the
    mounted Secret (a renewal is a new file the daemon loads), and the PodMonitor checks it against
    the Secret's CA under the name it carries, the pods being scraped by address."""
    spec, containers, config = node_pod(combo)
    parsed = crihook_config.parse(config, "config.toml")
    (mount,) = [m for m in containers["nri"]["volumeMounts"] if m["name"] == "metrics-tls"]
    assert mount["readOnly"] is True and "subPath" not in mount
    assert parsed.proxy.metrics_tls_cert == f"{mount['mountPath']}/tls.crt"
    assert parsed.proxy.metrics_tls_key == f"{mount['mountPath']}/tls.key"
    (volume,) = [v for v in spec["volumes"] if v["name"] == "metrics-tls"]
    assert volume["secret"]["secretName"] == secret
    docs = helm.rendered(combo)
    (monitor,) = helm.of_kind(docs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {"ca": {"secret": {"name": secret, "key": "ca.crt"}}, "serverName": server_name}
    certificates = {c["metadata"]["name"]: c for c in helm.of_kind(docs, "Certificate")}
    if combo == "node-metrics-cert-manager":
        cert = certificates[secret]
        assert cert["spec"]["secretName"] == secret and cert["spec"]["dnsNames"] == [server_name]
        # the scheduler's issuer: the CA the chart makes with cert-manager, whose Secrets carry ca.crt
        assert cert["spec"]["issuerRef"] == {
            "group": "cert-manager.io",
            "kind": "Issuer",
            "name": "crihook-scheduler-ca",
        }
        assert "server auth" in cert["spec"]["usages"]
    else:
        assert secret not in certificates


def test_node_metrics_from_cert_manager_need_an_issuer() -> None:
    """cert-manager for the metrics port alone: the scheduler's issuer is not made, so one is named."""
    for mode, missing in (
        ("certManager", "metrics.node.tls.certManager.issuerRef"),
        ("secret", "metrics.node.tls.secret.name"),
    ):
        done = helm.run("template", "x", str(CHART), "--set", f"metrics.node.tls.mode={mode}", check=False)
        assert done.returncode != 0 and missing in done.stderr, mode


def test_node_metrics_on_loopback_only_when_the_port_is_zero() -> None:
    _, containers, config = node_pod("node-metrics-loopback")
    assert "proxy" not in config
    assert crihook_config.parse(config, "config.toml").proxy.metrics_listen.startswith("127.0.0.1:")
    assert "ports" not in containers["nri"] and "livenessProbe" not in containers["nri"]
    assert [m for m in containers["nri"]["volumeMounts"] if m["name"] == "kube-api"] == []
    assert not helm.of_kind(helm.rendered("node-metrics-loopback"), "PodMonitor")
