"""A one-node Kubernetes cluster for the cluster tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kubelet, built from Kubernetes' own Go modules (tests/kube/build.sh), with the
private containerd 2.x of crihook.simnode.containerd as the node's runtime.

Two node modes: "nri" (kubelet talks to containerd, whose NRI socket crihook's node pod dials) and
"proxy" (kubelet talks to `crihook serve` on the host, in front of containerd).

Everything lives in one temporary directory and on host-local addresses: a bridge of its own (the
pods' network, CNI from Debian's containernetworking-plugins) carrying the node's address and the
`kubernetes` Service's ClusterIP, on which kube-apiserver listens on 443 itself. So pods and
host-network pods reach the API server through the in-cluster environment with no kube-proxy and no
iptables, and kube-apiserver reaches webhooks through `--enable-aggregator-routing`. Other Services'
ClusterIPs and names are served by tests/support/clusternet.py, one of the cluster's components. `close()`
leaves nothing behind: processes (ended by pid), mounts, cgroups, the bridge, files outside the
directory (`leftovers()` says what is left, for the teardown test).

Facts about these hosts this relies on (tried): cgroups are v1 with a v2 tree beside them (hybrid),
so kubelet and containerd use the cgroupfs driver and kubelet needs `failCgroupV1: false`; there is
no swap accounting (`failSwapOn: false`); kubelet keeps its device-plugin socket in
/var/lib/kubelet/device-plugins whatever its root dir, so that directory is cleaned by name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi, VersionApi
from kubernetes.client.exceptions import ApiException
from kubernetes.config import new_client_from_config

from crihook.simnode import fakenvml
from crihook.simnode.containerd import (
    Containerd,
    cgroup_hierarchies,
    end_process,
    mounts_below,
    remove_cgroup_tree,
    runtime,
    unmount_below,
)
from crihook.simnode.daemon import Crihook
from crihook.simnode.fakenvml import cache_dir
from crihook.simnode.node import SimNode, make_sim_node

ROOT = Path(__file__).resolve().parents[2]
NODE_NAME = "crihook-node"
CNI_BIN = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")  # kubelet's, whatever --root-dir says
MODES = ("nri", "proxy")
TOPOLOGY = "dgx1-v100"  # 8 GPUs in NVLink's hybrid cube mesh: not every pair is linked
T = TypeVar("T")


class ClusterError(RuntimeError):
    """A component did not come up; the message carries its log's tail."""


# ---------------------------------------------------------------- the programs


def kube_binary() -> Path | None:
    """The kube binary tests/kube/build.sh made for the current tests/kube sources, if it is built."""
    done = subprocess.run(["bash", str(ROOT / "tests" / "kube" / "build.sh"), "--path"], capture_output=True, text=True)
    return Path(done.stdout.strip()) if done.returncode == 0 else None


def etcd_binary() -> Path:
    """sid's etcd, as `tests/runtimes.sh sid:etcd-server` extracts it."""
    base = Path(os.environ["CRIHOOK_RUNTIMES"]) if "CRIHOOK_RUNTIMES" in os.environ else cache_dir() / "runtimes"
    return base / "sid-etcd-server" / "root" / "usr" / "bin" / "etcd"


def missing_requirements() -> str | None:
    """Why the cluster can not run here, or None."""
    if os.geteuid() != 0:
        return "the cluster tests need root (kubelet, containerd, a bridge)"
    if kube_binary() is None:
        return "the Kubernetes programs are not built: bash tests/kube/build.sh (tests/cluster.sh does it)"
    if not etcd_binary().is_file():
        return "etcd is not fetched: bash tests/runtimes.sh sid:etcd-server (tests/cluster.sh does it)"
    if not (CNI_BIN / "bridge").is_file():
        return "the CNI plugins are missing: apt-get install containernetworking-plugins (tests/run.sh does it)"
    if shutil.which("openssl") is None:
        return "the cluster's certificates are made with the openssl command"
    reason = runtime("2").unavailable()
    if reason is not None:
        return reason
    return None


# ---------------------------------------------------------------- network


def _host_networks() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return [ipaddress.ip_interface(line.split()[3]).network for line in out.splitlines()]


