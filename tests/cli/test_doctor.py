"""crihook doctor against healthy and broken nodes made here: real containerd and a real
`crihook serve` for the healthy node, small CRI servers for runtimes we can not install (an old or
CRI-less containerd), a fake /proc, device tree and NVML for what this machine has no GPU for."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.config import Config, NodeConfig, ProxyConfig
from crihook.cli import doctor
from crihook.cli.doctor import cri, files, gpu, output, parse
from crihook.cli.doctor.finding import Finding, Level, exit_status
from crihook.cli.doctor.nri import check_evictions
from crihook.devices import kubelet
from crihook.devices.nvml import GpuInfo, NodeGpus
from crihook.node.records import PodRecord
from crihook.node.store import Store
from crihook.nri.handler import EVICTIONS_FILE, Ungranted
from tests.support.gpu_fixtures import fake_proc

# -- pure parts -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "path"),
    [
        ("unix:///run/containerd/containerd.sock", "/run/containerd/containerd.sock"),
        ("unix:/run/x.sock", "/run/x.sock"),
        ("/run/x.sock", "/run/x.sock"),
        ("tcp://127.0.0.1:1234", None),
        ("x.sock", None),
    ],
)
def test_socket_path(endpoint: str, path: str | None) -> None:
    assert parse.socket_path(endpoint) == path


def test_same_endpoint() -> None:
    assert parse.same_endpoint("unix:///var/run/crihook/crihook.sock", "unix:///run/crihook/crihook.sock")
    assert parse.same_endpoint("/run/crihook/./crihook.sock", "unix:/var/run/crihook/crihook.sock")
    assert not parse.same_endpoint("unix:///run/containerd/containerd.sock", "unix:///run/crihook/crihook.sock")
    assert not parse.same_endpoint("unix:///var/runner/x.sock", "unix:///run/ner/x.sock")


@given(st.lists(st.sampled_from(["unix://", "unix:", ""]), min_size=2, max_size=2), st.sampled_from(["/var", ""]))
def test_same_endpoint_ignores_spelling(schemes: list[str], var: str) -> None:
    assert parse.same_endpoint(f"{schemes[0]}{var}/run/a.sock", f"{schemes[1]}/run/a.sock")


def test_flag_value_last_wins_in_both_forms() -> None:
    argv = ["kubelet", "--container-runtime-endpoint", "unix:///a", "--v=2", "--container-runtime-endpoint=unix:///b"]
    assert kubelet.flag_value(argv, "container-runtime-endpoint") == "unix:///b"
    assert kubelet.flag_value(argv[:3], "container-runtime-endpoint") == "unix:///a"
    assert kubelet.flag_value(["kubelet", "--container-runtime-endpoint"], "container-runtime-endpoint") is None
    assert kubelet.flag_value(["kubelet", "--container-runtime-endpoint-x=1"], "container-runtime-endpoint") is None


def test_kubelet_runtime_endpoint_sources() -> None:
    files = {
        "/k.yaml": "kind: KubeletConfiguration\ncontainerRuntimeEndpoint: unix:///run/crihook.sock\n",
        "/plain.yaml": "kind: KubeletConfiguration\n",
        "/bad.yaml": "a: [",
    }

    def read(p: str) -> str:
        if p not in files:
            raise FileNotFoundError(p)
        return files[p]

    flag = ["kubelet", "--config=/k.yaml", "--container-runtime-endpoint=unix:///flag.sock"]
    assert parse.kubelet_runtime_endpoint(flag, read) == ("unix:///flag.sock", "its --container-runtime-endpoint flag")
    assert parse.kubelet_runtime_endpoint(["kubelet", "--config", "/k.yaml"], read) == (
        "unix:///run/crihook.sock",
        "containerRuntimeEndpoint in /k.yaml",
    )
    plain = parse.kubelet_runtime_endpoint(["kubelet", "--config=/plain.yaml"], read)
    assert plain[0] == parse.KUBELET_DEFAULT_ENDPOINT
    assert parse.kubelet_runtime_endpoint(["kubelet"], read)[1] == "kubelet's default"
    for bad in ("/bad.yaml", "/missing.yaml"):
        with pytest.raises(ValueError, match=f"kubelet's config file {bad} can not be read"):
            parse.kubelet_runtime_endpoint(["kubelet", f"--config={bad}"], read)


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("v1.7.13", (1, 7, 13)),
        ("1.6.20~ds1", (1, 6, 20)),
        ("2.0.0-rc.1", (2, 0, 0)),
        ("v1.7", (1, 7)),
        ("", ()),
        ("unknown", ()),
    ],
)
def test_parse_version(text: str, version: tuple[int, ...]) -> None:
    assert parse.parse_version(text) == version


@given(
    st.lists(st.integers(0, 10**6), min_size=1, max_size=4),
    st.sampled_from(["", "v"]),
    st.sampled_from(["", "-rc.1", "~ds1", "+g1"]),
)
def test_parse_version_round_trip(parts: list[int], prefix: str, suffix: str) -> None:
    assert parse.parse_version(prefix + ".".join(map(str, parts)) + suffix) == tuple(parts)


def test_render_and_exit_status() -> None:
    findings = [
        Finding("config", Level.OK, "defaults"),
        Finding("kubelet", Level.WARN, "not running", "systemctl status kubelet"),
    ]
    text = output.render(findings, "/etc/crihook/config.toml")
    assert "  ok    config   defaults\n" in text
    assert "  WARN  kubelet  not running\n" in text and "fix: systemctl status kubelet" in text
    assert text.endswith("0 problem(s), 1 warning(s).\n")
    assert exit_status(findings) == 0
    findings.append(Finding("containerd", Level.FAIL, "no socket", "start it"))
    assert exit_status(findings) == 1
    assert output.render(findings[:1], "x").endswith("Everything crihook needs on this node is in order.\n")


def test_header_names_the_config_only_when_it_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from crihook.cli import main

    absent = tmp_path / "config.toml"
    main(["doctor", "--config", str(absent), "--timeout", "0.1"])
    header = capsys.readouterr().out.splitlines()[0]
    assert header == f"crihook doctor: checking this node with the built-in defaults (no {absent})"
    absent.write_text("")
    main(["doctor", "--config", str(absent), "--timeout", "0.1"])
    assert capsys.readouterr().out.startswith(f"crihook doctor: checking this node with {absent}\n")


# -- node pieces ----------------------------------------------------------------------------------


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="chd"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class FakeRuntime:
    """A CRI v1 server answering only Version, as a given runtime would; or nothing at all, as a
    containerd with its CRI plugin disabled does."""

    def __init__(self, path: Path, version: str | None) -> None:
        from crihook.proto import runtime_v1_pb2 as api

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        if version is not None:
            reply = api.VersionResponse(
                version="0.1.0", runtime_name="containerd", runtime_version=version, runtime_api_version="v1"
            )
            handler = grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: reply,
                request_deserializer=api.VersionRequest.FromString,
                response_serializer=api.VersionResponse.SerializeToString,
            )
            self.server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("runtime.v1.RuntimeService", {"Version": handler}),)
            )
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def close(self) -> None:
        self.server.stop(None)


@pytest.fixture
def fake_runtime(short_tmp: Path) -> Iterator[Any]:
    servers: list[FakeRuntime] = []

    def start(name: str, version: str | None) -> str:
        servers.append(FakeRuntime(short_tmp / name, version))
        return f"unix://{short_tmp / name}"

    yield start
    for s in servers:
        s.close()


def test_runtime_missing_socket(short_tmp: Path) -> None:
    f, version = cri.check_runtime(NodeConfig(runtime_endpoint=f"unix://{short_tmp}/none.sock"), 1.0)
    assert (f.level, version) == (Level.FAIL, None)
    assert f.found == f"no socket at {short_tmp}/none.sock" and "systemctl status containerd" in f.fix


def test_runtime_socket_nobody_listens(short_tmp: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(short_tmp / "dead.sock"))
    f, _ = cri.check_runtime(NodeConfig(runtime_endpoint=f"unix://{short_tmp}/dead.sock"), 1.0)
    assert f.level is Level.FAIL and "does not answer CRI v1 (UNAVAILABLE" in f.found
    assert "journalctl -u containerd" in f.fix


def test_runtime_without_cri_plugin(fake_runtime: Any) -> None:
    endpoint = fake_runtime("nocri.sock", None)
    f, _ = cri.check_runtime(NodeConfig(runtime_endpoint=endpoint), 2.0)
    assert f.level is Level.FAIL and "UNIMPLEMENTED" in f.found
    assert "disabled_plugins" in f.fix


def test_runtime_too_old_and_new_enough(fake_runtime: Any) -> None:
    f, _ = cri.check_runtime(NodeConfig(runtime_endpoint=fake_runtime("old.sock", "v1.5.9")), 2.0)
    assert f.level is Level.FAIL and "containerd v1.5.9 answers CRI v1" in f.found and "1.6 or newer" in f.fix
    f, version = cri.check_runtime(NodeConfig(runtime_endpoint=fake_runtime("new.sock", "1.7.2")), 2.0)
    assert f.level is Level.OK and version.runtime_version == "1.7.2"


def test_proxy_socket_missing_not_a_socket_and_dead(short_tmp: Path) -> None:
    f = cri.check_proxy(ProxyConfig(listen=f"unix://{short_tmp}/crihook.sock"), None, 1.0)
    assert f.level is Level.FAIL and "crihook is not running" in f.found and "systemctl start crihook" in f.fix
    (short_tmp / "file.sock").write_text("")
    f = cri.check_proxy(ProxyConfig(listen=f"unix://{short_tmp}/file.sock"), None, 1.0)
    assert f.level is Level.FAIL and f.found.endswith("is not a socket")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(short_tmp / "dead.sock"))
    f = cri.check_proxy(ProxyConfig(listen=f"unix://{short_tmp}/dead.sock"), None, 1.0)
    assert f.level is Level.FAIL and "crihook does not answer" in f.found


def test_proxy_answering_for_another_runtime_or_open_to_all(fake_runtime: Any, short_tmp: Path) -> None:
    """Whatever answers at crihook's socket is checked against the runtime doctor reached itself."""
    listen = fake_runtime("proxy.sock", "1.7.2")
    _, other = cri.check_runtime(NodeConfig(runtime_endpoint=fake_runtime("other.sock", "1.7.9")), 2.0)
    f = cri.check_proxy(ProxyConfig(listen=listen), other, 2.0)
    assert f.level is Level.WARN and "systemctl restart crihook" in f.fix
    _, same = cri.check_runtime(NodeConfig(runtime_endpoint=fake_runtime("same.sock", "1.7.2")), 2.0)
    os.chmod(short_tmp / "proxy.sock", 0o666)
    f = cri.check_proxy(ProxyConfig(listen=listen), same, 2.0)
    assert f.level is Level.WARN and "mode 0666" in f.found and "0600" in f.fix
    os.chmod(short_tmp / "proxy.sock", 0o600)
    assert cri.check_proxy(ProxyConfig(listen=listen), same, 2.0).level is (
        Level.OK if os.geteuid() == 0 else Level.WARN
    )


