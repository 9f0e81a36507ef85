"""Where kubelet's command line is read from: the running kubelet's /proc entry."""

from __future__ import annotations

from pathlib import Path

from crihook.devices import kubelet


def test_kubelet_argv_from_proc_and_none_without_it(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "12").mkdir(parents=True)
    (proc / "12" / "comm").write_text("containerd\n")
    (proc / "12" / "cmdline").write_bytes(b"containerd\0")
    assert kubelet.kubelet_argv(str(proc)) is None
    (proc / "34").mkdir()
    (proc / "34" / "comm").write_text("kubelet\n")
    (proc / "34" / "cmdline").write_bytes(b"/usr/bin/kubelet\0--root-dir=/data/kubelet\0")
    assert kubelet.kubelet_argv(str(proc)) == ["/usr/bin/kubelet", "--root-dir=/data/kubelet"]
    # a proc root that is not there (a simulated node before its first process) is no kubelet
    assert kubelet.kubelet_argv(str(tmp_path / "none")) is None