@dataclass(frozen=True)
class Network:
    """The cluster's addresses: pods in 10.(200+n).N.0/24 behind a bridge of their own whose gateway
    is the node's address; Services in the next /24, the first of which (the `kubernetes` Service)
    is also on the bridge, so kube-apiserver listens on it."""

    index: int

    @classmethod
    def choose(cls) -> Network:
        """A set of addresses no interface of this host uses (clusters of parallel runs included)."""
        used = _host_networks()
        start = os.getpid() % 100
        for step in range(100):
            net = cls((start + step) % 100)
            if not any(net.pods.overlaps(u) or net.services.overlaps(u) for u in used):
                return net
        raise ClusterError("no free 10.200.0.0/15 subnet for the cluster's bridge")

    @property
    def bridge(self) -> str:
        return f"crihook-k{self.index}"

    @property
    def name(self) -> str:
        """The CNI network's name (containerd's result cache is keyed by it)."""
        return f"crihook-cluster-{self.index}"

    @property
    def pods(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.200.{2 * self.index}.0/24")

    @property
    def services(self) -> ipaddress.IPv4Network:
        return ipaddress.ip_network(f"10.200.{2 * self.index + 1}.0/24")

    @property
    def node_ip(self) -> str:
        return str(self.pods[1])

    @property
    def api_ip(self) -> str:
        """The `kubernetes` Service's ClusterIP: the first address of the Service range."""
        return str(self.services[1])

    def create(self) -> None:
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True, capture_output=True)
        # a bridge takes the lowest MAC of its ports unless one was set: when the pod of that port goes,
        # the node's address moves to another MAC while the other pods' ARP entries for it keep the
        # old one. What they send the node is then lost (their API calls, and their answers to the
        # API server's webhook calls once the node has re-learnt their MAC from an ARP sent from the
        # Service address) until the entries expire, tens of seconds. Setting its own MAC pins it,
        # as CNI's bridge plugin does for a gateway.
        subprocess.run(["ip", "link", "set", self.bridge, "address", self.mac()], check=True, capture_output=True)
        for address in (f"{self.node_ip}/{self.pods.prefixlen}", f"{self.api_ip}/32"):
            subprocess.run(["ip", "addr", "add", address, "dev", self.bridge], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True, capture_output=True)

    def mac(self) -> str:
        return Path("/sys/class/net", self.bridge, "address").read_text().strip()

    def delete(self) -> None:
        """The bridge, and with it the veths of any pod left."""
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def exists(self) -> bool:
        return Path("/sys/class/net", self.bridge).exists()

    def cni_config(self, ipam_dir: Path) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": self.name,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,  # the bridge has its address; True would turn on ip_forward
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(ipam_dir),
                        "ranges": [[{"subnet": str(self.pods), "gateway": self.node_ip}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                }
            ],
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ---------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pki:
    """A CA and the certificates the cluster's components present, made with the openssl command."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def _openssl(self, *args: str) -> None:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClusterError(f"openssl {' '.join(args[:2])} failed: {done.stderr.strip()}")

    def make_ca(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(self.key("ca")), "-out", str(self.ca), "-days", "2", "-subj", "/CN=crihook-cluster-ca",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip

    def issue(self, name: str, subject: str, usage: str, sans: tuple[str, ...] = ()) -> None:
        """A certificate for `subject` (e.g. /O=system:nodes/CN=system:node:x) signed by the CA;
        `usage` is serverAuth, clientAuth or both."""
        ext = ["-addext", "basicConstraints=critical,CA:FALSE", "-addext", f"extendedKeyUsage={usage}"]
        if sans:
            ext += ["-addext", "subjectAltName=" + ",".join(sans)]
        self._openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(self.key(name)), "-out", str(self.cert(name)), "-days", "2", "-subj", subject,
            "-CA", str(self.ca), "-CAkey", str(self.key("ca")), *ext,
        )  # fmt: skip

    def make_service_account_key(self) -> None:
        self._openssl("genrsa", "-out", str(self.key("sa")), "2048")
        self._openssl("rsa", "-in", str(self.key("sa")), "-pubout", "-out", str(self.dir / "sa.pub"))


def kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path) -> Path:
    """A kubeconfig with one cluster, user and context."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "crihook", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "crihook", "context": {"cluster": "crihook", "user": "user"}}],
        "current-context": "crihook",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