def test_kubelet_checks(tmp_path: Path) -> None:
    proxy = ProxyConfig()
    (tmp_path / "k.yaml").write_text("containerRuntimeEndpoint: unix:///run/crihook/crihook.sock\n")
    cases = [
        (None, Level.WARN, "kubelet is not running"),
        (["/usr/bin/kubelet", f"--config={tmp_path}/k.yaml"], Level.OK, "kubelet uses crihook"),
        (
            ["/usr/bin/kubelet", "--container-runtime-endpoint=unix:///run/containerd/containerd.sock"],
            Level.FAIL,
            "crihook sees no pod",
        ),
        (["/usr/bin/kubelet"], Level.FAIL, "(kubelet's default)"),
        (["/usr/bin/kubelet", f"--config={tmp_path}/missing.yaml"], Level.FAIL, "can not be read"),
    ]
    for i, (argv, level, text) in enumerate(cases):
        node = NodeConfig(proc_root=str(fake_proc(tmp_path / str(i), argv)))
        f = cri.check_kubelet(proxy, node)
        assert (f.level, text in f.found) == (level, True), f
        if level is Level.FAIL and "sees no pod" in f.found:
            assert "--container-runtime-endpoint=unix:///var/run/crihook/crihook.sock" in f.fix


def node_gpus(minors: list[int], driver: str = "550.54.15", sick: int | None = None) -> NodeGpus:
    """What the NVML layer reports for GPUs with these minors."""
    return NodeGpus(
        driver_version=driver,
        gpus=tuple(
            GpuInfo(
                index=i,
                minor=m,
                uuid=f"GPU-{m}",
                name="Tesla V100",
                memory_total=16 << 30,
                pci_bus_id=f"0000:{i + 1:02x}:00.0",
                healthy=m != sick,
                health_reason="XID 79" if m == sick else "",
            )
            for i, m in enumerate(minors)
        ),
    )


