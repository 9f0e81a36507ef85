"""`crihook doctor`: checks a node the way an operator would, one finding per check, each with a
fix in plain words. Exit status 1 when any check failed; warnings alone leave it 0.

The checks read everything through the configuration (sockets, node roots, checkpoint, state
dir), so tests point them at trees and daemons they made; parsing is kept in small pure functions.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import stat
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from crihook.base.config import DEFAULT_CONFIG, Config, ConfigError, NodeConfig, ProxyConfig, load
from crihook.base.endpoint import unix_socket_path
from crihook.devices import kubelet
from crihook.devices.kubelet import flag_value, kubelet_argv
from crihook.devices.nvml import NodeGpus, Nvml
from crihook.hooks.cdi import DEFAULT_SPEC_DIRS, GENERATE_FIX, CdiIndex

VERSION_METHOD = "/runtime.v1.RuntimeService/Version"
KUBELET_API_VERSION = "0.1.0"  # what kubelet itself sends in VersionRequest
MIN_CONTAINERD = (1, 6)  # the first containerd whose CRI v1 kubelet 1.26+ accepts
KUBELET_DEFAULT_ENDPOINT = "unix:///run/containerd/containerd.sock"
DROPIN = "/etc/systemd/system/kubelet.service.d/99-crihook.conf"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"


class Level(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    found: str  # what is the case, in plain words
    fix: str = ""  # what to do about it; empty when nothing needs doing


# -- pure helpers -----------------------------------------------------------------------------------


def socket_path(endpoint: str) -> str | None:
    """The file of a unix endpoint in any spelling kubelet's flags may use; None for other schemes."""
    return unix_socket_path(endpoint, short_form=True)


def same_endpoint(a: str, b: str) -> bool:
    """Whether two endpoints name the same socket; /var/run is a link to /run on every systemd host."""

    def norm(e: str) -> str:
        path = socket_path(e)
        if path is None:
            return e
        path = os.path.normpath(path)
        return "/run" + path[len("/var/run") :] if path == "/var/run" or path.startswith("/var/run/") else path

    return norm(a) == norm(b)


def kubelet_runtime_endpoint(argv: Sequence[str], read: Callable[[str], str]) -> tuple[str, str]:
    """(endpoint, where it came from) for a kubelet command line: the flag beats the config file,
    which beats kubelet's built-in default. `read` returns a file's text."""
    flag = flag_value(argv, "container-runtime-endpoint")
    if flag:
        return flag, "its --container-runtime-endpoint flag"
    config_file = flag_value(argv, "config")
    if config_file:
        try:
            doc = yaml.safe_load(read(config_file))
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"kubelet's config file {config_file} can not be read: {e}") from None
        endpoint = doc.get("containerRuntimeEndpoint") if isinstance(doc, dict) else None
        if isinstance(endpoint, str) and endpoint:
            return endpoint, f"containerRuntimeEndpoint in {config_file}"
    return KUBELET_DEFAULT_ENDPOINT, "kubelet's default"


def parse_version(text: str) -> tuple[int, ...]:
    """'v1.7.13' or '1.6.20~ds1' -> (1, 7, 13); () when it does not start with a number."""
    parts: list[int] = []
    for piece in text.lstrip("v").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


@dataclass(frozen=True)
class RuntimeCdi:
    """CDI as a containerd config sets it: whether it injects, and from which dirs."""

    enabled: bool
    spec_dirs: tuple[str, ...]
    where: str  # the table the keys live in, for the fix


def containerd_cdi(config: Mapping[str, Any], version: tuple[int, ...]) -> RuntimeCdi:
    """`enable_cdi` and `cdi_spec_dirs` from a parsed containerd config, with the defaults of the
    release that reads it: config version 3 (containerd 2.x) keeps them in the CRI runtime plugin,
    versions 2 and 1 in the CRI plugin; on by default from 2.0, off in 1.7, absent before."""
    layout = config.get("version", 3 if version >= (2,) else 2)  # no file: the release's own layout
    table = {3: "io.containerd.cri.v1.runtime", 2: "io.containerd.grpc.v1.cri"}.get(layout, "cri")
    cri = config.get("plugins", {}).get(table, {})
    cri = cri if isinstance(cri, Mapping) else {}
    if version[:2] < (1, 7):
        return RuntimeCdi(False, (), f'plugins."{table}"')
    enabled = cri.get("enable_cdi", version >= (2,))
    dirs = cri.get("cdi_spec_dirs", list(DEFAULT_SPEC_DIRS))
    return RuntimeCdi(enabled is True, tuple(d for d in dirs if isinstance(d, str)), f'plugins."{table}"')


