"""`crihook demo`, the README's first command, as a user runs it: it places every request form,
the containers get what the allocator chose, bad pods are refused, and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


def run_demo(
    *args: str,
    command: Sequence[str] = (sys.executable, "-m", "crihook.cli", "demo"),
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """`crihook demo --json ARGS` (or `command`, such as `bash demo.sh`): each pod's outcome by name,
    and the usage table's rows under "top".

    The demo gets a temporary directory of its own (TMPDIR), so "left nothing behind" is checked on
    what this run made, not on what other runs on the machine make meanwhile."""
    with tempfile.TemporaryDirectory(prefix="crihook-demo-test-") as tmp:
        done = subprocess.run(
            [*command, "--json", *args],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env={**(os.environ if env is None else env), "TMPDIR": tmp},
        )
        assert done.returncode == 0, done.stderr
        assert not [p.name for p in Path(tmp).glob("crihook-demo-*")]  # cleaned up
    # one line per pod, then the `crihook top --once` rows, kept under "top"
    return {o.get("pod", "top"): o for o in map(json.loads, done.stdout.splitlines())}


def visible(outcome: dict[str, Any], container: str = "main") -> list[str]:
    return outcome["containers"][container]["env"]["NVIDIA_VISIBLE_DEVICES"].split(",")


def check(pods: dict[str, dict[str, Any]]) -> None:
    train = pods["train-4"]
    uuids = visible(train)
    assert len(uuids) == 4 and all(u.startswith("GPU-") for u in uuids)
    # on the DGX-1 hybrid cube-mesh the 4-GPU choice is one fully NVLinked quad
    assert train["scheduled"] in ("minor 0, minor 1, minor 2, minor 3", "minor 4, minor 5, minor 6, minor 7")
    devices = [d for d in train["containers"]["main"]["devices"] if d[len("/dev/nvidia") :].isdigit()]
    assert len(devices) == 4
    split = pods["split"]
    a, b = visible(split, "a"), visible(split, "b")
    assert len(a) == len(b) == 1 and a != b and not set(a + b) & set(uuids)
    hami = pods["share-hami"]["containers"]["main"]["env"]
    assert hami["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m" and hami["CUDA_DEVICE_SM_LIMIT"] == "25"
    assert "koordinator.sh/gpu" not in pods["koord-gpu"]["scheduled"] and visible(pods["koord-gpu"])
    assert (
        pods["wrong-type"]["scheduled"].startswith("unschedulable") and "use-gputype" in pods["wrong-type"]["scheduled"]
    )
    assert pods["too-big"]["scheduled"].startswith("unschedulable") and not pods["too-big"]["containers"]
    cpu = pods["cpu-only"]["containers"]["main"]
    assert cpu["env"]["NVIDIA_VISIBLE_DEVICES"] == "void" and cpu["devices"] == []
    forged = pods["forged"]
    assert forged["refused"].startswith("CreateContainer: FAILED_PRECONDITION: hook gpu: pod demo/forged")
    assert "minor 99" in forged["refused"]
    check_usage(pods)
    assert {(r["pod"], r["container"]) for r in pods["top"]["top"]} == {
        ("train-4", "main"),
        ("split", "a"),
        ("split", "b"),
        ("share-half", "main"),
        ("koord-gpu", "main"),
        ("share-hami", "main"),
        ("by-type", "main"),
        ("", ""),
    }


def check_usage(pods: dict[str, dict[str, Any]]) -> None:
    """The demo's GPU processes, attributed: a row per GPU container with its grant, none for the
    CPU-only one, the host's process, the container above its memory grant marked."""
    rows = {(r["pod"], r["container"]): r for r in pods["top"]["top"]}
    with_gpus = {
        (name, c)
        for name, o in pods.items()
        if name != "top"
        for c, view in o["containers"].items()
        if view["env"]["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    }
    assert with_gpus and set(rows) == with_gpus | {("", "")}
    train = rows[("train-4", "main")]
    assert len(train["gpus"]) == 4 and train["granted_core"] == 400 and train["sm_util"] == 90
    assert train["used_memory"] == pytest.approx(0.75 * train["granted_memory"], rel=1e-6)
    over = {k for k, r in rows.items() if r["over_grant"]}
    assert over == {("share-hami", "main")} & with_gpus
    if over:
        hami = rows[("share-hami", "main")]
        assert (hami["granted_core"], hami["granted_memory"], hami["used_memory"]) == (25, 4 << 30, 5 << 30)
    host = rows[("", "")]
    assert host["kind"] == "host" and host["used_memory"] == 256 << 20 and host["granted_core"] is None


def test_demo_with_the_embedded_runtime() -> None:
    check(run_demo("--runtime", "embedded"))


def test_demo_ends_with_the_top_table() -> None:
    with tempfile.TemporaryDirectory(prefix="crihook-demo-test-") as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "crihook.cli", "demo", "--runtime", "embedded"],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": tmp},
        )
    assert done.returncode == 0, done.stderr
    table = done.stdout[done.stdout.index("crihook top: 8 GPUs") :].splitlines()
    assert table[-1] == "! above its memory grant (reported only)"
    hami = next(line.split() for line in table if line.startswith("demo/share-hami"))
    assert hami[:6] == ["demo/share-hami", "main", hami[2], "25%", "4.0Gi", "5.0Gi!"]
    assert any(line.startswith("(host)") for line in table)


def test_demo_on_other_topologies() -> None:
    for topology in ("dgx-h100", "pcie-l40s"):
        pods = run_demo("--runtime", "embedded", "--topology", topology)
        assert pods["cpu-only"]["containers"]["main"]["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"
        check_usage(pods)
        assert len(visible(pods["train-4"])) == 4


@pytest.mark.containerd
def test_demo_with_real_containerd() -> None:
    check(run_demo("--runtime", "containerd"))