# ---------------------------------------------------------------- processes


@dataclass
class Component:
    """One of the cluster's programs, run in its own session with its log in the cluster's dir."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # over the test process's
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
                env={**os.environ, **self.env},
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def stop(self, kill: bool = False, timeout: float = 20.0) -> None:
        """SIGTERM (SIGKILL to play a crash) by pid, then wait; SIGKILL if it does not end in time."""
        if self.process is not None:
            end_process(self.process, kill, timeout)
        self.process = None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def check_running(self) -> None:
        if self.process is None or self.process.poll() is not None:
            raise ClusterError(f"{self.name} exited:\n{self.tail()}")


def wait_for(what: str, ready: Callable[[], bool], timeout: float, components: list[Component]) -> None:
    """Poll `ready` until it holds; fail early, with the log, when a component exited."""
    deadline = time.monotonic() + timeout
    while not ready():
        for c in components:
            c.check_running()
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {c.name}\n{c.tail(15)}" for c in components)
            raise ClusterError(f"{what} not within {timeout:.0f}s\n{logs}")
        time.sleep(0.2)


def eventually(
    read: Callable[[], T], want: object, timeout: float = 60.0, compare: Callable[[T, Any], bool] | None = None
) -> T:
    """Read until what is read equals `want` (or `compare(read, want)` holds) or `timeout` passes;
    the last read either way, for the test's own assertion to show."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if (compare(got, want) if compare is not None else got == want) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


