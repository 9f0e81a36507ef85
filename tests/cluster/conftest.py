"""The one-node cluster (tests/support/cluster.py), once per session and node mode, and crihook
installed on it with helm as a user would (tests/support/clusterchart.py)."""

from __future__ import annotations

from collections.abc import Generator, Iterator

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed cluster test's report carries the cluster's state as it failed: in CI that output
    is all there is to go on."""
    report = yield
    if report.when == "call" and report.failed:
        args = getattr(item, "funcargs", {})
        running = next((v for v in args.values() if isinstance(v, Cluster)), None)
        if running is not None:
            report.sections.append(("cluster at the failure", running.diagnosis()))
    return report
