"""Properties of the pure half of the remote hooks: reading Koordinator-style answers into edits,
folding the edits of several servers, and parsing the hook-server config files."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.config import ConfigError
from crihook.hooks.base import ContainerInfo, Edit, HookContext, LinuxResources, PodInfo, Stage
from crihook.hooks.edit import apply_edit
from crihook.hooks.remote_config import Policy, parse_server_config
from crihook.hooks.remote_protocol import (
    RPCS,
    InvalidAnswer,
    merge,
    read_answer,
    request_for,
    sendable_envs,
    skips_hook_servers,
)
from crihook.proto import hookservice_v1alpha1_pb2 as pb
from tests.support.hookserver import echo

# -- strategies ------------------------------------------------------------------------------------

_NAME = st.text(st.characters(blacklist_characters="=\0", blacklist_categories=("Cs",)), min_size=1, max_size=8)
_VALUE = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=8)
# what kubelet may send: any bytes, decoded with surrogateescape, duplicate names allowed
_RAW = st.binary(max_size=6).map(lambda b: b.decode("utf-8", "surrogateescape"))
_ENVS = st.lists(st.tuples(st.one_of(_NAME, _RAW), st.one_of(_VALUE, _RAW)), max_size=6).map(tuple)
_MAP = st.dictionaries(st.sampled_from(["a", "b", "c", "io.kubernetes.x"]), st.sampled_from(["", "1", "2"]))
_INT = st.sampled_from([0, 0, 1, -5, 1024, 1 << 30])
_CPUSET = st.sampled_from(["", "", "0-3", "4"])


@st.composite
def _resources(draw: Any) -> LinuxResources:
    return LinuxResources(
        cpu_period=draw(_INT),
        cpu_quota=draw(_INT),
        cpu_shares=draw(_INT),
        memory_limit_in_bytes=draw(_INT),
        oom_score_adj=draw(_INT),
        cpuset_cpus=draw(_CPUSET),
        cpuset_mems=draw(_CPUSET),
        memory_swap_limit_in_bytes=draw(_INT),
        unified=draw(st.dictionaries(st.sampled_from(["memory.high", "io.weight"]), st.sampled_from(["", "1", "50"]))),
    )


_OPT_RESOURCES = st.one_of(st.none(), _resources())


@st.composite
def _pod(draw: Any) -> PodInfo:
    return PodInfo(
        name="p",
        namespace="ns",
        uid="u",
        attempt=draw(st.integers(0, 3)),
        labels=draw(_MAP),
        annotations=draw(_MAP),
        cgroup_parent=draw(st.sampled_from(["", "/kubepods/podu", "/other"])),
        runtime_handler=draw(st.sampled_from(["", "runc"])),
        resources=draw(_OPT_RESOURCES),
    )


@st.composite
def _container(draw: Any) -> ContainerInfo:
    return ContainerInfo(
        name="c",
        attempt=draw(st.integers(0, 3)),
        annotations=draw(_MAP),
        envs=draw(_ENVS),
        resources=draw(_OPT_RESOURCES),
    )


@st.composite
def _ctx(draw: Any) -> HookContext:
    stage = draw(st.sampled_from(sorted(RPCS)))
    container = draw(_container()) if stage.is_container else None
    return HookContext(stage, draw(_pod()), container)


def _message(r: LinuxResources) -> pb.LinuxContainerResources:
    scalars = {k: getattr(r, k) for k in LinuxResources.__slots__ if k != "unified"}
    return pb.LinuxContainerResources(**scalars, unified=r.unified)


def _create(container: ContainerInfo, pod: PodInfo | None = None) -> HookContext:
    return HookContext(Stage.PRE_CREATE_CONTAINER, pod or PodInfo(name="p", namespace="ns", uid="u"), container)


def _container_answer(envs: dict[str, str] | None = None, resources: LinuxResources | None = None) -> Any:
    answer = pb.ContainerResourceHookResponse(container_envs=envs or {})
    if resources is not None:
        answer.container_resources.CopyFrom(_message(resources))
    return answer


# -- reading answers -------------------------------------------------------------------------------


@given(_ctx())
def test_an_echoed_request_changes_nothing(ctx: HookContext) -> None:
    reading = read_answer(ctx, echo(RPCS[ctx.stage], request_for(ctx)))
    assert reading.edit.is_empty() and reading.not_applied == []


@given(_container(), st.dictionaries(_NAME, _VALUE, max_size=4))
def test_envs_are_merged_never_replaced(container: ContainerInfo, answer: dict[str, str]) -> None:
    ctx = _create(container)
    after = apply_edit(ctx, read_answer(ctx, _container_answer(envs=answer)).edit).container
    assert after is not None
    expected = {k: v for k, v in container.envs}  # last value per name, the runtime's reading
    expected.update(answer)
    assert {k: v for k, v in after.envs} == expected


@given(_container(), _resources())
def test_resources_change_only_where_the_answer_sets_a_value(container: ContainerInfo, answer: LinuxResources) -> None:
    ctx = _create(container)
    after = apply_edit(ctx, read_answer(ctx, _container_answer(resources=answer)).edit).container
    assert after is not None
    base = container.resources or LinuxResources()
    got = after.resources or LinuxResources()
    for name in LinuxResources.__slots__:
        if name == "unified":
            assert got.unified == {**base.unified, **{k: v for k, v in answer.unified.items() if v}}
        else:
            want = getattr(answer, name) or getattr(base, name)
            assert getattr(got, name) == want, name


def test_no_resources_in_the_answer_leaves_them_alone() -> None:
    container = ContainerInfo(name="c", resources=LinuxResources(cpu_shares=2))
    assert read_answer(_create(container), _container_answer()).edit.resources is None


@given(_pod(), _MAP, _MAP, st.sampled_from(["", "/kubepods/podu", "/elsewhere"]))
def test_pod_answer_merges_labels_annotations_and_nonempty_cgroup_parent(
    pod: PodInfo, labels: dict[str, str], annotations: dict[str, str], cgroup: str
) -> None:
    ctx = HookContext(Stage.PRE_RUN_POD_SANDBOX, pod)
    answer = pb.PodSandboxHookResponse(labels=labels, annotations=annotations, cgroup_parent=cgroup)
    after = apply_edit(ctx, read_answer(ctx, answer).edit).pod
    assert after.labels == {**pod.labels, **labels}
    assert after.annotations == {**pod.annotations, **annotations}
    assert after.cgroup_parent == (cgroup or pod.cgroup_parent)


@given(_pod(), _container())
def test_what_a_stage_can_not_apply_is_reported(pod: PodInfo, container: ContainerInfo) -> None:
    ctx = HookContext(Stage.PRE_UPDATE_CONTAINER_RESOURCES, pod, replace(container, envs=()))
    answer = _container_answer(envs={"NEW_ONE": "x"})
    answer.pod_cgroup_parent = pod.cgroup_parent + "/moved"
    answer.container_resources.hugepage_limits.add(page_size="2MB", limit=1 << 21)
    reading = read_answer(ctx, answer)
    assert reading.edit.is_empty()
    assert sorted(reading.not_applied) == ["envs", "hugepage_limits", "pod_cgroup_parent"]


@pytest.mark.parametrize(("name", "value"), [("", "x"), ("A=B", "x"), ("A\0", "x"), ("A", "x\0y")])
def test_unusable_env_in_an_answer_is_refused(name: str, value: str) -> None:
    with pytest.raises(InvalidAnswer, match="environment variable"):
        read_answer(_create(ContainerInfo(name="c")), _container_answer(envs={name: value}))


def test_envs_that_are_not_utf8_are_not_sent_and_hide_earlier_values() -> None:
    container = ContainerInfo(name="c", envs=(("A", "1"), ("B", "ok"), ("A", "\udcff"), ("\udcfe", "2")))
    assert sendable_envs(container) == {"B": "ok"}


# -- several servers -------------------------------------------------------------------------------


@given(_container(), st.lists(st.tuples(st.dictionaries(_NAME, _VALUE, max_size=3), _resources()), max_size=3))
def test_folded_edits_equal_the_edits_applied_in_turn(
    container: ContainerInfo, answers: list[tuple[dict[str, str], LinuxResources]]
) -> None:
    """The hook hands the chain one merged edit; it must do what the servers saw happen one by one."""
    start = _create(container)
    view = start
    total = Edit()
    for envs, resources in answers:
        edit = read_answer(view, _container_answer(envs=envs, resources=resources)).edit
        view = apply_edit(view, edit)
        merge(total, edit)
    folded = apply_edit(start, total).container
    assert folded is not None and view.container is not None
    assert dict(folded.envs) == dict(view.container.envs)
    assert (folded.resources or LinuxResources()) == (view.container.resources or LinuxResources())


@given(_MAP)
def test_only_the_exact_skip_label_skips(labels: dict[str, str]) -> None:
    pod = PodInfo(name="p", namespace="ns", uid="u", labels=labels)
    assert not skips_hook_servers(pod)
    skipping = PodInfo(
        name="p", namespace="ns", uid="u", labels={**labels, "runtimeproxy.koordinator.sh/skip-hookserver": "true"}
    )
    assert skips_hook_servers(skipping)


# -- config files ----------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "remote-endpoint": st.one_of(_JSON, st.sampled_from(["/run/a.sock", "unix:///run/a.sock", "rel.sock"])),
        "failure-policy": st.one_of(_JSON, st.sampled_from(["Fail", "Ignore", "", "fail", "Sometimes"])),
        "runtime-hooks": st.one_of(_JSON, st.lists(st.sampled_from([*(s.value for s in Stage), "Bogus"]))),
    },
)


@given(st.one_of(st.binary(max_size=40), _FIELDS.map(lambda d: json.dumps(d).encode())))
def test_any_file_content_gives_a_server_or_invalid_config(raw: bytes) -> None:
    try:
        server = parse_server_config("x.json", raw)
    except ConfigError as e:
        assert str(e)
    else:
        assert server.endpoint.startswith("/") and server.stages <= set(RPCS)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("Fail", Policy.FAIL),
        ("fail", Policy.FAIL),
        ("Ignore", Policy.IGNORE),
        ("", Policy.IGNORE),
        (None, Policy.IGNORE),
    ],
)
def test_failure_policy(policy: str | None, expected: Policy) -> None:
    doc: dict[str, Any] = {"remote-endpoint": "/run/koordlet/koordlet.sock", "runtime-hooks": ["PreCreateContainer"]}
    if policy is not None:
        doc["failure-policy"] = policy
    assert parse_server_config("k.json", json.dumps(doc).encode()).policy is expected


def test_koordlet_file_parses_and_hooks_without_an_rpc_are_kept_aside() -> None:
    doc = {
        "remote-endpoint": "unix:///var/run/koordlet/koordlet.sock",
        "failure-policy": "Ignore",
        "runtime-hooks": ["PreRunPodSandbox", "PreCreateContainer", "PreRemoveRunPodSandbox"],
    }
    server = parse_server_config("koordlet.json", json.dumps(doc).encode())
    assert server.endpoint == "/var/run/koordlet/koordlet.sock"
    assert server.stages == {Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER}
    assert server.ignored_hooks == ("PreRemoveRunPodSandbox",)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xff", "not UTF-8"),
        (b"{", "not valid JSON"),
        (b"[]", "must be a JSON object, not a list"),
        (b'{"failure-policy": "Fail"}', "remote-endpoint"),
        (b'{"remote-endpoint": "x.sock"}', "absolute"),
        (b'{"remote-endpoint": "/a", "failure-policy": 1}', "failure-policy"),
        (b'{"remote-endpoint": "/a", "runtime-hooks": "PreCreateContainer"}', "runtime-hooks"),
    ],
)
def test_invalid_config_names_the_field(raw: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_server_config("x.json", raw)
