"""crihook's DRA driver gpu.crihook.io on the one-node cluster, in either mode: in NRI mode the chart's
DRA DaemonSet (`dra.enabled`) runs `crihook dra`; in proxy mode the node runs it beside `crihook
serve` as crihook-dra.service does (its command, on the node daemon's configuration file, state
directory, and credentials bound to the chart's ClusterRole) and the chart renders only the
DeviceClass and that role (`node.enabled=false`).
kube-scheduler allocates from the driver's ResourceSlices, kubelet prepares the claims through
`crihook dra`, containerd applies the claims' CDI specs and crihook's node daemon keeps what they
bring. The container sees exactly the claimed GPUs; two claims share one GPU by
capacity with HAMi-core's limits; `matchAttribute` on the NVLink partition attribute gives an NVLink
pair; a deleted pod's claim is unprepared and its CDI spec removed; a claim's GPU is never given to a
pod of crihook's own allocator and the reverse; with `kubeScheduler.scoreClaimPods` in extender mode
the cluster's kube-scheduler asks crihook to score a claim pod's nodes, and places pods without it
while crihook's scheduler is down.

The simulated node is NVLink's hybrid cube mesh, which has no built-in partition table: the values
give the driver one of NVLink-linked pairs, as an operator of such a node would."""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import RbacAuthorizationV1Api, ResourceV1Api
from kubernetes.client.exceptions import ApiException

from crihook.base import dra
from crihook.scheduler.ha import LEADER_LABEL
from tests.cluster.test_failsafe import scale, scheduler_url
from tests.support.cluster import NODE_NAME, Cluster, ClusterError, Component, eventually, kubeconfig
from tests.support.clusterchart import (
    DRIVER_MOUNT,
    NAMESPACE,
    RELEASE,
    extender_values,
    upgrade,
    use_extender,
    user_values,
)
from tests.support.containerd import BUSYBOX_IMAGE

pytestmark = pytest.mark.cluster

NS = "default"
ALLOCATED = "scheduling.koordinator.sh/device-allocated"
REPORT = (
    'echo "visible=$NVIDIA_VISIBLE_DEVICES"; echo "sm=$CUDA_DEVICE_SM_LIMIT";'
    ' echo "mem=$CUDA_DEVICE_MEMORY_LIMIT_0"; echo "dev=$(ls /dev | grep "^nvidia[0-9]" | tr "\\n" " ")"; sleep 3600'
)


def nvlink_pairs(cluster: Cluster) -> list[list[int]]:
    """The node's GPUs in NVLink-linked pairs, by minor (each pair linked directly)."""
    assert cluster.sim is not None
    gpus = cluster.sim.doc["gpus"]
    minor_of = {g["pci_bus_id"].lower(): g["minor"] for g in gpus}
    links = {g["minor"]: {minor_of[n["remote"].lower()] for n in g.get("nvlinks", [])} for g in gpus}
    pairs, paired = [], set()
    for minor in sorted(links):
        partner = next((m for m in sorted(links[minor]) if m not in paired and m != minor), None)
        if minor not in paired and partner is not None:
            pairs.append([minor, partner])
            paired |= {minor, partner}
    return pairs


def write_partition_table(cluster: Cluster) -> Path:
    """The node's NVLink pairs as a partition table, in the driver's root (which the chart mounts)."""
    assert cluster.sim is not None
    pairs = nvlink_pairs(cluster)
    table = {
        "1": [{"minors": [m]} for p in pairs for m in p],  # a table names every size pods may ask for
        "2": [{"minors": p, "gpuLinkType": "NVLink"} for p in pairs],
    }
    path = cluster.sim.root / "partitions.json"
    path.write_text(json.dumps(table))
    return path


