"""Every maintained benchmark still starts, and the allocation table's pipeline still runs.

The benchmarks run by hand, so nothing else notices when a rename in the packages breaks one: each
script must answer --help (its imports resolve, its options parse), and `simulate_table.sh` feeds
`plot_allocation.py` on a trace small enough to simulate in a second."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.containerd import missing_requirements, runtime

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))

# The openb trace's columns (Weng et al., ATC '23, the `openb` cluster trace): a few nodes and pods.
NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,32000,131072,2,T4
n1,64000,262144,4,V100M16
n2,96000,393216,8,G2
"""
PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,4000,8192,1,500,,LS,Running,0,10,0
p1,8000,16384,1,1000,,LS,Running,0,10,0
p2,2000,4096,1,250,,BE,Running,0,10,0
p3,16000,32768,2,1000,,LS,Running,0,10,0
p4,1000,2048,0,0,,BE,Running,0,10,0
"""


def run(*cmd: str | Path, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env
    )


def test_the_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 15


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script: Path) -> None:
    done = run(sys.executable, script, "--help")
    assert done.returncode == 0, f"{script.name} --help failed:\n{done.stderr[-2000:]}"
    assert "usage:" in done.stdout


def test_each_script_states_its_command() -> None:
    """Each script's docstring (or a shell script's header) shows how it is run."""
    for path in [*SCRIPTS, *BENCH.glob("*.sh")]:
        assert f"bench/{path.name}" in path.read_text(), f"{path.name} does not state its command"


def test_the_allocation_table_runs_on_a_small_trace(tmp_path: Path) -> None:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES)
    (tmp_path / "openb_pod_list_default.csv").write_text(PODS)
    env = {**os.environ, "SEEDS": "42-43", "PYTHON": sys.executable}
    done = run("sh", BENCH / "simulate_table.sh", tmp_path, "default,fgd", "default", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["policy"] for line in lines] == ["default", "fgd"]
    assert all(line["seeds"] == [42, 43] for line in lines)
    (tmp_path / "results.jsonl").write_text(done.stdout)
    plotted = run(sys.executable, BENCH / "plot_allocation.py", tmp_path / "results.jsonl", "--out", tmp_path / "plots")
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert "| default |" in plotted.stdout
    assert (tmp_path / "plots" / "allocation_curve.png").stat().st_size > 0


@pytest.mark.containerd
def test_the_proxy_bench_runs_every_section_briefly() -> None:
    """On the node without NVML, with a baseline install (this one again), a few calls each. In the
    default TMPDIR, which the bench empties: containerd's socket paths under pytest's would be too long."""
    if (why := missing_requirements()) is not None:
        pytest.skip(why)
    args = ("--node", "cpu", "--rounds", "3", "--creates", "2", "--pods", "2", "--seconds", "0.05")
    done = run(sys.executable, BENCH / "proxy_bench.py", *args, "--baseline", sys.executable)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for section in ("Version", "CreateContainer ", "pod start (run+create+start)", "CreateContainer in pod start"):
        line = next(line for line in out.splitlines() if line.startswith(section))
        assert "| crihook " in line and "| baseline " in line, line
    assert "pod start through baseline:" in out and "crihook RSS" in out


@pytest.mark.containerd
def test_the_nri_bench_runs_every_mode_briefly(tmp_path: Path) -> None:
    """Two containerd 2.x (NRI on): straight, through `crihook serve`, with `crihook nri`; a few calls
    each; its samples pooled as two sittings."""
    if (why := missing_requirements()) is not None:
        pytest.skip(why)
    if (why := runtime("2").unavailable()) is not None:
        pytest.skip(why)
    go = shutil.which("go") or shutil.which("/usr/local/go/bin/go")
    samples = tmp_path / "sitting.json"
    args = ("--runtime", "2", "--rounds", "3", "--creates", "2", "--pods", "2", "--samples", str(samples))
    args += () if go else ("--no-go",)
    done = run(sys.executable, BENCH / "nri_bench.py", *args, timeout=900)  # the Go plugin's first build
    assert done.returncode == 0, done.stderr[-2000:]
    for section in ("Version", "CreateContainer (8 GPUs)", "pod start (run+create+start)"):
        calibration, measured, *floor = [line for line in done.stdout.splitlines() if line.startswith(section)]
        assert calibration.split("]: ")[1].startswith("A p50") and "| B p50" in calibration, calibration
        assert "| proxy p50" in measured and "| nri p50" in measured, measured
        if go:  # the A/A line has the Go plugin's containerd too; then crihook beside the Go plugin
            assert "| C p50" in calibration and "| go p50" in measured, (calibration, measured)
            assert "added p50 crihook nri" in floor[0] and "Go plugin" in floor[0], floor
            assert "nri over go" in floor[0], floor
    assert "resident memory: crihook nri" in done.stdout
    if go:
        pooled = run(sys.executable, BENCH / "nri_bench.py", "--pool", str(samples), str(samples))
        assert pooled.returncode == 0, pooled.stderr[-2000:]
        assert pooled.stdout.startswith("2 sittings pooled"), pooled.stdout
        (line,) = [ln for ln in pooled.stdout.splitlines() if ln.startswith("pod start (run+create+start): added")]
        assert "nri over go" in line and "less A/A" in line, line
    alone = run(sys.executable, BENCH / "nri_bench.py", "--handler-only", "--creates", "5")
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "crihook nri handler in this process, CreateContainer with 8 GPUs [n=5]" in alone.stdout


def test_the_pre_registered_start_bench_registers_and_configures() -> None:
    done = run(sys.executable, BENCH / "nri_prestart.py", "--runs", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("run 0: registered ")]
    assert "configured" in line