def exit_status(findings: Sequence[Finding]) -> int:
    return 1 if any(f.level is Level.FAIL for f in findings) else 0


def render(findings: Sequence[Finding], source: str) -> str:
    width = max(len(f.check) for f in findings)
    lines = [f"crihook doctor: checking this node with {source}", ""]
    for f in findings:
        label = {Level.OK: "ok", Level.WARN: "WARN", Level.FAIL: "FAIL"}[f.level]
        lines.append(f"  {label:<4}  {f.check:<{width}}  {f.found}")
        if f.fix:
            lines.append(f"        {'':<{width}}  fix: {f.fix}")
    fails = sum(f.level is Level.FAIL for f in findings)
    warns = sum(f.level is Level.WARN for f in findings)
    lines.append("")
    if fails or warns:
        lines.append(f"{fails} problem(s), {warns} warning(s).")
    else:
        lines.append("Everything crihook needs on this node is in order.")
    return "\n".join(lines) + "\n"


# -- checks ----------------------------------------------------------------------------------------


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


def check_config(path: str | None) -> tuple[Config, Finding]:
    try:
        config = load(path)
    except ConfigError as e:
        finding = Finding(
            "config",
            Level.FAIL,
            str(e),
            "correct the file (README.md, Configuration, lists every key); crihook serve refuses to start "
            "with it. The checks below use the built-in defaults.",
        )
        return Config(), finding
    if path and Path(path).exists():
        return config, Finding("config", Level.OK, f"{path} is valid")
    return config, Finding("config", Level.OK, f"no {path or 'config file'}: built-in defaults apply")