def dra_values(cluster: Cluster) -> dict[str, Any]:
    """The user's values with the DRA driver on; the runtime's CDI dir is containerd's own. In proxy
    mode (no node pods) the chart makes the DeviceClass only."""
    assert cluster.containerd is not None and cluster.sim is not None
    write_partition_table(cluster)
    values = user_values(cluster)
    if cluster.mode == "proxy":
        values["dra"] = {"enabled": True}
        return values
    cdi = str(cluster.containerd.cdi_spec_dir)
    values["node"]["config"]["reporter"] = {"partition_table": f"{DRIVER_MOUNT}/partitions.json"}
    values["dra"] = {"enabled": True, "cdiDir": cdi}
    return values


def slice_devices(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The devices of the driver's slices on the node, by name."""
    found = ResourceV1Api(cluster.api()).list_resource_slice(field_selector=f"spec.nodeName={NODE_NAME}")
    return {
        d.name: cluster.api().sanitize_for_serialization(d)
        for s in found.items
        if s.spec.driver == dra.DRIVER
        for d in s.spec.devices or []
    }


DRIVER_USER = "crihook-dra-node"  # the proxy-mode driver's own identity


def node_driver(cluster: Cluster) -> Component:
    """`crihook dra` on the node, as crihook-dra.service runs it beside `crihook serve`: the node
    daemon's configuration file (its node, NVML and HAMi-core paths) with the partition table added,
    its state directory, kubelet's root and containerd's CDI dir. Its credentials are a user's of
    their own with nothing but the chart's ClusterRole bound (a drop-in's --kubeconfig; the unit's
    default is the file's [reporter] kubeconfig), so the role is shown to be enough."""
    assert cluster.crihook is not None and cluster.containerd is not None
    pki = cluster.pki
    pki.issue("crihook-dra", f"/CN={DRIVER_USER}", "clientAuth")
    credentials = kubeconfig(
        cluster.base / "crihook-dra.kubeconfig", cluster.server, pki.ca, pki.cert("crihook-dra"), pki.key("crihook-dra")
    )
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": DRIVER_USER},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{RELEASE}-dra"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DRIVER_USER}],
    }
    RbacAuthorizationV1Api(cluster.api()).create_cluster_role_binding(binding)
    config = cluster.crihook.config_path.read_text()
    assert config.count("\n[reporter]\n") == 1, config
    table = f'[reporter]\npartition_table = "{write_partition_table(cluster)}"\n'
    path = cluster.base / "crihook-dra.toml"
    path.write_text(config.replace("[reporter]\n", table))
    argv = [sys.executable, "-m", "crihook.cli", "dra", "--config", str(path), "--kubeconfig", str(credentials)]
    argv += ["--kubelet-root", str(cluster.kubelet_root), "--state-dir", str(cluster.crihook.state_dir)]
    argv += ["--cdi-dir", str(cluster.containerd.cdi_spec_dir)]
    driver = Component("crihook-dra", argv, cluster.base / "logs" / "crihook-dra.log")
    driver.start()
    cluster.components[driver.name] = driver  # its log goes with the cluster's
    return driver


@pytest.fixture(scope="module")
def dra_cluster(installed: Cluster) -> Iterator[Cluster]:
    upgrade(installed, dra_values(installed))
    driver = None
    if installed.mode == "proxy":
        driver = node_driver(installed)
    else:
        installed.wait_selected_pod_running("crihook", "app.kubernetes.io/component=dra")
    try:
        got = eventually(lambda: len(slice_devices(installed)), 8, timeout=90)
        if got != 8:
            raise ClusterError(f"{got} devices in gpu.crihook.io's slices, not 8\n{installed.logs()}")
        yield installed
    finally:
        if driver is not None:
            driver.stop()
            installed.components.pop(driver.name)
            RbacAuthorizationV1Api(installed.api()).delete_cluster_role_binding(DRIVER_USER)
        upgrade(installed, user_values(installed))


@pytest.fixture
def made(dra_cluster: Cluster) -> Iterator[list[tuple[str, str]]]:
    """(kind, name) of what a test makes in `default`; deleted after it, pods first."""
    things: list[tuple[str, str]] = []
    yield things
    resource = ResourceV1Api(dra_cluster.api())
    for kind, name in things:
        if kind == "pod":
            dra_cluster.delete_pod(NS, name)
    for kind, name in things:
        if kind == "claim":
            try:
                resource.delete_namespaced_resource_claim(name, NS)
            except ApiException as e:
                if e.status != 404:
                    raise


