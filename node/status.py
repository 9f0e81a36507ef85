"""What a runtime's verbose PodSandboxStatus and ContainerStatus say that its lists leave out: the
config each object was created with, under the JSON of `info` (containerd 1.6, 1.7 and 2.x alike,
Go's field names, edits of any proxy included). Read at start for objects the store lacks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format

from crihook.node.resources import resources_record, resources_view
from crihook.proto import runtime_v1_pb2 as cri


def _info_key(info: Mapping[str, str], key: str) -> dict[str, Any]:
    """The object at `key` of the JSON under "info"; {} when it is not there or not readable."""
    try:
        value = json.loads(info.get("info") or "{}").get(key)
    except (ValueError, AttributeError):
        return {}
    return value if isinstance(value, dict) else {}


def _verbose_config(info: Mapping[str, str]) -> dict[str, Any]:
    """The config an object was created with, under "info"."""
    return _info_key(info, "config")


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def sandbox_cgroup_parent(info: Mapping[str, str]) -> str:
    """The cgroup parent a sandbox was created with (linux.cgroup_parent of its verbose
    PodSandboxStatus's config); "" when it is not there."""
    parent = _section(_verbose_config(info), "linux").get("cgroup_parent", "")
    return parent if isinstance(parent, str) else ""


def container_created_with(status: cri.ContainerStatusResponse) -> tuple[dict[str, str], dict[str, Any]]:
    """The envs and resources of a container crihook did not see created, for its store record,
    from its verbose ContainerStatus: the envs from the config the runtime got, the resources as
    they are now from the status's own `resources` when the runtime fills it (the config keeps
    those it was created with, not those UpdateContainerResources set). Empty for what is not there
    or not readable: a record as before, never an error."""
    config = _verbose_config(status.info)
    try:
        envs = {str(e["key"]): str(e.get("value", "")) for e in config.get("envs") or ()}
    except (AttributeError, KeyError, TypeError):
        envs = {}
    now = status.status.resources
    if status.status.HasField("resources") and now.HasField("linux"):
        return envs, resources_record(resources_view(now.linux, True))
    created = _section(config, "linux").get("resources")
    if not isinstance(created, dict):
        return envs, {}
    try:
        linux = json_format.ParseDict(created, cri.LinuxContainerResources(), ignore_unknown_fields=True)
    except json_format.ParseError:
        return envs, {}
    return envs, resources_record(resources_view(linux, True))


def runtime_spec(info: Mapping[str, str]) -> dict[str, Any]:
    """The OCI spec under "info" of a verbose ContainerStatus (containerd's runtimeSpec); {} when
    it is not there or not readable."""
    return _info_key(info, "runtimeSpec")