def check_runtime(proxy: ProxyConfig, timeout: float) -> tuple[Finding, Any]:
    """containerd answers CRI v1 at the runtime endpoint, and is new enough."""
    name = "containerd"
    endpoint = proxy.runtime_endpoint
    path = socket_path(endpoint)
    if path is not None and not Path(path).exists():
        return Finding(
            name,
            Level.FAIL,
            f"no socket at {path}",
            "start containerd (systemctl status containerd), or set proxy.runtime_endpoint to its socket",
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
            found + f", not to the {runtime.runtime_name} {runtime.runtime_version} at proxy.runtime_endpoint",
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


def check_nvml(node: NodeConfig, gpus: NodeGpus | None = None) -> Finding:
    """The driver answers through NVML (the same access layer the gpu hook uses) and every GPU has
    its device node."""
    name = "NVIDIA driver"
    driver_fix = (
        "nvidia-smi must list the GPUs; if it does not, (re)install the NVIDIA driver and check lsmod | grep nvidia. "
        "If libnvidia-ml.so.1 lives outside the loader path, set node.nvml_library"
    )
    if gpus is None:
        gpus = node_gpus(node)
    if gpus.reason:
        return Finding(name, Level.FAIL, gpus.reason, driver_fix)
    driver = gpus.driver_version
    minors = [g.minor for g in gpus.gpus]
    if not minors:
        return Finding(name, Level.WARN, f"driver {driver} is loaded but NVML sees no GPU", driver_fix)
    dev = node.dev_root.rstrip("/")
    missing = [p for p in [f"{dev}/nvidiactl", *(f"{dev}/nvidia{m}" for m in minors)] if not Path(p).exists()]
    found = f"driver {driver}, {len(minors)} GPU(s), minors {', '.join(map(str, sorted(minors)))}"
    if missing:
        return Finding(
            name,
            Level.FAIL,
            f"{found}; device nodes missing: {', '.join(missing)}",
            "crihook hands these nodes to containers: create them with nvidia-modprobe -c <minor> "
            "(or nvidia-smi once as root), or set node.dev_root",
        )
    mig = [str(g.minor) for g in gpus.gpus if g.mig_enabled]
    if mig:  # a mixed node is normal: said, not warned about
        found += f"; in MIG mode, for the device plugin's nvidia.com/mig-* only: minors {', '.join(mig)}"
    sick = [f"minor {g.minor} ({g.health_reason or 'unhealthy'})" for g in gpus.gpus if not g.healthy]
    if sick:
        return Finding(
            name,
            Level.WARN,
            f"{found}; unhealthy: {', '.join(sick)}",
            "the reporter marks these GPUs unhealthy so the scheduler skips them; check nvidia-smi -q and dmesg (Xid)",
        )
    return Finding(name, Level.OK, found + "; device nodes present")


def node_gpus(node: NodeConfig) -> NodeGpus:
    nvml = Nvml(node.nvml_library, node.sys_root)
    try:
        return nvml.snapshot(topology=False)
    finally:
        nvml.close()


def check_cdi(
    gpu_options: Mapping[str, Any] | None, runtime: Any, gpus: NodeGpus, containerd_config: str = CONTAINERD_CONFIG
) -> Finding:
    """Whether every GPU has its `nvidia.com/gpu=<uuid>` CDI device in the spec dirs crihook checks,
    and whether containerd (its config file, its release's defaults) injects CDI devices from them.
    Problems fail only with `inject = "cdi"`; otherwise they are said for whoever switches."""
    name = "CDI"
    options = gpu_options or {}
    inject = options.get("inject", "env+devices")
    dirs = tuple(options.get("cdi_spec_dirs", DEFAULT_SPEC_DIRS))
    problems, fixes = [], []
    found = []
    if gpus.gpus:
        scan = CdiIndex(dirs).scan()
        missing = [g.uuid for g in gpus.gpus if f"nvidia.com/gpu={g.uuid}" not in scan.devices]
        have = len(gpus.gpus) - len(missing)
        found.append(f"{have} of {len(gpus.gpus)} GPU(s) have a CDI device in {', '.join(dirs)}")
        if missing:
            problems.append(f"no nvidia.com/gpu device for {', '.join(missing)}")
            fixes.append(f"run `{GENERATE_FIX}`")
        if scan.problems:
            problems.append("unreadable specs: " + "; ".join(scan.problems))
    if runtime is None or runtime.runtime_name != "containerd":
        what = "no runtime answered" if runtime is None else f"the runtime is {runtime.runtime_name}"
        found.append(f"containerd's CDI setting not checked ({what})")
    else:
        version = parse_version(runtime.runtime_version)
        try:
            with open(containerd_config, "rb") as f:
                parsed: Mapping[str, Any] = tomllib.load(f)
            source = containerd_config
        except FileNotFoundError:
            parsed, source = {}, f"defaults, no {containerd_config}"
        except (OSError, tomllib.TOMLDecodeError) as e:
            return Finding(name, Level.FAIL, f"{containerd_config} can not be read: {e}", "fix containerd's config")
        cdi = containerd_cdi(parsed, version)
        label = f"containerd {runtime.runtime_version} ({source})"
        if version[:2] < (1, 7):
            found.append(f"{label} has no CDI")
            problems.append(f"containerd {runtime.runtime_version} can not inject CDI devices")
            fixes.append('upgrade containerd to 1.7 or newer, or use inject = "env+devices"')
        elif not cdi.enabled:
            found.append(f"{label}: CDI disabled")
            problems.append("containerd ignores CDI devices")
            fixes.append(f"set enable_cdi = true under [{cdi.where}] and restart containerd")
        else:
            found.append(f"{label}: CDI enabled, spec dirs {', '.join(cdi.spec_dirs)}")
            if not set(dirs) <= set(cdi.spec_dirs):
                problems.append(f"crihook checks {', '.join(dirs)}, containerd reads {', '.join(cdi.spec_dirs)}")
                fixes.append("make [hooks.gpu] cdi_spec_dirs name the dirs containerd reads")
    text = "; ".join(found + problems)
    if not problems:
        return Finding(name, Level.OK, f"inject = {inject}; {text}")
    if inject == "cdi":
        return Finding(name, Level.FAIL, f"inject = cdi; {text}", "; ".join(fixes))
    return Finding(name, Level.OK, f"inject = {inject} (CDI not used); {text}")


def check_checkpoint(node: NodeConfig, gpu_options: Mapping[str, Any] | None = None) -> Finding:
    """The device-plugin checkpoint is readable where kubelet keeps it, and the gpu hook looks for
    pod directories where kubelet keeps them. The two do not move together: the checkpoint stays in
    /var/lib/kubelet/device-plugins whatever kubelet's --root-dir, the pods dir follows it."""
    from crihook.devices.checkpoint import CheckpointError, parse_checkpoint

    name = "device checkpoint"
    path = node.kubelet_checkpoint
    try:
        checkpoint = parse_checkpoint(Path(path).read_bytes())
    except FileNotFoundError:
        if not Path(path).parent.is_dir():
            return Finding(
                name,
                Level.WARN,
                f"{Path(path).parent} does not exist, so crihook sees no device-plugin allocation",
                f"kubelet keeps its checkpoint in {kubelet.CHECKPOINT} whatever its --root-dir: set "
                "node.kubelet_checkpoint to that (the default)",
            )
        return Finding(
            name,
            Level.WARN,
            f"no kubelet device-plugin checkpoint at {path}: no device plugin has registered with kubelet",
            "nothing to do if no device plugin runs on this node; else check the plugin's pod and log (it registers "
            f"at {Path(kubelet.CHECKPOINT).parent}/kubelet.sock). The checkpoint does not move with kubelet's "
            "--root-dir",
        )
    except (OSError, CheckpointError) as e:
        return Finding(
            name,
            Level.FAIL,
            f"{path} can not be used: {e}",
            "crihook can not see which GPUs the device plugin handed out, so GPU containers fail closed. "
            "Restarting kubelet rewrites the file",
        )
    counts: dict[str, int] = {}
    for entry in checkpoint.entries:
        counts[entry.resource_name] = counts.get(entry.resource_name, 0) + len(entry.device_ids)
    held = ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) or "no devices"
    found = f"{path} readable: {held} held through device plugins"
    undecodable = [e for e in checkpoint.entries if e.alloc_error]
    if undecodable:
        first = undecodable[0]
        return Finding(
            name,
            Level.WARN,
            f"{found}; {len(undecodable)} entr{'y' if len(undecodable) == 1 else 'ies'} with an undecodable "
            f"AllocResp, first {first.pod_uid}/{first.container_name}",
            "crihook can not strip what the device plugin injected into those containers; check the plugin's "
            "version and journalctl -u kubelet",
        )
    return _with_pods_dir(Finding(name, Level.OK, found), node, gpu_options)