def claim(name: str, request: dict[str, Any], constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": {"deviceClassName": dra.DRIVER, **request}}]}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": devices},
    }


def pod(name: str, claim_name: str | None = None, gpus: int = 0) -> dict[str, Any]:
    """A pod that reports its GPUs: holding the claim, or asking crihook for `gpus` whole GPUs."""
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", REPORT],
    }
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    if claim_name is not None:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_name}]
        container["resources"] = {"claims": [{"name": "gpu"}]}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def run(cluster: Cluster, made: list[tuple[str, str]], p: dict[str, Any], c: dict[str, Any] | None = None) -> Any:
    """Create the claim (if any) and the pod, wait for the pod to run; the pod."""
    if c is not None:
        ResourceV1Api(cluster.api()).create_namespaced_resource_claim(NS, c)
        made.append(("claim", c["metadata"]["name"]))
    cluster.create_pod(NS, p)
    made.append(("pod", p["metadata"]["name"]))
    return cluster.wait_pod_running(NS, p["metadata"]["name"], timeout=120)


def reported(cluster: Cluster, name: str, ns: str = NS) -> dict[str, str]:
    """What the container printed at start: visible, sm, mem, dev."""
    text = eventually(
        lambda: str(cluster.core().read_namespaced_pod_log(name, ns)), None, compare=lambda got, _: "dev=" in got
    )
    return dict(re.findall(r"^(\w+)=(.*)$", text, re.M))


def allocated(cluster: Cluster, name: str, ns: str = NS) -> list[dict[str, Any]]:
    """The claim's allocation results."""
    doc = ResourceV1Api(cluster.api()).read_namespaced_resource_claim(name, ns)
    results = cluster.api().sanitize_for_serialization(doc)["status"]["allocation"]["devices"]["results"]
    return list(results)


def uuid_of(cluster: Cluster, device: str) -> str:
    assert cluster.sim is not None
    minor = dra.device_minor(device)
    return str(next(g["uuid"] for g in cluster.sim.doc["gpus"] if g["minor"] == minor))


def seen(report: dict[str, str]) -> tuple[list[str], list[int]]:
    uuids = [u for u in report["visible"].split(",") if u]
    minors = sorted(int(d.removeprefix("nvidia")) for d in report["dev"].split())
    return uuids, minors


def minors_of(uuids: list[str], cluster: Cluster) -> list[int]:
    assert cluster.sim is not None
    by_uuid = {g["uuid"]: g["minor"] for g in cluster.sim.doc["gpus"]}
    return sorted(by_uuid[u] for u in uuids)


def spec_file(cluster: Cluster, uid: str) -> Path:
    assert cluster.containerd is not None
    return Path(cluster.containerd.cdi_spec_dir) / f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_{uid}.json"


def test_a_claim_gets_exactly_its_gpu_and_its_spec_goes_with_the_pod(
    dra_cluster: Cluster, made: list[tuple[str, str]]
) -> None:
    run(dra_cluster, made, pod("dra-one", "one-gpu"), claim("one-gpu", {}))
    (result,) = allocated(dra_cluster, "one-gpu")
    assert (result["driver"], result["pool"]) == (dra.DRIVER, dra.pool_name(NODE_NAME))
    uuids, minors = seen(reported(dra_cluster, "dra-one"))
    assert uuids == [uuid_of(dra_cluster, result["device"])]
    assert minors == [dra.device_minor(result["device"])]
    uid = str(ResourceV1Api(dra_cluster.api()).read_namespaced_resource_claim("one-gpu", NS).metadata.uid)
    assert spec_file(dra_cluster, uid).is_file()
    dra_cluster.delete_pod(NS, "dra-one")
    assert eventually(lambda: spec_file(dra_cluster, uid).exists(), False) is False