def dev_tree(root: Path, minors: list[int]) -> Path:
    dev = root / "dev"
    dev.mkdir()
    for name in ["nvidiactl", "nvidia-uvm", *(f"nvidia{m}" for m in minors)]:
        (dev / name).write_text("")
    return dev


def test_nvml_healthy_and_broken(tmp_path: Path) -> None:
    node = NodeConfig(dev_root=str(dev_tree(tmp_path, [0, 3])))
    f = gpu.check_nvml(node, node_gpus([3, 0]))
    assert f == Finding("NVIDIA driver", Level.OK, "driver 550.54.15, 2 GPU(s), minors 0, 3; device nodes present")
    f = gpu.check_nvml(node, node_gpus([0, 3, 5]))
    assert f.level is Level.FAIL and f.found.endswith(f"device nodes missing: {node.dev_root}/nvidia5")
    assert "nvidia-modprobe" in f.fix
    f = gpu.check_nvml(node, node_gpus([]))
    assert f.level is Level.WARN and "sees no GPU" in f.found
    f = gpu.check_nvml(node, node_gpus([0, 3], sick=3))
    assert (f.level, f.found.endswith("unhealthy: minor 3 (XID 79)")) == (Level.WARN, True)
    mixed = node_gpus([0, 3])
    mixed = replace(mixed, gpus=(mixed.gpus[0], replace(mixed.gpus[1], mig_enabled=True)))
    f = gpu.check_nvml(node, mixed)
    assert (f.level, f.found) == (
        Level.OK,
        "driver 550.54.15, 2 GPU(s), minors 0, 3; in MIG mode, for the device plugin's nvidia.com/mig-* only:"
        " minors 3; device nodes present",
    )
    f = gpu.check_nvml(node, NodeGpus(reason="NVML does not start: Driver Not Loaded"))
    assert (f.level, f.found) == (Level.FAIL, "NVML does not start: Driver Not Loaded") and "nvidia-smi" in f.fix


