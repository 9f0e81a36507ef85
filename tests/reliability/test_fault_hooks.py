"""Hooks that misbehave, inside the real daemon: one that raises, one that hangs past its timeout, one
that returns something other than an Edit. A `fail` hook fails only the call it misbehaved on, with
an error naming the hook, pod, container and cause; an `ignore` hook is logged and the call goes on;
and nothing else the daemon serves waits for either.
"""

from __future__ import annotations

import contextlib
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from crihook.node.storefile import read_file
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, container_config, pod_config
from tests.support.daemon import Crihook, install_hook_package, running_crihook

pytestmark = pytest.mark.containerd

HANG_SECONDS = 3.0  # how long a hanging hook sleeps; its timeout is far shorter
TIMEOUT_MS = 400

# One source, installed under two names: the entry-point name picks the config table (and so the
# policy); each hook misbehaves as the container annotation named after it says.
FAULTY_HOOK = textwrap.dedent(
    f"""
    import time
    from dataclasses import dataclass

    from crihook.base.config import NodeConfig
    from crihook.hooks.base import Edit, Stage

    NAME = __name__.removeprefix("crihook_test_")

    @dataclass(frozen=True)
    class FaultyOptions:
        entered_file: str = ""

    class Faulty:
        name = NAME
        stages = frozenset({{Stage.PRE_CREATE_CONTAINER}})
        priority = 50

        def __init__(self, options: FaultyOptions) -> None:
            self.entered = options.entered_file

        def handle(self, ctx):
            mode = ctx.container.annotations.get("crihook.test/" + NAME, "ok")
            if self.entered:
                with open(self.entered, "a") as f:
                    f.write(mode + "\\n")
            if mode == "raise":
                raise RuntimeError("boom from " + NAME)
            if mode == "hang":
                time.sleep({HANG_SECONDS})
            if mode == "garbage":
                return {{"env": {{"NOT": "an edit"}}}}
            return Edit(env={{"RAN_" + NAME.upper(): "1"}})

    def factory(options: FaultyOptions, node: NodeConfig) -> Faulty:
        return Faulty(options)
    """
)