def test_two_claims_share_one_gpu_by_capacity_with_their_limits(
    dra_cluster: Cluster, made: list[tuple[str, str]]
) -> None:
    target = uuid_of(dra_cluster, "gpu-3")
    select = {"selectors": [{"cel": {"expression": f'device.attributes["{dra.DRIVER}"].uuid == "{target}"'}}]}
    half = {**select, "capacity": {"requests": {"cores": "50", "memory": "8Gi"}}}
    for name in ("half-a", "half-b"):
        run(dra_cluster, made, pod(name, name), claim(name, half))
    for name in ("half-a", "half-b"):
        (result,) = allocated(dra_cluster, name)
        assert result["device"] == "gpu-3" and result["consumedCapacity"]["cores"] == "50"
        report = reported(dra_cluster, name)
        assert seen(report) == ([target], [3])
        assert (report["sm"], report["mem"]) == ("50", "8192m")


def test_an_nvlink_pair_through_match_attribute(dra_cluster: Cluster, made: list[tuple[str, str]]) -> None:
    attribute = f"{dra.DRIVER}/nvlinkPartition2"
    run(dra_cluster, made, pod("dra-pair", "pair"), claim("pair", {"count": 2}, [{"matchAttribute": attribute}]))
    devices = sorted(dra.device_minor(r["device"]) or 0 for r in allocated(dra_cluster, "pair"))
    assert devices in [sorted(p) for p in nvlink_pairs(dra_cluster)]
    uuids, minors = seen(reported(dra_cluster, "dra-pair"))
    assert minors == devices and minors_of(uuids, dra_cluster) == devices


def test_a_claims_gpus_are_never_given_to_an_allocator_pod(dra_cluster: Cluster, made: list[tuple[str, str]]) -> None:
    run(dra_cluster, made, pod("dra-seven", "seven"), claim("seven", {"count": 7}))
    held = {dra.device_minor(r["device"]) for r in allocated(dra_cluster, "seven")}
    left = ({g["minor"] for g in dra_cluster.sim.doc["gpus"]} if dra_cluster.sim else set()) - held
    assert len(left) == 1
    running = run(dra_cluster, made, pod("allocator-one", gpus=1))
    assert ALLOCATED in (running.metadata.annotations or {})
    uuids, minors = seen(reported(dra_cluster, "allocator-one"))
    assert minors == sorted(left) and minors_of(uuids, dra_cluster) == sorted(left)


def test_an_allocator_pods_gpus_leave_the_slices(dra_cluster: Cluster, made: list[tuple[str, str]]) -> None:
    run(dra_cluster, made, pod("allocator-two", gpus=2))
    _, minors = seen(reported(dra_cluster, "allocator-two"))
    taken = {dra.device_name(m) for m in minors}
    names = eventually(lambda: set(slice_devices(dra_cluster)), None, compare=lambda got, _: not got & taken)
    assert not names & taken and len(names) == 6
    run(dra_cluster, made, pod("dra-six", "six"), claim("six", {"count": 6}))
    assert {r["device"] for r in allocated(dra_cluster, "six")} == names
    # and the Device object still lists every GPU: the claim's are counted as taken by crihook's scheduler
    device = dra_cluster.device(NODE_NAME) or {}
    assert len([d for d in device["spec"]["devices"] if d["type"] == "gpu"]) == 8


def node_state_dir(cluster: Cluster) -> Path:
    """The node daemon's state dir, which the driver shares (its checkpoint in `dra/`)."""
    if cluster.mode == "proxy":
        assert cluster.crihook is not None
        return cluster.crihook.state_dir
    return Path(user_values(cluster)["node"]["stateDir"])


