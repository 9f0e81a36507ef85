"""Fixtures shared across test areas. Helpers live in their own modules (containerd.py, cri.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from tests.support.containerd import RUNTIMES, Containerd, missing_requirements, running_containerd, runtime
from tests.support.daemon import Crihook, running_crihook
from tests.support.fakenvml import fake_nvml  # noqa: F401  (the fake NVML library fixture, for every test area)

if TYPE_CHECKING:
    from tests.support.cri import Cri

# Property and fuzz tests run hypothesis' default example count in the normal suite, without its
# per-example deadline: that is a timing test in disguise, and on a loaded 2-core machine it failed
# examples that pass alone. bench/fuzz.py selects "fuzz" (CRIHOOK_HYPOTHESIS_PROFILE=fuzz, or pytest
# --hypothesis-profile=fuzz) for the long run.
_UNTIMED = [HealthCheck.too_slow]
settings.register_profile("suite", deadline=None, suppress_health_check=_UNTIMED)
settings.register_profile(
    "fuzz", max_examples=10_000, deadline=None, suppress_health_check=[*_UNTIMED, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("CRIHOOK_HYPOTHESIS_PROFILE", "suite"))


# The containerd releases a test using the `containerd` fixture runs on, unless marked
# `@pytest.mark.runtimes(...)`.
DEFAULT_RUNTIMES = ("1.6", "2")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--containerd",
        default=",".join(RUNTIMES),
        help="comma-separated containerd releases to test against (1.6, 1.7, 2; default: all); "
        "a test runs on those of them its `runtimes` mark (default: DEFAULT_RUNTIMES) names",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "runtimes(*names): containerd releases the test runs on (1.6, 1.7, 2)")
    wanted = config.getoption("--containerd").split(",")
    for name in wanted:
        runtime(name)  # an unknown name fails here, not as silently deselected tests


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The containerd releases this run tests, with their Debian versions (sid's moves from run to run)."""
    lines = []
    for name in config.getoption("--containerd").split(","):
        rt = runtime(name)
        why = rt.unavailable()
        used = f"skipped: {why}" if why else f"{rt.package_version()} (Debian {rt.suite})"
        lines.append(f"containerd {name}: {used}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test that uses `containerd` (directly or through another fixture) by release."""
    if "containerd" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("runtimes")
    names = mark.args if mark is not None else DEFAULT_RUNTIMES
    wanted = metafunc.config.getoption("--containerd").split(",")
    chosen = [n for n in names if n in wanted]
    if not chosen:  # nothing left: still collected, and skipped saying why
        chosen = [pytest.param(names[0], marks=pytest.mark.skip(reason=f"--containerd excludes {names}"))]
    metafunc.parametrize("containerd", chosen, indirect=True, scope="session", ids=lambda n: f"containerd{n}")


@pytest.hookimpl(trylast=True)  # after pytest has grouped the tests by their session fixtures' params
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Any test using the `containerd` fixture counts as marked `containerd` (so `-m "not containerd"`
    deselects it); marked tests are skipped, with the reason, where containerd can not run. The
    cluster tests go last, still grouped by node mode: a session's cluster runs until the session
    ends, crihook's node pods listening on the host's ports, and nothing else may run beside it."""
    reason = missing_requirements()
    for item in items:
        if "containerd" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.containerd)
        if reason is not None and item.get_closest_marker("containerd") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)


@pytest.fixture(autouse=True)
def metrics_labels() -> Iterator[None]:
    """The process-wide metrics registry's labels as each test found them: a node daemon run in the
    test's process labels every series with its node, and the next test's scrape must not see it."""
    from crihook.base import metrics

    before = dict(metrics.REGISTRY.const_labels)
    yield
    metrics.REGISTRY.const_labels = before


@pytest.fixture(scope="session")
def containerd(request: pytest.FixtureRequest) -> Iterator[Containerd]:
    """One real containerd per release for the whole session (one runs at a time: pytest groups the
    tests by release), with the pause and busybox test images imported. Which release: see
    `DEFAULT_RUNTIMES` and containerd.py's docstring. Tests that restart it must leave it running."""
    rt = runtime(getattr(request, "param", "1.6"))
    reason = rt.unavailable()
    if reason is not None:
        pytest.skip(reason)
    with running_containerd(runtime=rt) as daemon:
        yield daemon


@pytest.fixture
def cdi_spec_dir(containerd: Containerd) -> Iterator[Path]:
    """The CDI spec dir of the session's containerd (1.7 and 2.x only), emptied after the test so no
    spec outlives it: a device two specs declare is refused by containerd as a conflict."""
    if not containerd.runtime.has_cdi:
        pytest.skip(f"containerd {containerd.runtime.name} has no CDI")
    yield containerd.cdi_spec_dir
    for spec in containerd.cdi_spec_dir.iterdir():
        if spec.is_dir():
            shutil.rmtree(spec)
        else:
            spec.unlink()


@pytest.fixture
def nri_socket(containerd: Containerd) -> Path:
    """The NRI socket of the session's containerd (1.7 and 2.x, NRI on). A plugin a test connects
    must be gone when it ends."""
    if not containerd.nri:
        pytest.skip(f"containerd {containerd.runtime.name} has no NRI")
    return containerd.nri_socket


@pytest.fixture
def containerd_cri(containerd: Containerd) -> Iterator[Cri]:
    """A CRI client straight to the session's containerd; every pod left over is removed afterwards
    (tasks CRI lost track of included), so each test starts from an empty runtime."""
    from tests.support.cri import Cri  # imports the generated CRI stubs: only tests that talk CRI pay for them

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
    from tests.support.cri import Cri

    with Cri(crihook_proxy.address) as client:
        yield client
        client.remove_all()
