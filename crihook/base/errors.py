"""The one shape of crihook's input errors, whatever was read (an annotation, a pod, a Device, the
kubelet checkpoint): str() names the thing, the field and the reason, so a refusal tells a user what
to fix, and callers can catch every such error as one type."""

from __future__ import annotations


class InputError(ValueError):
    def __init__(self, subject: str, where: str, reason: str) -> None:
        self.subject = subject
        self.where = where
        self.reason = reason
        super().__init__(f"{subject}: {where + ': ' if where else ''}{reason}")
