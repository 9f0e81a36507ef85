"""The `fake_nvml` fixture: the package's simulated NVML node (crihook.simnode.fakenvml), one
private copy per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crihook.simnode.fakenvml import CONFIG_ENV, FakeNvml, build, compiler, make_sys_tree, topology


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], FakeNvml]]:
    """`fake_nvml("dgx-h100")`: a private copy of that topology, made current for the library."""
    if compiler() is None:
        pytest.skip("no C compiler (gcc) to build the fake NVML library")
    library = build()

    def make(name: str) -> FakeNvml:
        root = tmp_path / f"fakenvml-{name}"
        root.mkdir()
        fake = FakeNvml(library=library, config=root / "topology.json", sys_root=root / "sys", doc=topology(name))
        fake.write()
        make_sys_tree(fake.sys_root, fake.doc)
        monkeypatch.setenv(CONFIG_ENV, str(fake.config))
        return fake

    yield make