# ---------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """The one-node cluster; `start()`, `close()`. `kubeconfig` is the admin's (system:masters)."""

    base: Path
    mode: str
    network: Network
    components: dict[str, Component] = field(default_factory=dict)
    containerd: Containerd | None = None
    crihook: Crihook | None = None
    sim: SimNode | None = None
    started_in: float = 0.0
    kubelet_port: int = field(default_factory=free_port)
    node_metrics_port: int = field(default_factory=free_port)  # the chart's metrics.node.port
    _api: ApiClient | None = field(default=None, repr=False)
    _host_before: set[str] = field(default_factory=set, repr=False)
    _chains_before: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def create(cls, mode: str) -> Cluster:
        if mode not in MODES:
            raise ValueError(f"unknown node mode {mode!r}; known: {', '.join(MODES)}")
        base = Path(tempfile.mkdtemp(prefix=f"crihook-cluster-{mode}-"))
        return cls(base, mode, Network.choose())

    # paths
    @property
    def pki(self) -> Pki:
        return Pki(self.base / "pki")

    @property
    def kubeconfig(self) -> Path:
        return self.base / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://{self.network.api_ip}:443"

    @property
    def kubelet_root(self) -> Path:
        """kubelet's --root-dir: the simulated node's, so its pods dir is the one crihook reads."""
        assert self.sim is not None
        return self.sim.kubelet

    @property
    def kube(self) -> Path:
        path = kube_binary()
        assert path is not None
        return path

    @property
    def version(self) -> str:
        """The cluster's Kubernetes version as its API server reports it (vX.Y.Z)."""
        return str(VersionApi(self.api()).get_code().git_version)

    @property
    def cgroup_root(self) -> str:
        """kubelet's --cgroup-root: the pods' cgroups live below it, and close() removes it."""
        return f"/crihook-cluster-{self.network.index}"

    @property
    def runtime_endpoint(self) -> str:
        """What kubelet dials: containerd itself (NRI mode) or `crihook serve` (proxy mode)."""
        if self.crihook is not None:
            return self.crihook.address
        assert self.containerd is not None
        return self.containerd.address

    # start
    def start(self, timeout: float = 60.0) -> None:
        began = time.monotonic()
        self._host_before = host_entries()
        self._chains_before = iptables_chains()
        self.network.create()
        self._share(self.base)
        self._make_pki()
        self._kubeconfigs()
        self._make_sim_node()
        self._start_runtime()
        kube = str(self.kube)
        etcd_port = free_port()
        self._start(
            "etcd",
            [
                str(etcd_binary()),
                "--name=crihook",
                f"--data-dir={self.base / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{free_port()}",
                "--log-level=warn",
            ],
        )
        pki = self.pki
        self._start(
            "kube-apiserver",
            [
                kube,
                "kube-apiserver",
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={self.network.api_ip}",
                f"--advertise-address={self.network.api_ip}",
                "--secure-port=443",
                f"--cert-dir={self.base / 'apiserver'}",
                f"--service-cluster-ip-range={self.network.services}",
                f"--client-ca-file={pki.ca}",
                f"--tls-cert-file={pki.cert('apiserver')}",
                f"--tls-private-key-file={pki.key('apiserver')}",
                f"--kubelet-client-certificate={pki.cert('apiserver-kubelet')}",
                f"--kubelet-client-key={pki.key('apiserver-kubelet')}",
                f"--kubelet-certificate-authority={pki.ca}",
                "--kubelet-preferred-address-types=InternalIP",
                f"--service-account-key-file={pki.dir / 'sa.pub'}",
                f"--service-account-signing-key-file={pki.key('sa')}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--enable-aggregator-routing=true",
                "--allow-privileged=true",
                "--profiling=false",
            ],
        )
        wait_for("kube-apiserver ready", self._api_ready, timeout, list(self.components.values()))
        self._start(
            "clusternet",
            [sys.executable, "-m", "tests.support.clusternet", f"--kubeconfig={self.kubeconfig}",
             f"--bridge={self.network.bridge}", f"--dns={self.network.node_ip}"],
        )  # fmt: skip
        self._start(
            "kube-controller-manager",
            [
                kube,
                "kube-controller-manager",
                f"--kubeconfig={self.base / 'controller-manager.kubeconfig'}",
                "--secure-port=0",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.key('sa')}",
                f"--root-ca-file={pki.ca}",
                f"--service-cluster-ip-range={self.network.services}",
                "--controllers=*,-nodeipam",
                f"--flex-volume-plugin-dir={self.base / 'flexvolume'}",
            ],
        )
        self.start_scheduler()
        self._start_kubelet(kube)
        remaining = timeout - (time.monotonic() - began)
        wait_for("the node Ready", self._node_ready, max(remaining, 5.0), list(self.components.values()))
        remaining = timeout - (time.monotonic() - began)
        wait_for(
            "the default ServiceAccount", self._default_account, max(remaining, 5.0), list(self.components.values())
        )
        self.started_in = time.monotonic() - began

    def start_scheduler(self, config: Path | None = None) -> None:
        """The cluster's own kube-scheduler, stock or with a `--config` (the extender stanza of
        the chart's extender mode). It resolves names as a pod does, through the cluster's DNS: it
        runs in a mount namespace of its own where /etc/resolv.conf is the cluster's."""
        old = self.components.pop("kube-scheduler", None)
        if old is not None:
            old.stop()
        resolv = self.base / "resolv.conf"
        resolv.write_text(
            f"nameserver {self.network.node_ip}\nsearch svc.cluster.local cluster.local\noptions ndots:5\n"
        )
        flags = [f"--config={config}"] if config is not None else [f"--kubeconfig={self.base / 'scheduler.kubeconfig'}"]
        self._start(
            "kube-scheduler",
            [
                "unshare", "--mount", "--propagation=private", "--", "sh", "-c",
                'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv),
                str(self.kube), "kube-scheduler", "--secure-port=0", "--leader-elect=false", *flags,
            ],
        )  # fmt: skip

    def restart_kubelet(self, timeout: float = 60.0) -> None:
        """Stop kubelet (SIGTERM, by pid) and start it again with the same flags; returns once the
        node is Ready again."""
        kubelet = self.components["kubelet"]
        kubelet.stop()
        kubelet.start()
        # the node stays Ready in the API until its status expires: wait for kubelet's own server
        wait_for("kubelet serving again", self._kubelet_serves, timeout, [kubelet])
        wait_for("the node Ready after kubelet's restart", self._node_ready, timeout, [kubelet])

    @contextlib.contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """One of the cluster's programs stopped (SIGTERM, by pid) for the block, then started again
        with the same flags: kube-controller-manager, to hold a gap a controller would close
        (a DaemonSet's pod not made again until the block ends)."""
        component = self.components[name]
        component.stop()
        try:
            yield
        finally:
            component.start()

    def restart_containerd(self) -> None:
        """Stop containerd (SIGTERM) and start it again; containers keep running in their shims."""
        assert self.containerd is not None
        self.containerd.restart()

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        component = Component(name, argv, self.base / "logs" / f"{name}.log", dict(env or {}))
        component.log.parent.mkdir(exist_ok=True)
        component.start()
        self.components[name] = component
        return component

    def _make_pki(self) -> None:
        pki = self.pki
        pki.make_ca()
        pki.make_service_account_key()
        api_sans = (
            f"IP:{self.network.api_ip}",
            f"IP:{self.network.node_ip}",
            "IP:127.0.0.1",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
            "DNS:localhost",
        )
        pki.issue("apiserver", "/CN=kube-apiserver", "serverAuth", api_sans)
        pki.issue("apiserver-kubelet", "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth")
        pki.issue("admin", "/O=system:masters/CN=crihook-admin", "clientAuth")
        pki.issue("controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
        pki.issue("scheduler", "/CN=system:kube-scheduler", "clientAuth")
        pki.issue("kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "clientAuth")
        pki.issue("kubelet-serving", f"/CN={NODE_NAME}", "serverAuth", (f"IP:{self.network.node_ip}",))

    def _kubeconfigs(self) -> None:
        """One per component; proxy mode's reporter (in `crihook serve`) uses the admin's."""
        pki = self.pki
        for name in ("admin", "controller-manager", "scheduler", "kubelet"):
            path = self.kubeconfig if name == "admin" else self.base / f"{name}.kubeconfig"
            kubeconfig(path, self.server, pki.ca, pki.cert(name), pki.key(name))
        shutil.copy(self.kubeconfig, self.base / "reporter.kubeconfig")

    @property
    def nvml_library(self) -> Path:
        """The fake libnvidia-ml.so.1 where a driver installed under the simulated node's root has it."""
        assert self.sim is not None
        return self.sim.root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.1"

    def _share(self, path: Path) -> None:
        """Make `path` a shared mount point, as everything is on a real node (systemd makes /
        shared): containerd refuses HostToContainer propagation, which the chart asks for the
        kubelet, driver and runtime directories, from a private mount. These hosts' / is private."""
        for command in (["mount", "--bind", str(path), str(path)], ["mount", "--make-rshared", str(path)]):
            subprocess.run(command, check=True, capture_output=True)

    def _make_sim_node(self) -> None:
        """The simulated GPU node: the driver's root holding the fake libnvidia-ml.so.1 beside the
        topology file it reads, the device nodes (mknod) and the sysfs tree."""
        self.sim = make_sim_node(self.base / "driver", TOPOLOGY, char_devices=True)
        self.nvml_library.parent.mkdir(parents=True)
        shutil.copy(fakenvml.build(), self.nvml_library)
        shutil.copy(self.sim.config, self.nvml_library.parent / "topology.json")  # what the library reads

    def _start_runtime(self) -> None:
        """containerd 2.x with NRI on, CNI bin dir and config of the cluster; in proxy mode `crihook
        serve` in front of it."""
        self.containerd = Containerd.create(cgroup_root=self.cgroup_root, runtime=runtime("2"), nri=True)
        self._share(self.containerd.base)
        cni = self.containerd.base / "cni"
        (cni / "net.d").mkdir(parents=True)
        (cni / "bin").symlink_to(CNI_BIN)
        config = self.network.cni_config(self.base / "cni-ipam")
        (cni / "net.d" / "10-crihook.conflist").write_text(json.dumps(config, indent=1))
        self.containerd.start()
        self.containerd.import_images()
        if self.mode == "proxy":
            assert self.sim is not None
            # the runtime's CDI dir, where DRA drivers write the claims' specs (tests/cluster/test_dra.py)
            config = self.sim.proxy_config(self.nvml_library, NODE_NAME, cdi_spec_dirs=[self.containerd.cdi_spec_dir])
            config += f'\n[reporter]\nkubeconfig = "{self.base / "reporter.kubeconfig"}"\ninterval_seconds = 5.0\n'
            self.crihook = Crihook(self.base / "crihook", self.containerd.address, config)
            self.crihook.write_config()
            self.crihook.start()

    def _start_kubelet(self, kube: str) -> None:
        pki = self.pki
        self._make_cgroup_root()
        DEVICE_PLUGINS.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.network.node_ip,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzPort": 0,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki.ca)},
            },
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(pki.cert("kubelet-serving")),
            "tlsPrivateKeyFile": str(pki.key("kubelet-serving")),
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": self.runtime_endpoint,
            "podLogsDir": str(self.base / "pod-logs"),
            "volumePluginDir": str(self.base / "flexvolume"),
            "clusterDomain": "cluster.local",
            "clusterDNS": [self.network.node_ip],
            "resolvConf": "/etc/resolv.conf",
            "imageGCHighThresholdPercent": 100,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "serializeImagePulls": False,
            "registerNode": True,
        }
        path = self.base / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        self._start(
            "kubelet",
            [
                kube,
                "kubelet",
                f"--config={path}",
                f"--kubeconfig={self.base / 'kubelet.kubeconfig'}",
                f"--root-dir={self.kubelet_root}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={self.network.node_ip}",
                "--node-labels=nvidia.com/gpu.present=true",
            ],
            # kubelet makes iptables chains (KUBE-FIREWALL, canaries) whenever it finds iptables,
            # and leaves them when it stops; a PATH without /usr/sbin keeps it from them
            env={"PATH": "/usr/bin:/bin"},
        )

    def _make_cgroup_root(self) -> None:
        """kubelet refuses a --cgroup-root that does not exist; make it in every hierarchy."""
        for hierarchy in cgroup_hierarchies():
            (hierarchy / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

    # readiness
    def _api_ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(self.pki.cert("admin"), self.pki.key("admin"))
        try:
            with urllib.request.urlopen(f"{self.server}/readyz", context=context, timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _node_ready(self) -> bool:
        try:
            node = self.core().read_node(NODE_NAME)
        except ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    def _kubelet_serves(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((self.network.node_ip, self.kubelet_port)) == 0

    def _default_account(self) -> bool:
        """Pods can be made in `default` once the controller manager made its ServiceAccount."""
        try:
            self.core().read_namespaced_service_account("default", "default")
        except ApiException:
            return False
        return True

    # use
    def api(self) -> ApiClient:
        """A client of the kubernetes package, as the admin."""
        if self._api is None:
            self._api = new_client_from_config(str(self.kubeconfig))
        return self._api

    def core(self) -> CoreV1Api:
        return CoreV1Api(self.api())

    def device(self, node: str) -> dict[str, Any] | None:
        """The node's Device object (scheduling.koordinator.sh/v1alpha1), None when there is none."""
        try:
            found: dict[str, Any] = CustomObjectsApi(self.api()).get_cluster_custom_object(
                "scheduling.koordinator.sh", "v1alpha1", "devices", node
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return found

    def create_pod(self, namespace: str, pod: dict[str, Any]) -> None:
        self.core().create_namespaced_pod(namespace, pod)

    def wait_pod_running(self, namespace: str, name: str, timeout: float = 60.0) -> Any:
        """The pod once all its containers run; ClusterError with its status and events when not in time."""
        deadline = time.monotonic() + timeout
        while True:
            pod = self.core().read_namespaced_pod(name, namespace)
            if pod.status.phase == "Running" and all(s.ready for s in pod.status.container_statuses or []):
                return pod
            if time.monotonic() > deadline:
                events = self.core().list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
                said = "\n".join(f"{e.reason}: {e.message}" for e in events.items)
                raise ClusterError(f"pod {namespace}/{name} not running after {timeout}s: {pod.status}\n{said}")
            time.sleep(0.3)

    def wait_selected_pod_running(self, namespace: str, selector: str, timeout: float = 90.0) -> Any:
        """The one pod matching the label selector, once it runs (its controller makes it first)."""
        deadline = time.monotonic() + timeout
        while True:
            pods = self.core().list_namespaced_pod(namespace, label_selector=selector).items
            if len(pods) == 1:
                return self.wait_pod_running(namespace, pods[0].metadata.name, max(deadline - time.monotonic(), 1.0))
            if time.monotonic() > deadline:
                raise ClusterError(f"{len(pods)} pods match {selector} in {namespace} after {timeout}s")
            time.sleep(0.3)

    def wait_pods_gone(self, namespace: str, selector: str, timeout: float = 60.0) -> None:
        def left() -> list[str]:
            return [p.metadata.name for p in self.core().list_namespaced_pod(namespace, label_selector=selector).items]

        remaining = eventually(left, [], timeout)
        if remaining:
            raise ClusterError(f"pods {remaining} still there {timeout}s after their deletion")

    def delete_pod(self, namespace: str, name: str, timeout: float = 60.0) -> None:
        """Delete the pod and wait until it is gone."""
        with contextlib.suppress(ApiException):
            self.core().delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.core().read_namespaced_pod(name, namespace)
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            time.sleep(0.3)
        raise ClusterError(f"pod {namespace}/{name} still there {timeout}s after its deletion")

    def logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.tail()}" for c in self.components.values())

    def diagnosis(self, lines: int = 20) -> str:
        """What a failed test's report shows: the node's processes' logs, the last events, the pods
        and their restarts, crihook's pods' logs (last: a report cut short keeps its end). Best
        effort: the API server may be what failed."""
        parts = [f"--- {c.name}\n{c.tail(lines)}" for c in self.components.values()]
        try:
            core = self.core()
            events = sorted(core.list_event_for_all_namespaces().items, key=lambda e: str(e.last_timestamp))
            parts += [
                f"event {e.last_timestamp} {e.involved_object.name}: {e.reason} {e.message}" for e in events[-lines:]
            ]
            for p in core.list_pod_for_all_namespaces().items:
                restarts = sum(c.restart_count for c in p.status.container_statuses or [])
                parts.append(f"pod {p.metadata.namespace}/{p.metadata.name} {p.status.phase} restarts={restarts}")
            for p in core.list_namespaced_pod("crihook").items:
                for c in p.spec.containers:
                    text = core.read_namespaced_pod_log(p.metadata.name, "crihook", container=c.name, tail_lines=lines)
                    parts.append(f"--- pod crihook/{p.metadata.name} {c.name}\n{text}")
        except Exception as e:  # a report of what could be read
            parts.append(f"(the API server did not answer: {e})")
        return "\n".join(parts)

    # teardown
    def close(self) -> None:
        """Stop everything by pid and remove what the cluster made, in the order that lets each
        part be removed: kubelet first, then every pod through CRI, then the runtime (which removes
        its containers, shims, mounts and the pods' cgroups), the control plane, the bridge, files."""
        kubelet = self.components.pop("kubelet", None)
        if kubelet is not None:
            kubelet.stop()
        if self.containerd is not None and self.containerd.pid is not None:
            with contextlib.suppress(Exception):
                self._remove_pods()
        if self.crihook is not None:
            self.crihook.stop()
        for name in ("clusternet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            component = self.components.pop(name, None)
            if component is not None:
                component.stop()
        if self.containerd is not None:
            self.containerd.close()
        self.network.delete()
        self._clean_host()
        unmount_below(self.base)
        shutil.rmtree(self.base, ignore_errors=True)
        with contextlib.suppress(Exception):
            remove_cgroup_tree(self.cgroup_root)

    def _remove_pods(self) -> None:
        from tests.support.cri import Cri

        assert self.containerd is not None
        with Cri(self.containerd.address) as client:
            client.remove_all(delete_task=self.containerd.delete_task)

    def _clean_host(self) -> None:
        """What kubelet and containerd write outside their configured dirs whatever they are told:
        kubelet's registration socket and checkpoint in the device-plugins dir, its links to the
        pods' logs in /var/log/containers, the CNI result cache in /var/lib/cni (of this cluster's
        network only); then the directories this cluster made there, when empty."""
        for name in ("kubelet.sock", "kubelet_internal_checkpoint"):
            if str(DEVICE_PLUGINS / name) not in self._host_before:
                (DEVICE_PLUGINS / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            for link in Path("/var/log/containers").iterdir():
                if link.is_symlink() and Path(os.readlink(link)).is_relative_to(self.base):
                    link.unlink()
        with contextlib.suppress(OSError):
            for cached in Path("/var/lib/cni/results").glob(f"{self.network.name}-*"):
                cached.unlink()
        for made in sorted(HOST_DIRS, key=lambda d: len(d.parts), reverse=True):
            if str(made) not in self._host_before:
                with contextlib.suppress(OSError):
                    made.rmdir()

    def _ours(self, entry: str) -> bool:
        """Whether a host entry that appeared during the run can be this cluster's, not another
        cluster's running at the same time (the suites of two checkouts may share a machine)."""
        path = Path(entry.split("=")[0])
        if path.parent == Path("/var/lib/cni/results"):
            return path.name.startswith((f"{self.network.name}-", "cni-loopback-")) and not self._others_run()
        if path.parent == Path("/var/log/containers"):
            return not path.is_symlink() or Path(os.readlink(path)).is_relative_to(self.base)
        if path.parent == Path("/var/run/netns"):
            return not self._others_run()
        return True

    def _others_run(self) -> bool:
        return any(p != self.base for p in Path(tempfile.gettempdir()).glob("crihook-cluster-*"))

    def leftovers(self) -> list[str]:
        """What of this cluster is still on the host: processes, mounts, cgroups, the bridge,
        network namespaces its pods had, its directory."""
        found = []
        for component in self.components.values():
            if component.pid is not None:
                found.append(f"{component.name} pid {component.pid}")
        found += [f"mount {m}" for m in mounts_below(self.base)]
        for hierarchy in cgroup_hierarchies():
            if (hierarchy / self.cgroup_root.lstrip("/")).exists():
                found.append(f"cgroup {hierarchy / self.cgroup_root.lstrip('/')}")
        if self.network.exists():
            found.append(f"bridge {self.network.bridge}")
        if self.base.exists():
            found.append(f"directory {self.base}")
        found += sorted(e for e in host_entries() - self._host_before if self._ours(e))
        found += [f"iptables chain {c}" for c in sorted(iptables_chains() - self._chains_before)]
        return found


# Where kubelet, containerd and the CNI plugins write outside their configured dirs when misconfigured
# (or, for the device-plugin dir, always): an entry that appears there during a run was left by it.
HOST_DIRS = (
    Path("/var/run/netns"),
    Path("/var/lib/kubelet"),
    DEVICE_PLUGINS,
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/var/lib/cni"),
    Path("/var/lib/cni/results"),
    Path("/etc/cni"),
    Path("/usr/libexec/kubernetes"),
    Path("/etc/kubernetes"),
    Path("/var/run/kubernetes"),
    Path("/run/containerd/runc"),
)


def iptables_chains() -> set[str]:
    """`<command> <table> <chain>` of every chain iptables and ip6tables list (none without them)."""
    found = set()
    for command in ("iptables-save", "ip6tables-save"):
        if shutil.which(command) is None:
            continue
        out = subprocess.run([command], capture_output=True, text=True).stdout
        table = ""
        for line in out.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                found.add(f"{command.removesuffix('-save')} {table} {line[1:].split()[0]}")
    return found


FORWARDING = (Path("/proc/sys/net/ipv4/ip_forward"), Path("/proc/sys/net/ipv6/conf/all/forwarding"))


def host_entries() -> set[str]:
    """Each of HOST_DIRS, and what is in it, as paths; and the forwarding switches' values."""
    found = {f"{f}={f.read_text().strip()}" for f in FORWARDING if f.exists()}
    for d in HOST_DIRS:
        if d.exists():
            found.add(str(d))
            with contextlib.suppress(OSError):
                found.update(str(entry) for entry in d.iterdir())
    return found


@contextlib.contextmanager
def running_cluster(mode: str) -> Iterator[Cluster]:
    cluster = Cluster.create(mode)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
