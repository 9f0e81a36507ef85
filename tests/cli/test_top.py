"""`crihook top` over a usage state file as the collector writes it: the table, --json's rows, and
what it says when there is nothing to read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from crihook.cli import top
from crihook.devices import usage
from crihook.devices.usage import GpuProcess, GpuState, Grant, KnownContainer

GiB = 1 << 30
G0, G1 = "GPU-aaaaaaaa-0000", "GPU-bbbbbbbb-1111"
CID, CID2 = "1" * 64, "2" * 64


def cg(cid: str) -> str:
    return f"0::/kubepods/podx/{cid}\n"


def state_doc(taken_at: float) -> dict[str, object]:
    known = {
        CID: KnownContainer(CID, "ml", "train", "main", (Grant(G0, 100, 80 * GiB), Grant(G1, 100, 80 * GiB))),
        CID2: KnownContainer(CID2, "web", "infer", "model", (Grant(G1, 25, 4 * GiB),)),
    }
    procs = [
        GpuProcess(10, G0, G0, 30 * GiB, 80.0),
        GpuProcess(10, G1, G1, 2 * GiB, 40.0),
        GpuProcess(20, G1, G1, 5 * GiB, 10.0),
        GpuProcess(30, G1, "MIG-cccccccc-2222", GiB),
        GpuProcess(40, G0, G0, GiB),
    ]
    rows = usage.attribute(procs, {10: cg(CID), 20: cg(CID2), 30: cg("3" * 64), 40: "0::/system.slice\n"}, known)
    gpus = [GpuState(G0, 0, 80 * GiB, 31 * GiB), GpuState(G1, 1, 80 * GiB, 8 * GiB)]
    return usage.encode(gpus, rows, taken_at, 10.0)


def test_the_table_has_a_row_per_container(tmp_path: Path) -> None:
    state = usage.decode(state_doc(1000.0))
    text = top.render(state, 1002.0)
    lines = text.splitlines()
    assert lines[0] == "crihook top: 2 GPUs, collected 2s ago (every 10s)"
    assert "GPU 0" in lines[1] and "31.0Gi / 80.0Gi" in lines[1]
    header = next(i for i, line in enumerate(lines) if line.startswith("POD"))
    rows = [line.split() for line in lines[header + 1 :] if line and not line.startswith("!")]
    assert rows[0] == ["ml/train", "main", "0,1", "200%", "160.0Gi", "32.0Gi", "60", "1", "-"]
    assert rows[1] == ["web/infer", "model", "1", "25%", "4.0Gi", "5.0Gi!", "10", "1", "-"]
    assert rows[2] == ["(host)", "-", "0", "-", "-", "1.0Gi", "-", "1", "-"]
    assert rows[3][:3] == ["(unknown", "container)", "3" * 13]
    assert rows[3][3] == "1:MIG-cccccccc"
    assert lines[-1] == "! above its memory grant (reported only)"
    assert "STALE" in top.render(state, 1031.0) and "STALE" not in text


def test_json_rows(tmp_path: Path) -> None:
    out = top.rows_json(usage.decode(state_doc(1000.0)), 1001.0)
    assert out["age_seconds"] == 1.0
    infer = next(r for r in out["rows"] if r["pod"] == "infer")
    assert infer == {
        "kind": "container",
        "namespace": "web",
        "pod": "infer",
        "container": "model",
        "container_id": CID2,
        "gpus": ["1"],
        "granted_core": 25,
        "granted_memory": 4 * GiB,
        "used_memory": 5 * GiB,
        "sm_util": 10.0,
        "over_grant": True,
        "claims": [],
        "pids": [20],
    }


def test_a_container_whose_gpu_came_through_a_dra_claim_names_it() -> None:
    known = {CID: KnownContainer(CID, "ml", "dra", "main", (Grant(G1, 0, 0, "ml/dra-gpus"),))}
    rows = usage.attribute([GpuProcess(10, G1, G1, 3 * GiB, 20.0)], {10: cg(CID)}, known)
    state = usage.decode(usage.encode([GpuState(G1, 1, 80 * GiB, 3 * GiB)], rows, 1000.0, 10.0))
    lines = top.render(state, 1001.0).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("POD"))
    assert lines[header].split()[-1] == "CLAIM"
    assert lines[header + 1].split() == ["ml/dra", "main", "1", "-", "-", "3.0Gi", "20", "1", "ml/dra-gpus"]
    (row,) = top.rows_json(state, 1001.0)["rows"]
    assert (row["claims"], row["granted_core"], row["granted_memory"]) == (["ml/dra-gpus"], None, None)


def test_a_claims_share_is_shown_as_its_grant() -> None:
    """Where crihook's driver recorded the claim's share, the row has it as its core and memory."""
    known = {CID: KnownContainer(CID, "ml", "dra", "main", (Grant(G1, 50, 8 * GiB, "ml/half/gpu"),))}
    rows = usage.attribute([GpuProcess(10, G1, G1, 9 * GiB, 20.0)], {10: cg(CID)}, known)
    state = usage.decode(usage.encode([GpuState(G1, 1, 80 * GiB, 9 * GiB)], rows, 1000.0, 10.0))
    lines = top.render(state, 1001.0).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("POD"))
    assert lines[header + 1].split() == ["ml/dra", "main", "1", "50%", "8.0Gi", "9.0Gi!", "20", "1", "ml/half/gpu"]
    (row,) = top.rows_json(state, 1001.0)["rows"]
    assert (row["claims"], row["granted_core"], row["granted_memory"]) == (["ml/half/gpu"], 50, 8 * GiB)


def run_top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "crihook.cli", "top", *args], capture_output=True, text=True, timeout=60
    )


def test_the_command_reads_the_state_dir(tmp_path: Path) -> None:
    import time

    (tmp_path / usage.STATE_FILE).write_text(json.dumps(state_doc(time.time())))
    done = run_top("--state-dir", str(tmp_path), "--once")
    assert done.returncode == 0, done.stderr
    assert "ml/train" in done.stdout and "\x1b[" not in done.stdout
    done = run_top("--state-dir", str(tmp_path), "--once", "--json")
    assert {r["pod"] for r in json.loads(done.stdout)["rows"]} == {"train", "infer", ""}


def test_nothing_to_read_is_said(tmp_path: Path) -> None:
    done = run_top("--state-dir", str(tmp_path), "--once")
    assert done.returncode == 1 and "no usage at" in done.stderr and "[usage] enabled" in done.stderr
    (tmp_path / usage.STATE_FILE).write_text('{"version": 99}')
    done = run_top("--state-dir", str(tmp_path), "--once")
    assert done.returncode == 1 and "not a version 1 usage file" in done.stderr


def test_a_running_daemon_reports_a_container_it_adopted_at_start(tmp_path: Path) -> None:
    """A GPU container created before crihook started (straight on the runtime), with a process on
    its GPU: the daemon adopts it at start, and `crihook top` shows it under its pod with its grant."""
    import os

    from crihook.base.allocation import DEVICE_ALLOCATED
    from crihook.cli.demo import container_view, embedded_runtime
    from crihook.simnode.cri import Cri, container_config, pod_config
    from crihook.simnode.daemon import running_crihook
    from crihook.simnode.fakenvml import CONFIG_ENV, build, compiler
    from crihook.simnode.node import make_sim_node

    if compiler() is None:
        import pytest

        pytest.skip("no C compiler (gcc) to build the fake NVML library")
    node = make_sim_node(tmp_path / "node", "dgx-h100", char_devices=False)
    gpu = node.doc["gpus"][2]
    alloc = json.dumps(
        {"gpu": [{"minor": gpu["minor"], "id": gpu["uuid"], "resources": {"koordinator.sh/gpu-core": 100}}]}
    )
    with embedded_runtime(tmp_path) as runtime, Cri(runtime.address) as cri:
        pod = pod_config("adopted", namespace="ml", uid="uid-adopted", annotations={DEVICE_ALLOCATED: alloc})
        cid = cri.create_container(cri.run_pod(pod), container_config("main", pod, image="busybox"), pod)
        cri.start_container(cid)
        _, cgroups_path = container_view(cri, cid)
        (node.proc_root / "4242").mkdir(parents=True)
        (node.proc_root / "4242" / "cgroup").write_text(f"0::{usage.cgroup_dir(cgroups_path)}\n")
        gpu["processes"] = [{"pid": 4242, "used_memory": 3 * GiB, "sm_util": 55}]
        node.config.write_text(json.dumps(node.doc))
        config = node.proxy_config(build(), proc_root=node.proc_root, kubelet_in_proc=False)
        env = {CONFIG_ENV: str(node.config)}
        with running_crihook(
            runtime.address, tmp_path / "crihook", config + "\n[usage]\ninterval_seconds = 0.2\n", env
        ) as proxy:
            for _ in range(300):  # the first collection follows the start at once; bounded wait
                done = run_top("--config", str(proxy.config_path), "--once", "--json")
                rows = json.loads(done.stdout)["rows"] if done.returncode == 0 else []
                if rows:
                    break
                os.sched_yield()
        cri.remove_all()
    (row,) = rows
    assert (row["namespace"], row["pod"], row["container"], row["container_id"]) == ("ml", "adopted", "main", cid)
    assert (row["used_memory"], row["sm_util"], row["granted_core"]) == (3 * GiB, 55.0, 100)
    assert row["granted_memory"] == gpu["memory_total"] and row["gpus"] == [str(gpu["minor"])]
