"""What the checks read, parsed without I/O: endpoints in kubelet's spellings, kubelet's runtime
endpoint from its command line and config, release versions, containerd's CDI settings."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from crihook.base.endpoint import unix_socket_path
from crihook.devices.kubelet import flag_value
from crihook.hooks.cdi import DEFAULT_SPEC_DIRS

KUBELET_DEFAULT_ENDPOINT = "unix:///run/containerd/containerd.sock"


def socket_path(endpoint: str) -> str | None:
    """The file of a unix endpoint in any spelling kubelet's flags may use; None for other schemes."""
    return unix_socket_path(endpoint, short_form=True)


def same_endpoint(a: str, b: str) -> bool:
    """Whether two endpoints name the same socket; /var/run is a link to /run on every systemd host."""

    def norm(e: str) -> str:
        path = socket_path(e)
        if path is None:
            return e
        path = os.path.normpath(path)
        return "/run" + path[len("/var/run") :] if path == "/var/run" or path.startswith("/var/run/") else path

    return norm(a) == norm(b)


def kubelet_runtime_endpoint(argv: Sequence[str], read: Callable[[str], str]) -> tuple[str, str]:
    """(endpoint, where it came from) for a kubelet command line: the flag beats the config file,
    which beats kubelet's built-in default. `read` returns a file's text."""
    flag = flag_value(argv, "container-runtime-endpoint")
    if flag:
        return flag, "its --container-runtime-endpoint flag"
    config_file = flag_value(argv, "config")
    if config_file:
        try:
            doc = yaml.safe_load(read(config_file))
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"kubelet's config file {config_file} can not be read: {e}") from None
        endpoint = doc.get("containerRuntimeEndpoint") if isinstance(doc, dict) else None
        if isinstance(endpoint, str) and endpoint:
            return endpoint, f"containerRuntimeEndpoint in {config_file}"
    return KUBELET_DEFAULT_ENDPOINT, "kubelet's default"


def parse_version(text: str) -> tuple[int, ...]:
    """'v1.7.13' or '1.6.20~ds1' -> (1, 7, 13); () when it does not start with a number."""
    parts: list[int] = []
    for piece in text.lstrip("v").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


@dataclass(frozen=True)
class RuntimeCdi:
    """CDI as a containerd config sets it: whether it injects, and from which dirs."""

    enabled: bool
    spec_dirs: tuple[str, ...]
    where: str  # the table the keys live in, for the fix


def containerd_cdi(config: Mapping[str, Any], version: tuple[int, ...]) -> RuntimeCdi:
    """`enable_cdi` and `cdi_spec_dirs` from a parsed containerd config, with the defaults of the
    release that reads it: config version 3 (containerd 2.x) keeps them in the CRI runtime plugin,
    versions 2 and 1 in the CRI plugin; on by default from 2.0, off in 1.7, absent before."""
    layout = config.get("version", 3 if version >= (2,) else 2)  # no file: the release's own layout
    table = {3: "io.containerd.cri.v1.runtime", 2: "io.containerd.grpc.v1.cri"}.get(layout, "cri")
    cri = config.get("plugins", {}).get(table, {})
    cri = cri if isinstance(cri, Mapping) else {}
    if version[:2] < (1, 7):
        return RuntimeCdi(False, (), f'plugins."{table}"')
    enabled = cri.get("enable_cdi", version >= (2,))
    dirs = cri.get("cdi_spec_dirs", list(DEFAULT_SPEC_DIRS))
    return RuntimeCdi(enabled is True, tuple(d for d in dirs if isinstance(d, str)), f'plugins."{table}"')
