"""A runtime's verbose statuses read for what only they say: a sandbox's cgroup parent, what a
container was created with; anything unreadable leaves the record as it was, never an error."""

from __future__ import annotations

import json

import pytest

from crihook.node.status import container_created_with, sandbox_cgroup_parent
from crihook.proto import runtime_v1_pb2 as cri


@pytest.mark.parametrize(
    ("info", "parent"),
    [
        # containerd 1.6/1.7 and 2.x: SandboxInfo as JSON, the PodSandboxConfig under "config"
        ({"info": json.dumps({"pid": 7, "config": {"linux": {"cgroup_parent": "/kubepods/podu"}}})}, "/kubepods/podu"),
        ({"info": json.dumps({"config": {"metadata": {"name": "x"}}})}, ""),
        ({"info": json.dumps({"config": {"linux": {"cgroup_parent": 5}}})}, ""),
        ({"info": "not json"}, ""),
        ({"info": "[1]"}, ""),
        ({}, ""),
    ],
)
def test_sandbox_cgroup_parent(info: dict[str, str], parent: str) -> None:
    assert sandbox_cgroup_parent(info) == parent


# what containerd's verbose ContainerStatus holds under info["info"]: the CRI config as Go encodes it
CREATED = {
    "sandboxID": "p1",
    "config": {
        "metadata": {"name": "main"},
        "envs": [{"key": "A", "value": "1"}, {"key": "EMPTY"}],
        "linux": {
            "resources": {
                "cpu_shares": 512,
                "memory_limit_in_bytes": 67108864,
                "cpuset_cpus": "0-1",
                "hugepage_limits": [{"page_size": "2MB", "limit": 4194304}],
                "unified": {"memory.high": "1000000"},
                "some_future_field": 1,
            }
        },
    },
}


def verbose(info: dict[str, str], resources: cri.ContainerResources | None = None) -> cri.ContainerStatusResponse:
    """A verbose ContainerStatus answer as containerd gives it."""
    status = cri.ContainerStatus(id="c1")
    if resources is not None:
        status.resources.CopyFrom(resources)
    return cri.ContainerStatusResponse(status=status, info=info)


def test_container_created_with_reads_the_config_the_runtime_got() -> None:
    envs, resources = container_created_with(verbose({"info": json.dumps(CREATED)}))
    assert envs == {"A": "1", "EMPTY": ""}
    assert resources["cpu_shares"] == 512 and resources["memory_limit_in_bytes"] == 64 << 20
    assert resources["cpuset_cpus"] == "0-1" and resources["unified"] == {"memory.high": "1000000"}
    assert "hugepage_limits" not in resources  # what the store keeps of any container


def test_container_created_with_takes_the_resources_as_they_are_now() -> None:
    now = cri.ContainerResources(linux=cri.LinuxContainerResources(cpu_shares=1024))
    envs, resources = container_created_with(verbose({"info": json.dumps(CREATED)}, now))
    assert envs == {"A": "1", "EMPTY": ""} and resources["cpu_shares"] == 1024
    assert resources["memory_limit_in_bytes"] == 0  # as the runtime reports them, not merged


@pytest.mark.parametrize(
    "info",
    [
        {},
        {"info": ""},
        {"info": "not json"},
        {"info": "[]"},
        {"info": json.dumps({"config": "a string"})},
        {"info": json.dumps({"config": {"envs": "A=1"}})},
        {"info": json.dumps({"config": {"envs": [{"value": "no key"}]}})},
        {"info": json.dumps({"config": {"linux": {"resources": {"cpu_shares": "many"}}}})},
        {"info": json.dumps({"config": {"linux": {"resources": [1]}}})},
        {"info": json.dumps({"config": {"linux": "x"}})},
    ],
)
def test_container_created_with_unreadable_parts_are_left_empty(info: dict[str, str]) -> None:
    envs, resources = container_created_with(verbose(info))
    assert envs == {} and resources == {}
