"""Which mode the node runs (crihook/cli/mode.py), and `crihook doctor` checking a node in NRI mode."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from crihook.cli.mode import crihook_command, node_mode, running
from tests.cli import test_doctor
from tests.cli.test_doctor import run_doctor, write_config
from tests.support.gpu_fixtures import fake_proc

# the doctor tests' fixtures: a CRI Version server, a directory short enough for unix sockets
fake_runtime, short_tmp = test_doctor.fake_runtime, test_doctor.short_tmp


@pytest.mark.parametrize(
    ("argv", "mode"),
    [
        (["/opt/crihook/venv/bin/python3", "/opt/crihook/venv/bin/crihook", "nri", "--config", "c"], "nri"),
        (["/opt/crihook/venv/bin/crihook", "serve"], "proxy"),
        (["python3", "-m", "crihook.cli", "nri", "--nri-socket", "/x"], "nri"),
        (["crihook", "doctor"], None),
        (["crihook"], None),
        (["/usr/bin/kubelet", "--v=2"], None),
        (["vim", "crihook", "nri"], None),
    ],
)
def test_crihook_command(argv: list[str], mode: str | None) -> None:
    assert crihook_command(argv) == mode


def with_process(proc: Path, pid: int, argv: list[str]) -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")


def nri_node(short_tmp: Path, runtime: str, kubelet_endpoint: str, nri_socket: Path | None) -> Path:
    proc = fake_proc(short_tmp, ["kubelet", f"--container-runtime-endpoint={kubelet_endpoint}"])
    if nri_socket is not None:
        with_process(proc, 777, ["/opt/crihook/venv/bin/crihook", "nri", "--nri-socket", str(nri_socket)])
    return write_config(
        short_tmp / "config.toml",
        proxy={"listen": f"unix://{short_tmp}/crihook.sock", "state_dir": str(short_tmp)},
        node={"proc_root": str(proc), "runtime_endpoint": runtime},
    )


def findings(config: Path, *extra: str) -> dict[str, dict[str, str]]:
    _, out = run_doctor(config, "--json", *extra)
    return {f["check"]: f for f in json.loads(out)}


def test_doctor_checks_an_nri_node(fake_runtime: Any, short_tmp: Path) -> None:
    runtime = fake_runtime("containerd.sock", "2.1.9+unknown")
    nri_socket = short_tmp / "nri.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(nri_socket))
        config = nri_node(short_tmp, runtime, runtime, nri_socket)
        assert "NRI mode (crihook nri, pid 777)" in node_mode(str(short_tmp / "proc"))
        got = findings(config)
        assert "crihook socket" not in got
        assert (got["NRI"]["level"], got["kubelet"]["level"]) == ("ok", "ok"), got
        assert got["NRI"]["found"] == f"NRI mode (crihook nri, pid 777) at {nri_socket}"
        # kubelet still pointed at the proxy's socket: nothing answers there in NRI mode
        config = nri_node(short_tmp, runtime, f"unix://{short_tmp}/crihook.sock", None)
        with_process(short_tmp / "proc", 778, ["crihook", "nri", "--nri-socket", str(nri_socket)])
        got = findings(config)
        assert got["kubelet"]["level"] == "fail" and "install.sh --mode nri" in got["kubelet"]["fix"]


def test_doctor_says_how_to_turn_nri_on(fake_runtime: Any, short_tmp: Path) -> None:
    runtime = fake_runtime("containerd.sock", "1.7.24~ds1")
    config = nri_node(short_tmp, runtime, runtime, None)
    assert running(str(short_tmp / "proc")) == []
    got = findings(config, "--mode", "nri")
    assert got["NRI"]["level"] == "fail"
    assert got["NRI"]["found"] == "no NRI socket at /var/run/nri/nri.sock: containerd's NRI is off"
    assert '[plugins."io.containerd.nri.v1.nri"] disable = false' in got["NRI"]["fix"]


def test_doctor_refuses_what_the_runtime_can_not_do(fake_runtime: Any, short_tmp: Path) -> None:
    old = fake_runtime("old.sock", "1.6.20~ds1")
    config = nri_node(short_tmp, old, old, None)
    assert findings(config, "--mode", "nri")["NRI"]["found"] == "containerd 1.6.20~ds1 has no NRI"
    cdi = fake_runtime("cdi.sock", "1.7.24~ds1")
    config = nri_node(short_tmp, cdi, cdi, None)
    config.write_text(config.read_text() + '[hooks.gpu]\ninject = "cdi"\n')
    got = findings(config, "--mode", "nri")["NRI"]
    assert got["level"] == "fail" and "containerd 1.7.24~ds1 drops" in got["found"]
