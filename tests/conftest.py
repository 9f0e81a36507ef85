"""Fixtures shared across test areas. Helpers live in their own modules (containerd.py, cri.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from containerd import Containerd, missing_requirements, running_containerd
from daemon import Crihook, running_crihook
from fakenvml import fake_nvml  # noqa: F401  (the fake NVML library fixture, for every test area)
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from cri import Cri

# Property and fuzz tests run hypothesis' default example count in the normal suite; bench/fuzz.sh
# selects "fuzz" (CRIHOOK_HYPOTHESIS_PROFILE=fuzz, or pytest --hypothesis-profile=fuzz) for the long run.
settings.register_profile(
    "fuzz", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
if os.environ.get("CRIHOOK_HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["CRIHOOK_HYPOTHESIS_PROFILE"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Any test using the `containerd` fixture counts as marked `containerd` (so `-m "not containerd"`
    deselects it); marked tests are skipped, with the reason, where containerd can not run."""
    reason = missing_requirements()
    for item in items:
        if "containerd" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.containerd)
        if reason is not None and item.get_closest_marker("containerd") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def containerd() -> Iterator[Containerd]:
    """One real containerd for the whole session, with the pause and busybox test images imported.
    Tests that restart it (`containerd.restart()`) must leave it running."""
    with running_containerd() as daemon:
        yield daemon


@pytest.fixture
def containerd_cri(containerd: Containerd) -> Iterator[Cri]:
    """A CRI client straight to the session's containerd; every pod left over is removed afterwards
    (tasks CRI lost track of included), so each test starts from an empty runtime."""
    from cri import Cri  # imports the generated CRI stubs: only tests that talk CRI pay for them

    with Cri(containerd.address) as client:
        yield client
        client.remove_all(delete_task=containerd.delete_task)


@pytest.fixture
def crihook_proxy(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crihook]:
    """`crihook serve` (a real daemon process) in front of the session's containerd, default config.
    For other config, use `daemon.running_crihook(containerd.address, work_dir, config=...)`."""
    with running_crihook(containerd.address, tmp_path_factory.mktemp("crihook")) as proxy:
        yield proxy


@pytest.fixture
def proxy_cri(crihook_proxy: Crihook, containerd: Containerd) -> Iterator[Cri]:
    """A CRI client that reaches containerd through crihook; pods left over are removed afterwards."""
    from cri import Cri

    with Cri(crihook_proxy.address) as client:
        yield client
        client.remove_all()
