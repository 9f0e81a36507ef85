"""The checks along the CRI path: containerd answers CRI v1 and is new enough, crihook's socket
answers and forwards to it, kubelet dials crihook."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import grpc

from crihook.base.config import NodeConfig, ProxyConfig
from crihook.cli.doctor.finding import Finding, Level
from crihook.cli.doctor.parse import kubelet_runtime_endpoint, parse_version, same_endpoint, socket_path
from crihook.devices.kubelet import kubelet_argv

VERSION_METHOD = "/runtime.v1.RuntimeService/Version"
KUBELET_API_VERSION = "0.1.0"  # what kubelet itself sends in VersionRequest
MIN_CONTAINERD = (1, 6)  # the first containerd whose CRI v1 kubelet 1.26+ accepts
DROPIN = "/etc/systemd/system/kubelet.service.d/99-crihook.conf"


def cri_version(endpoint: str, timeout: float) -> Any:
    """runtime.v1.RuntimeService/Version at `endpoint`; raises grpc.RpcError."""
    from crihook.proto import runtime_v1_pb2 as api

    path = socket_path(endpoint)
    target = f"unix://{path}" if path is not None else endpoint
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            VERSION_METHOD,
            request_serializer=api.VersionRequest.SerializeToString,
            response_deserializer=api.VersionResponse.FromString,
        )
        return call(api.VersionRequest(version=KUBELET_API_VERSION), timeout=timeout)


def _as_call(e: grpc.RpcError) -> grpc.Call | None:
    """The error as the grpc.Call a failed call raises; grpc-stubs declare the two classes
    incompatible, so the check is made on the error as a plain object."""
    raised: object = e
    return raised if isinstance(raised, grpc.Call) else None


def _rpc_problem(e: grpc.RpcError) -> str:
    call = _as_call(e)
    code = call.code() if call is not None else None
    details = call.details() if call is not None else str(e)
    return f"{code.name if code else 'error'}: {details}"


def check_runtime(node: NodeConfig, timeout: float) -> tuple[Finding, Any]:
    """containerd answers CRI v1 at the runtime endpoint, and is new enough."""
    name = "containerd"
    endpoint = node.runtime_endpoint
    path = socket_path(endpoint)
    if path is not None and not Path(path).exists():
        return Finding(
            name,
            Level.FAIL,
            f"no socket at {path}",
            "start containerd (systemctl status containerd), or set node.runtime_endpoint to its socket",
        ), None
    try:
        version = cri_version(endpoint, timeout)
    except grpc.RpcError as e:
        fix = "check containerd: systemctl status containerd; journalctl -u containerd -n 50"
        call = _as_call(e)
        if call is not None and call.code() is grpc.StatusCode.UNIMPLEMENTED:
            fix = (
                'containerd has its CRI plugin switched off: remove "cri" from disabled_plugins in '
                "/etc/containerd/config.toml, then systemctl restart containerd"
            )
        return Finding(name, Level.FAIL, f"{endpoint} does not answer CRI v1 ({_rpc_problem(e)})", fix), None
    found = f"{version.runtime_name} {version.runtime_version} answers CRI {version.runtime_api_version} at {endpoint}"
    if version.runtime_name == "containerd" and parse_version(version.runtime_version)[:2] < MIN_CONTAINERD:
        want = ".".join(map(str, MIN_CONTAINERD))
        return Finding(
            name, Level.FAIL, found, f"upgrade containerd to {want} or newer (kubelet needs CRI v1)"
        ), version
    return Finding(name, Level.OK, found), version


def check_proxy(proxy: ProxyConfig, runtime: Any, timeout: float) -> Finding:
    """crihook's socket exists, only root can use it, and calls go through to the runtime."""
    name = "crihook socket"
    path = socket_path(proxy.listen)
    start = "start crihook: systemctl start crihook; journalctl -u crihook -n 50 says why it stopped"
    st: os.stat_result | None = None
    if path is not None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return Finding(name, Level.FAIL, f"nothing at {path}: crihook is not running", start)
        if not stat.S_ISSOCK(st.st_mode):
            return Finding(name, Level.FAIL, f"{path} is not a socket", f"remove {path}, then {start}")
    try:
        answer = cri_version(proxy.listen, timeout)
    except grpc.RpcError as e:
        return Finding(name, Level.FAIL, f"crihook does not answer at {proxy.listen} ({_rpc_problem(e)})", start)
    found = f"crihook answers at {proxy.listen} and forwards to {answer.runtime_name} {answer.runtime_version}"
    if runtime is not None and (answer.runtime_name, answer.runtime_version) != (
        runtime.runtime_name,
        runtime.runtime_version,
    ):
        return Finding(
            name,
            Level.WARN,
            found + f", not to the {runtime.runtime_name} {runtime.runtime_version} at node.runtime_endpoint",
            "crihook is running with another configuration than this one: systemctl restart crihook",
        )
    if st is not None and (st.st_mode & 0o077 or st.st_uid != 0):
        return Finding(
            name,
            Level.WARN,
            found + f", but the socket is mode {stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}",
            "anyone who can open it can start privileged containers: it must be mode 0600 owned by root "
            "(crihook creates it so; check for something changing it)",
        )
    return Finding(name, Level.OK, found)


def check_kubelet(proxy: ProxyConfig, node: NodeConfig) -> Finding:
    name = "kubelet"
    argv = kubelet_argv(node.proc_root)
    if argv is None:
        return Finding(
            name,
            Level.WARN,
            "kubelet is not running on this node",
            "systemctl status kubelet; once it runs, it must use crihook's socket (install.sh's drop-in does that)",
        )
    try:
        endpoint, source = kubelet_runtime_endpoint(argv, lambda p: Path(p).read_text())
    except ValueError as e:
        return Finding(name, Level.FAIL, str(e), "fix kubelet's --config file, then systemctl restart kubelet")
    if same_endpoint(endpoint, proxy.listen):
        return Finding(name, Level.OK, f"kubelet uses crihook at {endpoint} ({source})")
    return Finding(
        name,
        Level.FAIL,
        f"kubelet uses {endpoint} ({source}), not crihook's {proxy.listen}: crihook sees no pod",
        f"run install.sh, or add --container-runtime-endpoint={proxy.listen} to kubelet (its drop-in is {DROPIN}); "
        "then systemctl daemon-reload && systemctl restart kubelet",
    )
