"""Fixtures shared across test areas. Helpers live in their own modules (containerd.py, cri.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from containerd import Containerd, missing_requirements, running_containerd

if TYPE_CHECKING:
    from cri import Cri


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
    """A CRI client straight to the session's containerd; every pod left over is removed afterwards,
    so each test starts from an empty runtime."""
    from cri import Cri  # imports the generated CRI stubs: only tests that talk CRI pay for them

    with Cri(containerd.address) as client:
        yield client
        client.remove_all()
