"""The one-node cluster (tests/support/cluster.py), once per session and node mode, and crihook
installed on it with helm as a user would (tests/support/clusterchart.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import MODES, Cluster, missing_requirements, running_cluster
from tests.support.clusterchart import import_images, install, user_values, wait_node_plugin


@pytest.fixture(scope="session", params=MODES)
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The cluster in one node mode ("nri", "proxy"); pytest runs every test of one mode before it
    starts the other, so one cluster runs at a time."""
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    with running_cluster(request.param) as running:
        yield running


@pytest.fixture(scope="session")
def installed(cluster: Cluster) -> Cluster:
    """The cluster with both images imported and `helm install` of charts/crihook done (--wait)."""
    import_images(cluster)
    install(cluster, user_values(cluster))
    wait_node_plugin(cluster)
    return cluster
