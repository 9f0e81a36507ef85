"""`crihook simulate` on a tiny trace written here: determinism, tuning, the JSON interface, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crihook.cli import main
from crihook.scheduler import simulate

NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,2,T4
n1,64000,262144,4,V100M16
n2,96000,393216,8,G2
n3,16000,65536,1,P100
n4,8000,65536,0,
"""

PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,4000,8192,1,500,,LS,Running,0,10,0
p1,8000,16384,1,1000,,LS,Running,0,10,0
p2,2000,4096,1,250,,BE,Running,0,10,0
p3,16000,32768,2,1000,,LS,Running,0,10,0
p4,1000,2048,0,0,,BE,Running,0,10,0
p5,4000,8192,1,700,V100M16|G2,LS,Running,0,10,0
p6,32000,65536,4,1000,,LS,Running,0,10,0
p7,2000,4096,1,300,,LS,Pending,0,10,
"""


@pytest.fixture
def trace(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "nodes.csv").write_text(NODES)
    (tmp_path / "pods.csv").write_text(PODS)
    return tmp_path / "nodes.csv", tmp_path / "pods.csv"


def test_workload_is_tuned_to_130_percent_and_seeded(trace: tuple[Path, Path]) -> None:
    pods = simulate.read_pods(trace[1])
    capacity = 15 * 1000
    a = simulate.workload(pods, capacity, 42)
    assert a == simulate.workload(pods, capacity, 42)
    assert a != simulate.workload(pods, capacity, 43)
    total = sum(p.gpu for p in a)
    assert total >= 1.3 * capacity and total - max(p.gpu for p in a) < 1.3 * capacity


@pytest.mark.parametrize("policy", simulate.POLICIES)
def test_every_policy_is_deterministic_and_never_overallocates(trace: tuple[Path, Path], policy: str) -> None:
    nodes, pods = simulate.read_nodes(trace[0]), simulate.read_pods(trace[1])
    assert [n.name for n in nodes] == ["n0", "n1", "n2", "n3"]  # the CPU-only node is not simulated
    a = simulate.run_once(nodes, pods, policy, 7)
    assert a == simulate.run_once(nodes, pods, policy, 7)
    assert all(0.0 <= v <= 100.0 for v in a.values())
    assert max(a) >= 129 and 0.0 <= simulate.at_100(a) <= 100.0


def test_json_interface(trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = trace
    argv = [
        "simulate",
        "--nodes",
        str(nodes),
        "--pods",
        str(pods),
        "--policy",
        "default,fgd",
        "--seeds",
        "1-3",
        "--json",
    ]
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["policy"] for x in lines] == ["default", "fgd"]
    for x in lines:
        assert x["seeds"] == [1, 2, 3] and len(x["per_seed"]) == 3
        assert x["unallocated_pct_at_100"] == pytest.approx(sum(x["per_seed"]) / 3, abs=1e-3)
        assert x["sd"] >= 0


def test_bad_input_is_reported(trace: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = trace
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "worst"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,10,1,abc\n")
    assert main(["simulate", "--nodes", str(nodes), "--pods", str(bad)]) == 2
    assert "bad.csv:2: gpu_milli" in capsys.readouterr().err
    assert main(["simulate", "--nodes", str(pods), "--pods", str(pods)]) == 2
    assert "missing columns" in capsys.readouterr().err
    with pytest.raises(simulate.TraceError):
        simulate.parse_seeds("a-b")