def test_nvml_through_the_library(tmp_path: Path, fake_nvml: Any) -> None:
    """The real pynvml, loaded from node.nvml_library, asked by the same layer the gpu hook uses."""
    fake = fake_nvml("pcie-l40s")
    minors = [g["minor"] for g in fake.doc["gpus"]]
    node = NodeConfig(
        dev_root=str(dev_tree(tmp_path, minors)), nvml_library=str(fake.library), sys_root=str(fake.sys_root)
    )
    f = gpu.check_nvml(node)
    assert f.level is Level.OK, f
    assert f.found.startswith(f"driver {fake.doc['driver_version']}, {len(minors)} GPU(s)")


def test_nvml_library_that_does_not_load(tmp_path: Path) -> None:
    f = gpu.check_nvml(NodeConfig(nvml_library=str(tmp_path / "libnvidia-ml.so.1")))
    assert f.level is Level.FAIL and f"{tmp_path}/libnvidia-ml.so.1" in f.found and "can not be loaded" in f.found
    assert "node.nvml_library" in f.fix


def test_real_nvml_without_a_driver() -> None:
    """On a machine with no NVIDIA driver, the loader's own failure is what doctor reports."""
    import ctypes.util

    import pynvml

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has an NVIDIA driver")
    if pynvml.nvmlLib is not None:
        pytest.skip("an NVML library (the fake) is already loaded in this test process")
    f = gpu.check_nvml(NodeConfig())
    assert f.level is Level.FAIL and "NVML" in f.found, f