def _with_pods_dir(ok: Finding, node: NodeConfig, gpu_options: Mapping[str, Any] | None) -> Finding:
    """`ok`, or a warning when the gpu hook would look for kubelet's pod directories elsewhere than
    kubelet keeps them (then every device-plugin holder counts as live)."""
    argv = kubelet_argv(node.proc_root)
    if argv is None:
        return ok
    theirs = kubelet.pods_dir(argv)
    ours = (gpu_options or {}).get("kubelet_pods_dir")
    if isinstance(ours, str) and os.path.normpath(ours) != theirs:
        return Finding(
            ok.check,
            Level.WARN,
            f"{ok.found}; [hooks.gpu] kubelet_pods_dir is {ours}, but kubelet keeps pods in {theirs}",
            f"remove kubelet_pods_dir (crihook follows kubelet's --root-dir) or set it to {theirs}",
        )
    if not Path(theirs).is_dir():
        return Finding(
            ok.check,
            Level.WARN,
            f"{ok.found}; kubelet's pods dir {theirs} does not exist, so every device-plugin holder counts as live",
            "check kubelet's --root-dir; the checkpoint stays in /var/lib/kubelet/device-plugins whatever it says",
        )
    return ok


def check_state_dir(proxy: ProxyConfig) -> Finding:
    from crihook.proxy.store import StoreFileError, read_file

    name = "state dir"
    state = Path(proxy.state_dir)
    if not state.exists():
        return Finding(
            name,
            Level.WARN,
            f"{state} does not exist yet",
            "crihook creates it when it starts; if crihook is running, it uses another proxy.state_dir",
        )
    mode = state.stat().st_mode
    if not stat.S_ISDIR(mode):
        return Finding(name, Level.FAIL, f"{state} is not a directory", f"move {state} away; crihook recreates it")
    if not os.access(state, os.W_OK | os.X_OK):
        return Finding(name, Level.FAIL, f"{state} is not writable here", "crihook runs as root: run doctor as root")
    store = state / "store.json"
    try:
        body = read_file(store)
    except FileNotFoundError:
        found = f"{state} is usable; no store.json yet (written after the first pod)"
    except StoreFileError as e:
        return Finding(
            name,
            Level.FAIL,
            str(e),
            "crihook sets a damaged store aside at start and rebuilds it from containerd; if it recurs, check "
            "free space (df) and journalctl -u crihook",
        )
    except OSError as e:
        return Finding(name, Level.FAIL, f"{store} can not be read: {e}", "check the file's owner and mode")
    else:
        found = f"{store}: {len(body.get('pods', []))} pod(s), {len(body.get('containers', []))} container(s)"
    if stat.S_IMODE(mode) & 0o022:
        return Finding(
            name,
            Level.WARN,
            f"{found}, but {state} is writable by others (mode {stat.S_IMODE(mode):04o})",
            f"chmod 0700 {state}",
        )
    return Finding(name, Level.OK, found)


