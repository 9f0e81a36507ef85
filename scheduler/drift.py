"""When the outlook is derived again: after its first pods, once the pools' idle GPU or the mix of
pods has moved enough since the last derivation (`Drift`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

OUTLOOK = 64  # the least pods between outlook updates, once past the first OUTLOOK
FILL = 0.125  # then an update once a pool's idle GPU moved by more than this share of it (`Drift`)
GROW = 0.125  # or once the pods since the last one are this share of the pods seen before it


@dataclass(slots=True)
class Drift:
    """When the outlook is re-derived, past its first `every` pods: once `every` pods have been seen
    since the last derivation and either the idle GPU of a pool (the whole cluster, and the GPU
    models each set of pins accepts) has moved by more than `fill` of what it was then (places run
    short and the forecast's horizon shrinks, fastest as the pool fills up) or the pods since are
    `grow` of the pods seen before it (the mix moved: its estimate settles as pods add up). On a
    steady workload that is often early and near full, rarely in between, and seldom once the
    cluster is full; fill = grow = 0 is every `every` pods."""

    every: int = OUTLOOK
    fill: float = FILL
    grow: float = GROW
    look: int = 8  # pods between looks at the pools (a sum over every GPU), once `every` have been seen
    seen: int = 0  # pods seen at the last derivation
    idle: tuple[int, ...] = ()  # GPU percent idle in each pool then

    def mark(self, seen: int, idle: Sequence[int]) -> None:
        """A derivation from `seen` pods, with `idle` GPU percent idle in each pool."""
        self.seen, self.idle = seen, tuple(idle)

    def waited(self, seen: int) -> bool:
        """Whether to look at the pools now (`due` may say yes): `every` pods have been seen since
        the last derivation, and a multiple of `look` since."""
        since = seen - self.seen
        return since >= self.every and since % self.look == 0

    def due(self, seen: int, idle: Sequence[int]) -> bool:
        """Whether the workload (`seen` pods, `idle` GPU percent in the pools `mark` was given) has
        drifted from the one of the last derivation."""
        since = seen - self.seen
        if since < self.every:
            return False
        moved = any(abs(now - then) > self.fill * then for now, then in zip(idle, self.idle, strict=True))
        return moved or since >= self.grow * self.seen