def entry(uid: str, name: str, resource: str, ids: Any, alloc: str | None = None) -> dict[str, Any]:
    return {"PodUID": uid, "ContainerName": name, "ResourceName": resource, "DeviceIDs": ids, "AllocResp": alloc}


def test_checkpoint_checks(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    node = NodeConfig(kubelet_checkpoint=str(path))
    assert gpu.check_checkpoint(node).level is Level.WARN

    entries = [
        entry("u1", "a", "nvidia.com/gpu", ["GPU-1", "GPU-2"]),  # kubelet <= 1.19
        entry("u2", "b", "nvidia.com/gpu", {"0": ["GPU-3"]}),  # >= 1.20, NUMA map
        entry("u2", "b", "rdma/hca", {"-1": ["mlx5_0"]}),
    ]
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}}, "Checksum": 1}))
    f = gpu.check_checkpoint(node)
    assert f == Finding(
        "device checkpoint", Level.OK, f"{path} readable: 3 nvidia.com/gpu, 1 rdma/hca held through device plugins"
    )

    entries.append(entry("u3", "c", "nvidia.com/gpu", ["GPU-4"], alloc="bm90IGEgbWVzc2FnZQ=="))
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": entries}}))
    f = gpu.check_checkpoint(node)
    assert f.level is Level.WARN and "1 entry with an undecodable AllocResp, first u3/c" in f.found

    path.write_text('{"Data": {"PodDeviceEntries": [')
    f = gpu.check_checkpoint(node)
    assert f.level is Level.FAIL and "not valid JSON" in f.found and "fail closed" in f.fix
    path.write_text('{"Data": {"PodDeviceEntries": [{"PodUID": 3}]}}')
    assert "Data.PodDeviceEntries[0].PodUID: expected a string" in gpu.check_checkpoint(node).found


def test_state_dir_checks(tmp_path: Path) -> None:
    state = tmp_path / "state"
    proxy = ProxyConfig(state_dir=str(state))
    assert files.check_state_dir(proxy).level is Level.WARN
    state.write_text("")
    assert files.check_state_dir(proxy).level is Level.FAIL
    state.unlink()
    state.mkdir(mode=0o700)
    f = files.check_state_dir(proxy)
    assert f.level is Level.OK and "no store.json yet" in f.found
    store = Store(state)
    store.pods["p1"] = PodRecord("p1", "train", "default", "uid-1")
    store.save()
    assert files.check_state_dir(proxy).found.endswith("store.json: 1 pod(s), 0 container(s)")
    state.chmod(0o777)
    f = files.check_state_dir(proxy)
    assert f.level is Level.WARN and "chmod 0700" in f.fix
    state.chmod(0o700)
    raw = (state / "store.json").read_bytes()
    (state / "store.json").write_bytes(raw.replace(b"train", b"tra1n"))
    f = files.check_state_dir(proxy)
    assert f.level is Level.FAIL and "checksum" in f.found