def check_hook_servers(config: Config) -> Finding:
    """The Koordinator hook-server files the remote hook reads: a file crihook skips (an unknown
    failure-policy, bad JSON) means a server that is silently not called, which only the log said."""
    from crihook.hooks.remote_config import DEFAULT_DIR, is_server_file, read_server_file

    name = "hook servers"
    if "remote" in config.hooks.disabled:
        return Finding(name, Level.OK, "the remote hook is disabled: no hook servers are called")
    directory = str(config.hooks.options.get("remote", {}).get("config_dir", DEFAULT_DIR))
    try:
        names = sorted(n for n in os.listdir(directory) if is_server_file(n))
    except FileNotFoundError:
        return Finding(name, Level.OK, f"no {directory}: no hook servers configured")
    except OSError as e:
        return Finding(name, Level.FAIL, f"{directory} can not be listed: {e.strerror}", "check its owner and mode")
    servers, skipped, down = [], [], []
    for file in names:
        if not os.path.isfile(os.path.join(directory, file)):
            continue
        try:
            server = read_server_file(directory, file)
        except ConfigError as e:
            skipped.append(str(e))
            continue
        servers.append(f"{file} ({server.policy.value})")
        if not os.path.exists(server.endpoint):
            down.append(f"{file}: {server.endpoint} does not exist")
    if skipped:
        return Finding(
            name,
            Level.FAIL,
            f"{len(skipped)} file(s) in {directory} skipped, their servers are never called: " + "; ".join(skipped),
            "fix the field named; crihook reads the file again within reload_interval_ms (no restart)",
        )
    if down:
        return Finding(
            name,
            Level.WARN,
            "hook server not listening: " + "; ".join(down),
            "start the server (koordlet) or remove its file: while it is down a Fail server refuses every call "
            "it is configured for",
        )
    found = f"{len(servers)} server(s) in {directory}" + (": " + ", ".join(servers) if servers else "")
    return Finding(name, Level.OK, found)


def diagnose(
    config_path: str | None,
    timeout: float = 3.0,
    gpus: NodeGpus | None = None,
    containerd_config: str = CONTAINERD_CONFIG,
) -> list[Finding]:
    config, finding = check_config(config_path)
    findings = [finding]
    runtime_finding, runtime = check_runtime(config.proxy, timeout)
    findings.append(runtime_finding)
    findings.append(check_proxy(config.proxy, runtime, timeout))
    findings.append(check_kubelet(config.proxy, config.node))
    gpus = gpus if gpus is not None else node_gpus(config.node)
    findings.append(check_nvml(config.node, gpus))
    findings.append(check_cdi(config.hooks.options.get("gpu"), runtime, gpus, containerd_config))
    findings.append(check_checkpoint(config.node, config.hooks.options.get("gpu")))
    findings.append(check_state_dir(config.proxy))
    findings.append(check_hook_servers(config))
    return findings


# -- command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="crihook's config file (default %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for each socket to answer (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument(
        "--containerd-config",
        default=CONTAINERD_CONFIG,
        help="containerd's config file, read for its CDI settings (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    # Findings carry every reason; the layers below (NVML) would say the same again in log lines.
    logging.getLogger("crihook").addHandler(logging.NullHandler())
    findings = diagnose(args.config, args.timeout, containerd_config=args.containerd_config)
    if args.json:
        json.dump([asdict(f) for f in findings], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        source = args.config if Path(args.config).exists() else f"the built-in defaults (no {args.config})"
        sys.stdout.write(render(findings, source))
    return exit_status(findings)