def test_top_shows_a_claims_share_as_the_containers_grant(dra_cluster: Cluster, made: list[tuple[str, str]]) -> None:
    """The node daemon's usage collector reads the share the driver recorded in the state dir they
    share: `crihook top` on the node shows it as the container's grant, beside the claim."""
    target = uuid_of(dra_cluster, "gpu-5")
    select = {"selectors": [{"cel": {"expression": f'device.attributes["{dra.DRIVER}"].uuid == "{target}"'}}]}
    quarter = {**select, "capacity": {"requests": {"cores": "25", "memory": "4Gi"}}}
    run(dra_cluster, made, pod("dra-quarter", "quarter"), claim("quarter", quarter))
    top = [
        sys.executable,
        "-m",
        "crihook.cli",
        "top",
        "--once",
        "--json",
        "--state-dir",
        str(node_state_dir(dra_cluster)),
    ]

    def shown() -> tuple[list[str], int, int] | None:
        done = subprocess.run(top, capture_output=True, text=True, timeout=60)
        rows = json.loads(done.stdout)["rows"] if done.returncode == 0 else []
        return next(
            ((r["claims"], r["granted_core"], r["granted_memory"]) for r in rows if r["pod"] == "dra-quarter"), None
        )

    want = ([f"{NS}/quarter/gpu"], 25, 4 << 30)
    got = eventually(shown, want, timeout=60)
    if got != want:
        done = subprocess.run(top, capture_output=True, text=True, timeout=60)
        raise AssertionError(f"{got}\ncrihook top: {done.stdout}{done.stderr}\n{dra_cluster.logs()}")


CONVERTED_NS = "dra-team"


def test_an_opted_in_namespaces_gpu_request_becomes_a_claim_and_gets_exactly_its_gpu(
    dra_cluster: Cluster, made: list[tuple[str, str]]
) -> None:
    """dra.convert: in a namespace labelled gpu.crihook.io/dra=on, a pod asking nvidia.com/gpu: 1 is
    turned by /mutate-dra into a claim of gpu.crihook.io, which kube-scheduler allocates and crihook's
    driver prepares; the container sees exactly the allocated GPU, and crihook's allocator gave none."""
    if dra_cluster.mode != "nri":
        pytest.skip("the chart's DRA driver runs in NRI mode (proxy mode's driver is the host's)")
    values = dra_values(dra_cluster)
    values["dra"]["convert"] = {"enabled": True}
    upgrade(dra_cluster, values)  # the scheduler restarts with --dra-convert
    core = dra_cluster.core()
    core.create_namespace({"metadata": {"name": CONVERTED_NS, "labels": {"gpu.crihook.io/dra": "on"}}})
    try:
        eventually(lambda: bool(core.list_namespaced_service_account(CONVERTED_NS).items), True)
        created = eventually(lambda: admitted(dra_cluster, CONVERTED_NS, pod("converted", gpus=1)), True, timeout=120)
        assert created, "the webhooks did not answer within 120 s"
        running = dra_cluster.wait_pod_running(CONVERTED_NS, "converted", timeout=120)
        (ref,) = running.spec.resource_claims
        assert ref.resource_claim_template_name.startswith("crihook-gpu-")
        assert "nvidia.com/gpu" not in (running.spec.containers[0].resources.limits or {})
        assert ALLOCATED not in (running.metadata.annotations or {})
        assert running.spec.scheduler_name == "default-scheduler"
        (status,) = running.status.resource_claim_statuses
        (result,) = allocated(dra_cluster, status.resource_claim_name, CONVERTED_NS)
        assert (result["driver"], result["pool"]) == (dra.DRIVER, dra.pool_name(NODE_NAME))
        uuids, minors = seen(reported(dra_cluster, "converted", CONVERTED_NS))
        assert uuids == [uuid_of(dra_cluster, result["device"])]
        assert minors == [dra.device_minor(result["device"])]
    finally:
        dra_cluster.delete_pod(CONVERTED_NS, "converted")
        core.delete_namespace(CONVERTED_NS)
        upgrade(dra_cluster, dra_values(dra_cluster))


def admitted(cluster: Cluster, ns: str, p: dict[str, Any]) -> bool:
    """Create the pod; False while the webhooks do not answer (the scheduler just restarted)."""
    try:
        cluster.core().create_namespaced_pod(ns, p)
    except ApiException as e:
        if e.status == 500 and "failed calling webhook" in str(e.body):
            return False
        raise
    return True