def test_hook_server_checks(tmp_path: Path) -> None:
    """A server file crihook skips (Koordinator calls a server with an unknown policy as Ignore;
    crihook does not call it at all) is a failure doctor names, not only a log line."""
    from crihook.base.config import Config, HooksConfig

    confdir = tmp_path / "hookserver.d"

    def check(disabled: tuple[str, ...] = ()) -> Finding:
        hooks = HooksConfig(disabled=disabled, options={"remote": {"config_dir": str(confdir)}})
        return files.check_hook_servers(Config(hooks=hooks))

    assert check().level is Level.OK and "no hook servers configured" in check().found
    confdir.mkdir()
    socket = tmp_path / "koordlet.sock"
    doc = {"remote-endpoint": str(socket), "failure-policy": "Fail", "runtime-hooks": ["PreCreateContainer"]}
    (confdir / "koordlet.json").write_text(json.dumps(doc))
    (confdir / ".hidden.json").write_text("not a server")
    f = check()
    assert f.level is Level.WARN and "koordlet.json" in f.found and str(socket) in f.found and f.fix
    socket.touch()
    assert check() == Finding("hook servers", Level.OK, f"1 server(s) in {confdir}: koordlet.json (Fail)")
    (confdir / "other.json").write_text(json.dumps({**doc, "failure-policy": "Always"}))
    f = check()
    assert f.level is Level.FAIL and "other.json failure-policy: must be Fail or Ignore" in f.found and f.fix
    assert check(disabled=("remote",)).level is Level.OK