EXPECTED = {
    "raise": (grpc.StatusCode.INTERNAL, "RuntimeError: boom from faultfail"),
    "hang": (grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out after {TIMEOUT_MS} ms"),
    "garbage": (grpc.StatusCode.INTERNAL, "TypeError: returned dict, not an Edit or None"),
}


@pytest.fixture
def faulty(containerd: Containerd, tmp_path: Path) -> Iterator[Crihook]:
    site = tmp_path / "site"
    env = install_hook_package(site, "faultfail", FAULTY_HOOK)
    install_hook_package(site, "faultignore", FAULTY_HOOK)
    entered = tmp_path / "entered"
    config = (
        f'[hooks.faultfail]\nfailure_policy = "fail"\ntimeout_ms = {TIMEOUT_MS}\nentered_file = "{entered}"\n'
        f'[hooks.faultignore]\nfailure_policy = "ignore"\ntimeout_ms = {TIMEOUT_MS}\n'
    )
    with running_crihook(containerd.address, tmp_path / "crihook", config, env) as proxy:
        yield proxy


@pytest.fixture
def client(faulty: Crihook) -> Iterator[Cri]:
    with Cri(faulty.address) as c:
        yield c
        c.remove_all()


def _store_records(proxy: Crihook, container_id: str) -> list[dict[str, object]]:
    deadline = time.monotonic() + 5
    while True:
        body = read_file(proxy.state_dir / "store.json")
        found = [c["hooks"] for c in body["containers"] if c["id"] == container_id]
        if found or time.monotonic() > deadline:
            return found[0] if found else []
        time.sleep(0.05)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_fail_policy_fails_only_that_call(client: Cri, containerd_cri: Cri, mode: str) -> None:
    pod = pod_config(f"fail-{mode}")
    pod_id = client.run_pod(pod)
    bad = container_config("bad", pod, annotations={"crihook.test/faultfail": mode})
    with pytest.raises(CriError) as err:
        client.create_container(pod_id, bad, pod)
    code, reason = EXPECTED[mode]
    assert err.value.code == code
    assert f"hook faultfail: pod default/fail-{mode} container bad: {reason}" in err.value.details
    assert containerd_cri.list_containers(pod_id) == []  # nothing reached containerd
    # the same pod's next container, and the daemon, are unaffected
    with client.container(pod_id, container_config("good", pod), pod) as cid:
        env = client.output(cid, "env").split()
        assert "RAN_FAULTFAIL=1" in env and "RAN_FAULTIGNORE=1" in env


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_ignore_policy_logs_and_goes_on(faulty: Crihook, client: Cri, mode: str) -> None:
    pod = pod_config(f"ignore-{mode}")
    with client.pod(pod) as pod_id:
        config = container_config("main", pod, annotations={"crihook.test/faultignore": mode})
        with client.container(pod_id, config, pod) as cid:
            env = client.output(cid, "env").split()
            assert "RAN_FAULTFAIL=1" in env  # the other hook's edit still applies
            assert "RAN_FAULTIGNORE=1" not in env
            records = {r["hook"]: r for r in _store_records(faulty, cid)}
            assert records["faultignore"]["result"] == "ignored-error"
            assert EXPECTED[mode][1].replace("faultfail", "faultignore") in str(records["faultignore"]["detail"])
    line = next(x for x in faulty.log_text().splitlines() if "hook error ignored" in x and f"ignore-{mode}" in x)
    assert "hook=faultignore" in line and "reason=" in line


def test_hanging_hook_stalls_no_other_call(faulty: Crihook, client: Cri, tmp_path: Path) -> None:
    """While one CreateContainer waits on a hanging hook, Version and a whole other pod's lifecycle
    are answered; the hanging call fails at its hook's timeout."""
    pod = pod_config("hangs")
    pod_id = client.run_pod(pod)
    hung: list[BaseException] = []

    def create_hanging() -> None:
        with pytest.raises(CriError) as err:
            client.create_container(
                pod_id, container_config("slow", pod, annotations={"crihook.test/faultfail": "hang"}), pod
            )
        hung.append(err.value)

    worker = threading.Thread(target=create_hanging)
    worker.start()
    entered = tmp_path / "entered"
    deadline = time.monotonic() + 10
    while "hang" not in (entered.read_text() if entered.exists() else ""):
        assert time.monotonic() < deadline, "the hook never started"
        time.sleep(0.005)
    latencies = []
    with Cri(faulty.address) as other:
        for _ in range(20):
            started = time.perf_counter()
            other.version()
            latencies.append(time.perf_counter() - started)
        answered_during_hang = worker.is_alive()
    worker.join(30)
    print(f"\nVersion during a hanging hook: max {max(latencies) * 1000:.1f} ms over {len(latencies)} calls")
    assert answered_during_hang, "Version waited for the hanging hook"
    (err,) = hung
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
    other_pod = pod_config("meanwhile")
    with client.pod(other_pod) as other_id, client.container(other_id, container_config("c", other_pod), other_pod):
        pass


def test_many_hanging_hooks_do_not_starve_healthy_pods(faulty: Crihook, client: Cri, tmp_path: Path) -> None:
    """More hanging calls than the daemon has hook worker threads: a healthy pod created meanwhile
    must still get its hooks run (a plain-function hook runs in a thread, and a thread that hangs is
    not freed by its timeout)."""
    pod = pod_config("many-hangs")
    pod_id = client.run_pod(pod)

    def create_hanging(i: int) -> None:
        config = container_config(f"slow{i}", pod, annotations={"crihook.test/faultignore": "hang"})
        with contextlib.suppress(CriError):  # what these calls get is not the point here
            client.create_container(pod_id, config, pod)

    hanging = [threading.Thread(target=create_hanging, args=(i,)) for i in range(12)]
    for t in hanging:
        t.start()
    time.sleep(0.2)
    healthy = pod_config("healthy")
    try:
        with client.pod(healthy) as hid, client.container(hid, container_config("main", healthy), healthy) as cid:
            assert "RAN_FAULTFAIL=1" in client.output(cid, "env").split()
    finally:
        for t in hanging:
            t.join(60)
