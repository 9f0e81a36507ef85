"""crihook inspect: finding a pod or container in the proxy's store file by the names operators
have at hand, and showing what the hooks did."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook import cli
from crihook.cli.inspect import find, render
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store

ALLOCATED = '{"gpu":[{"minor":3,"id":"GPU-5e1b","resources":{"koordinator.sh/gpu-core":"100"}}]}'


def pod(pid: str, name: str, ns: str = "default", uid: str = "", **kw) -> PodRecord:
    return PodRecord(pid, name, ns, uid or f"uid-{pid[:4]}", **kw)


def ctr(cid: str, pod_id: str, name: str, **kw) -> ContainerRecord:
    return ContainerRecord(cid, pod_id, name, **kw)


GPU_HOOK = {
    "hook": "gpu",
    "stage": "PreCreateContainer",
    "result": "ok",
    "ms": 1.234,
    "detail": {"NVIDIA_VISIBLE_DEVICES": "GPU-5e1b", "devices": ["/dev/nvidia3", "/dev/nvidiactl"]},
}


def body() -> dict:
    pods = [
        pod(
            "aaaa1111" * 8,
            "train",
            uid="uid-train",
            annotations={"scheduling.koordinator.sh/device-allocated": ALLOCATED, "kubectl.kubernetes.io/x": "noise"},
            labels={"app": "train"},
            created=1700000000.0,
        ),
        pod("bbbb2222" * 8, "web", ns="shop"),
        pod("cccc3333" * 8, "web", ns="blog"),
        # kubelet recreated train's sandbox: the old one is not ready, the new one is attempt 1
        pod("dddd4444" * 8, "train", attempt=1, uid="uid-train", annotations={"gpu.crihook.io/x": "1"}),
    ]
    pods[0].state = "notready"
    containers = [
        ctr("1111aaaa" * 8, "dddd4444" * 8, "main", hooks=[GPU_HOOK], state="running"),
        ctr("2222bbbb" * 8, "dddd4444" * 8, "sidecar"),
        ctr("3333cccc" * 8, "bbbb2222" * 8, "nginx"),
        ctr("4444dddd" * 8, "cccc3333" * 8, "nginx"),
        ctr("5555eeee" * 8, "bbbb2222" * 8, "lonely", attempt=0),
        ctr("6666ffff" * 8, "bbbb2222" * 8, "lonely", attempt=1),
    ]
    return {"pods": [asdict(p) for p in pods], "containers": [asdict(c) for c in containers]}


@pytest.mark.parametrize(
    ("query", "pod_id", "container_ids"),
    [
        ("dddd4444" * 8, "dddd4444" * 8, ["1111aaaa" * 8, "2222bbbb" * 8]),  # full sandbox id
        ("aaaa1111" * 8, "aaaa1111" * 8, []),  # the old sandbox, asked for by id
        ("uid-train", "dddd4444" * 8, ["1111aaaa" * 8, "2222bbbb" * 8]),  # uid: the sandbox that counts
        ("default/train", "dddd4444" * 8, ["1111aaaa" * 8, "2222bbbb" * 8]),
        ("train", "dddd4444" * 8, ["1111aaaa" * 8, "2222bbbb" * 8]),  # bare name, unique pod
        ("shop/web", "bbbb2222" * 8, ["3333cccc" * 8, "5555eeee" * 8, "6666ffff" * 8]),
        ("cccc3", "cccc3333" * 8, ["4444dddd" * 8]),  # id prefix, as crictl prints it
        ("default/train/main", "dddd4444" * 8, ["1111aaaa" * 8]),
        ("blog/web/nginx", "cccc3333" * 8, ["4444dddd" * 8]),
        ("sidecar", "dddd4444" * 8, ["2222bbbb" * 8]),  # bare container name, unique
        ("lonely", "bbbb2222" * 8, ["6666ffff" * 8]),  # restarted container: the latest attempt
        ("1111a", "dddd4444" * 8, ["1111aaaa" * 8]),
    ],
)
def test_find(query: str, pod_id: str, container_ids: list[str]) -> None:
    match = find(body(), query)
    assert match.pod["id"] == pod_id
    assert [c["id"] for c in match.containers] == container_ids


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("web", "'web' names more than one thing: blog/web, shop/web; say which"),
        ("nginx", "'nginx' names more than one thing: blog/web/nginx, shop/web/nginx"),
        ("abc", "no record of a pod or container 'abc'"),  # prefixes under 4 characters match nothing
        ("default/nothere", "no record"),
        ("a/b/c/d", "no record"),
    ],
)
def test_find_refuses(query: str, message: str) -> None:
    with pytest.raises(LookupError, match=message):
        find(body(), query)


ids = st.text("0123456789abcdef", min_size=8, max_size=8)


@given(st.lists(st.tuples(ids, ids), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_every_recorded_id_finds_itself(pairs: list[tuple[str, str]]) -> None:
    pods = [asdict(pod("p" + pid, f"pod{i}")) for i, (pid, _) in enumerate(pairs)]
    containers = [asdict(ctr("c" + cid + str(i), "p" + pid, f"c{i}")) for i, (pid, cid) in enumerate(pairs)]
    b = {"pods": pods, "containers": containers}
    for c in containers:
        m = find(b, c["id"])
        assert m.container_only and [x["id"] for x in m.containers] == [c["id"]] and m.pod["id"] == c["pod_id"]
    for p in pods:
        m = find(b, p["id"])
        assert m.pod["id"] == p["id"] and all(c["pod_id"] == p["id"] for c in m.containers)


def test_render_pod_and_container() -> None:
    text = render(find(body(), "default/train"))
    first = text.splitlines()[0]
    assert first.startswith("pod default/train  uid uid-train  sandbox dddd4444dddd4  state ready")
    assert "annotation gpu.crihook.io/x = 1" in text
    assert "kubectl.kubernetes.io" not in text and "label app" not in text
    assert "  container main  id 1111aaaa1111a  attempt 0  state running" in text
    assert "    PreCreateContainer  gpu: ok (1.2 ms)\n" in text
    assert "        NVIDIA_VISIBLE_DEVICES: GPU-5e1b\n" in text
    assert '        devices: ["/dev/nvidia3", "/dev/nvidiactl"]\n' in text
    assert "  container sidecar" in text and "    no hook ran" in text

    old = render(find(body(), "aaaa1111"))
    assert f"annotation scheduling.koordinator.sh/device-allocated = {ALLOCATED}" in old
    assert "since 2023-11-1" in old and "no containers recorded" in old

    one = render(find(body(), "default/train/main"))
    assert "container sidecar" not in one and "pod hooks" not in one


def save(state: Path, b: dict) -> None:
    store = Store(state)
    store.pods = {p["id"]: PodRecord(**p) for p in b["pods"]}
    store.containers = {c["id"]: ContainerRecord(**c) for c in b["containers"]}
    store.save()


def test_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    assert cli.main(["inspect", "train", "--state-dir", str(state)]) == 1
    assert f"no store at {state}/store.json" in capsys.readouterr().err

    save(state, body())
    assert cli.main(["inspect", "default/train/main", "--state-dir", str(state)]) == 0
    assert "gpu: ok" in capsys.readouterr().out
    assert cli.main(["inspect", "web", "--state-dir", str(state)]) == 1
    assert "say which" in capsys.readouterr().err
    assert cli.main(["inspect", "1111a", "--state-dir", str(state), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["containers"][0]["hooks"] == [GPU_HOOK] and doc["pod"]["name"] == "train"

    config = tmp_path / "config.toml"
    config.write_text(f'[proxy]\nstate_dir = "{state}"\n')
    assert cli.main(["inspect", "sidecar", "--config", str(config)]) == 0
    capsys.readouterr()

    (state / "store.json").write_text("{")
    assert cli.main(["inspect", "train", "--state-dir", str(state)]) == 1
    assert "not a crihook store file" in capsys.readouterr().err
    config.write_text("[proxy]\nstate_dir = 1\n")
    assert cli.main(["inspect", "train", "--config", str(config)]) == 2
    assert "state_dir: expected str" in capsys.readouterr().err