def node_without_gpu_resource(cluster: Cluster) -> None:
    """Take nvidia.com/gpu off the node's status, as on a node where nothing advertises it: the
    reporter, now off, wrote it, and kubelet keeps extended resources it did not set."""
    status = cluster.api().sanitize_for_serialization(cluster.core().read_node(NODE_NAME))["status"]
    ops = [
        {"op": "remove", "path": f"/status/{kind}/nvidia.com~1gpu"}
        for kind in ("capacity", "allocatable")
        if "nvidia.com/gpu" in (status.get(kind) or {})
    ]
    if ops:
        cluster.core().patch_node_status(NODE_NAME, ops)


def test_a_plain_gpu_request_is_served_through_the_extended_resource_class(
    dra_cluster: Cluster, made: list[tuple[str, str]]
) -> None:
    """dra.extendedResourceName=nvidia.com/gpu (KEP-5004, on by default from 1.36, GA in 1.37): on a
    node that does not advertise nvidia.com/gpu, kube-scheduler makes a plain request a claim of
    extended.gpu.crihook.io; the container sees exactly the allocated GPU."""
    if dra_cluster.mode != "nri":
        pytest.skip("the chart's DRA driver runs in NRI mode (proxy mode's driver is the host's)")
    values = dra_values(dra_cluster)
    values["dra"]["extendedResourceName"] = "nvidia.com/gpu"
    values["node"]["reporter"] = {"enabled": False}
    upgrade(dra_cluster, values)
    try:
        node_without_gpu_resource(dra_cluster)
        p = pod("extended", gpus=1)
        p["metadata"]["labels"] = {"gpu.crihook.io/webhook": "off"}  # the cluster's scheduler, not crihook's
        running = run(dra_cluster, made, p)
        assert ALLOCATED not in (running.metadata.annotations or {})
        claim_name = running.status.extended_resource_claim_status.resource_claim_name
        (result,) = allocated(dra_cluster, claim_name)
        assert (result["driver"], result["pool"]) == (dra.DRIVER, dra.pool_name(NODE_NAME))
        uuids, minors = seen(reported(dra_cluster, "extended"))
        assert uuids == [uuid_of(dra_cluster, result["device"])]
        assert minors == [dra.device_minor(result["device"])]
    finally:
        dra_cluster.delete_pod(NS, "extended")
        upgrade(dra_cluster, dra_values(dra_cluster))


PEER = "crihook-score-peer"  # a second Node object, so kube-scheduler has nodes to score
PRIORITIZE_CLAIMS = re.compile(r'^crihook_scheduler_requests_total\{(?=[^}]*path="/prioritize-claims")[^}]*\} (\S+)$')


