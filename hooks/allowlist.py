"""The host paths hooks may hand a container as devices and mounts, whoever the hook: the chain
checks every edit against it before applying it."""

from __future__ import annotations

import fnmatch
import os.path
from collections.abc import Iterable

from crihook.hooks.base import Edit

ALLOWLIST_MEMO = 4096  # host paths whose verdict is kept (cleared when full: paths from a hook server vary)


class Allowlist:
    """Host paths hooks may expose to containers. Patterns are fnmatch globs on normalised paths,
    so `..` can not walk out of an allowed directory."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(os.path.normpath(p) for p in patterns)
        # host path -> allowed: a node's hooks add the same few device nodes and mounts to every
        # container, and matching each against every pattern costs a tenth of a CreateContainer
        self._verdicts: dict[str, bool] = {}

    def allows(self, host: str) -> bool:
        verdict = self._verdicts.get(host)
        if verdict is None:
            norm = os.path.normpath(host)
            verdict = os.path.isabs(host) and any(fnmatch.fnmatchcase(norm, p) for p in self.patterns)
            if len(self._verdicts) >= ALLOWLIST_MEMO:
                self._verdicts.clear()
            self._verdicts[host] = verdict
        return verdict

    def check(self, edit: Edit) -> str | None:
        """The first host path the edit adds that is not allowed, or None."""
        for host in [d.host_path for d in edit.add_devices] + [m.host_path for m in edit.add_mounts]:
            if not self.allows(host):
                return host
        return None