def test_config_checks(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[proxy]\nlisten = 3\n")
    config, f = files.check_config(str(bad))
    assert f.level is Level.FAIL and "listen: expected str" in f.found
    assert config.proxy == ProxyConfig()
    good = tmp_path / "good.toml"
    good.write_text('[proxy]\nlog_level = "debug"\n')
    config, f = files.check_config(str(good))
    assert f.level is Level.OK and config.proxy.log_level == "debug"


# -- whole nodes ----------------------------------------------------------------------------------


def write_config(path: Path, **sections: dict[str, str]) -> Path:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_doctor(config: Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "crihook.cli", "doctor", "--config", str(config), "--timeout", "2", *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


def test_broken_node_command_line(short_tmp: Path) -> None:
    """Nothing there: every check has a finding with a fix, the exit status says so."""
    config = write_config(
        short_tmp / "config.toml",
        proxy={
            "listen": f"unix://{short_tmp}/crihook.sock",
            "state_dir": str(short_tmp / "state"),
        },
        node={
            "runtime_endpoint": f"unix://{short_tmp}/containerd.sock",
            "proc_root": str(fake_proc(short_tmp, None)),
            "dev_root": str(short_tmp / "dev"),
            "kubelet_checkpoint": str(short_tmp / "checkpoint"),
            "nvml_library": str(short_tmp / "libnvidia-ml.so.1"),
        },
        **{"hooks.remote": {"config_dir": str(short_tmp / "hookserver.d")}},
    )
    rc, out = run_doctor(config, "--json", "--containerd-config", str(short_tmp / "none.toml"))
    assert rc == 1, out
    findings = {f["check"]: f for f in json.loads(out)}
    assert list(findings) == [
        "config",
        "containerd",
        "crihook socket",
        "kubelet",
        "NVIDIA driver",
        "CDI",
        "device checkpoint",
        "state dir",
        "hook servers",
    ]
    assert {c: f["level"] for c, f in findings.items()} == {
        "config": "ok",
        "containerd": "fail",
        "crihook socket": "fail",
        "kubelet": "warn",
        "NVIDIA driver": "fail",
        "CDI": "ok",  # inject = "env+devices": nothing to fail
        "device checkpoint": "warn",
        "state dir": "warn",
        "hook servers": "ok",
    }
    assert all(f["fix"] for f in findings.values() if f["level"] != "ok")
    rc, text = run_doctor(config)
    assert rc == 1 and "FAIL  containerd" in text and "3 problem(s), 3 warning(s)." in text


def wait_for_socket(path: Path, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate(timeout=5)[0] if proc.poll() is not None else "(still running)"
            raise AssertionError(f"crihook serve did not bind {path}: {out}")
        time.sleep(0.05)


def test_healthy_node(containerd: Any, short_tmp: Path) -> None:
    """A real containerd, a real `crihook serve` in front of it, kubelet (a /proc entry) pointed at
    crihook, a driver with two GPUs and their device nodes, a checkpoint: no finding but ok."""
    listen = short_tmp / "crihook.sock"
    checkpoint = short_tmp / "checkpoint"
    checkpoint.write_text(json.dumps({"Data": {"PodDeviceEntries": [], "RegisteredDevices": {}}, "Checksum": 1}))
    (short_tmp / "pods").mkdir()
    root = f"--root-dir={short_tmp}"
    config = write_config(
        short_tmp / "config.toml",
        proxy={
            "listen": f"unix://{listen}",
            "state_dir": str(short_tmp / "state"),
            "metrics_listen": "",
        },
        node={
            "runtime_endpoint": containerd.address,
            "proc_root": str(fake_proc(short_tmp, ["kubelet", f"--container-runtime-endpoint=unix://{listen}", root])),
            "dev_root": str(dev_tree(short_tmp, [0, 1])),
            "kubelet_checkpoint": str(checkpoint),
        },
    )
    serve = subprocess.Popen(
        [sys.executable, "-m", "crihook.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_socket(listen, serve)
        findings = doctor.diagnose(
            str(config), timeout=5.0, gpus=node_gpus([0, 1]), containerd_config=str(containerd.config_path)
        )
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)
    assert [f for f in findings if f.level is not Level.OK] == [], findings
    by_check = {f.check: f for f in findings}
    assert by_check["crihook socket"].found.startswith(f"crihook answers at unix://{listen} and forwards to containerd")
    assert by_check["kubelet"].found.startswith(f"kubelet uses crihook at unix://{listen}")
    assert by_check["state dir"].found.startswith(f"{short_tmp}/state")


def test_checkpoint_and_pods_dir_advice_follows_kubelet(tmp_path: Path) -> None:
    # kubelet keeps the checkpoint in /var/lib/kubelet/device-plugins whatever --root-dir says; the
    # pods dir follows --root-dir, and the advice for each says so
    gone = NodeConfig(kubelet_checkpoint=str(tmp_path / "kubelet" / "device-plugins" / "kubelet_internal_checkpoint"))
    f = gpu.check_checkpoint(gone)
    assert f.level is Level.WARN and "does not exist" in f.found
    assert "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint whatever its --root-dir" in f.fix

    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": [], "RegisteredDevices": {}}, "Checksum": 1}))
    root = tmp_path / "data" / "kubelet"
    proc = fake_proc(tmp_path, ["kubelet", f"--root-dir={root}"])
    node = NodeConfig(kubelet_checkpoint=str(path), proc_root=str(proc))
    f = gpu.check_checkpoint(node)
    assert f.level is Level.WARN and f"kubelet's pods dir {root}/pods does not exist" in f.found
    (root / "pods").mkdir(parents=True)
    assert gpu.check_checkpoint(node).level is Level.OK
    assert gpu.check_checkpoint(node, {"kubelet_pods_dir": f"{root}/pods"}).level is Level.OK
    f = gpu.check_checkpoint(node, {"kubelet_pods_dir": "/var/lib/kubelet/pods"})
    assert f.level is Level.WARN and f"kubelet keeps pods in {root}/pods" in f.found
    assert "remove kubelet_pods_dir" in f.fix


def test_evictions_that_keep_failing_are_a_failure(tmp_path: Path) -> None:
    """What `crihook nri` writes while an eviction keeps failing is named, with the fix."""
    config = Config(proxy=ProxyConfig(state_dir=str(tmp_path)))
    assert check_evictions(config).level is Level.OK
    hit = Ungranted(
        "c1", "ml/web", "cuda", "GPU minor 0 (by NVIDIA_VISIBLE_DEVICES=all)", "CRI socket not reachable", 3
    )
    (tmp_path / EVICTIONS_FILE).write_text(json.dumps([asdict(hit)]))
    found = check_evictions(config)
    assert found.level is Level.FAIL
    assert "container cuda of pod ml/web (GPU minor 0 (by NVIDIA_VISIBLE_DEVICES=all)): 3 tries" in found.found
    assert "last error: CRI socket not reachable" in found.found and "crictl stop" in found.fix
