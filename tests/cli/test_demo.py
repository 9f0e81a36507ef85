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
    """`crihook demo --json ARGS` (or `command`, such as `bash demo.sh`): each pod's outcome by name.

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
    return {o["pod"]: o for o in map(json.loads, done.stdout.splitlines())}


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


def test_demo_with_the_embedded_runtime() -> None:
    check(run_demo("--runtime", "embedded"))


def test_demo_on_other_topologies() -> None:
    for topology in ("dgx-h100", "pcie-l40s"):
        pods = run_demo("--runtime", "embedded", "--topology", topology)
        assert pods["cpu-only"]["containers"]["main"]["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert len(visible(pods["train-4"])) == 4


@pytest.mark.containerd
def test_demo_with_real_containerd() -> None:
    check(run_demo("--runtime", "containerd"))