def prioritize_claims_answered(cluster: Cluster) -> float:
    """crihook_scheduler_requests_total of /prioritize-claims, summed over the status codes, read
    from the leader through its Service (once the Service's relay has the leader's pod)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # GET /metrics needs no client

    def scrape() -> str | None:
        try:
            with urllib.request.urlopen(scheduler_url(cluster, "/metrics"), timeout=10, context=context) as reply:
                return str(reply.read().decode())
        except OSError:
            return None

    text = eventually(scrape, None, compare=lambda got, _: got is not None)
    if text is None:
        raise ClusterError(f"crihook's scheduler did not answer GET /metrics\n{cluster.logs()}")
    return sum(float(m[1]) for line in text.splitlines() if (m := PRIORITIZE_CLAIMS.match(line)))


@contextlib.contextmanager
def peer_node(cluster: Cluster) -> Iterator[None]:
    """A Node with no kubelet behind it, with room for pods and a slice of gpu.crihook.io holding two
    devices: a second node every test pod below fits (they tolerate its not-ready taints), so
    kube-scheduler scores nodes for them; a pod alone on one feasible node is never scored.
    kube-scheduler's watches of nodes, slices and pods are apart, so a pod made at once may be
    scheduled before it knows the peer: a probe pod whose claim can only be met there is bound
    there first, and holds one device while the other stays free for the tests' claims."""
    core, resource = cluster.core(), ResourceV1Api(cluster.api())
    core.create_node({"metadata": {"name": PEER, "labels": {"kubernetes.io/hostname": PEER}}})
    room = {"cpu": "1", "memory": "1Gi", "pods": "10"}
    core.patch_node_status(PEER, {"status": {"capacity": room, "allocatable": room}})
    pool = {"name": PEER, "generation": 1, "resourceSliceCount": 1}
    devices = [{"name": "gpu-0"}, {"name": "gpu-1"}]
    spec = {"driver": dra.DRIVER, "nodeName": PEER, "pool": pool, "devices": devices}
    resource.create_resource_slice({"metadata": {"name": f"{PEER}-{dra.DRIVER}"}, "spec": spec})
    probe = pod("peer-probe", "peer-probe")
    probe["spec"]["nodeSelector"] = {"kubernetes.io/hostname": PEER}
    probe["spec"]["tolerations"] = [{"operator": "Exists"}]
    resource.create_namespaced_resource_claim(NS, claim("peer-probe", {}))
    try:
        cluster.create_pod(NS, probe)
        bound = eventually(lambda: core.read_namespaced_pod("peer-probe", NS).spec.node_name, PEER)
        assert bound == PEER, f"kube-scheduler did not place the probe on {PEER}: {bound}"
        yield
    finally:
        cluster.delete_pod(NS, "peer-probe")
        with contextlib.suppress(ApiException):
            resource.delete_namespaced_resource_claim("peer-probe", NS)
        resource.delete_resource_slice(f"{PEER}-{dra.DRIVER}")
        core.delete_node(PEER)


def placed_here(p: dict[str, Any]) -> dict[str, Any]:
    """The pod, fitting the peer as well (every taint tolerated) but preferring the real node (node
    affinity's score, weight 2 times 100), which it alone can run on."""
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME]}]}
    p["spec"]["tolerations"] = [{"operator": "Exists"}]
    p["spec"]["affinity"] = {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": term}]}
    }
    return p


def test_claim_pods_are_scored_by_crihook_and_plain_pods_placed_without_it(
    dra_cluster: Cluster, made: list[tuple[str, str]]
) -> None:
    """kubeScheduler.scoreClaimPods in extender mode: the cluster's own kube-scheduler, configured by
    the stanza, sends a claim pod (no extended resources) to crihook's /prioritize-claims and the pod
    runs with its claim; with crihook's scheduler scaled to zero, a plain pod is still scheduled and
    runs (the entry is ignorable, and a failed prioritize costs nothing but its score)."""
    values = extender_values(dra_cluster, dra_values(dra_cluster))
    values["kubeScheduler"]["scoreClaimPods"] = {"enabled": True}
    use_extender(dra_cluster, values)
    try:
        stanza = Path(values["kubeScheduler"]["caFile"]).with_name("config.yaml")  # what kube-scheduler runs with
        (_, second) = yaml.safe_load(stanza.read_text())["extenders"]
        assert second["prioritizeVerb"] == "prioritize-claims" and second["ignorable"] is True
        dra_cluster.wait_selected_pod_running(NAMESPACE, f"{LEADER_LABEL}=true", timeout=120)
        with peer_node(dra_cluster):
            before = prioritize_claims_answered(dra_cluster)
            running = run(dra_cluster, made, placed_here(pod("dra-scored", "scored")), claim("scored", {}))
            assert running.spec.node_name == NODE_NAME and running.spec.scheduler_name == "default-scheduler"
            assert prioritize_claims_answered(dra_cluster) > before
            (result,) = allocated(dra_cluster, "scored")
            assert result["pool"] == dra.pool_name(NODE_NAME)
            assert seen(reported(dra_cluster, "dra-scored"))[0] == [uuid_of(dra_cluster, result["device"])]
            scale(dra_cluster, 0)
            try:
                running = run(dra_cluster, made, placed_here(pod("plain-unscored")))
                assert running.spec.node_name == NODE_NAME
            finally:
                scale(dra_cluster, 1)
    finally:
        upgrade(dra_cluster, dra_values(dra_cluster))
        dra_cluster.start_scheduler()
