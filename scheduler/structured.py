"""A model of Kubernetes' structured device allocator: the search kube-scheduler's DynamicResources
plugin runs on each node to allocate a pod's ResourceClaims from the ResourceSlices.

Read in kubernetes/kubernetes, staging/src/k8s.io/dynamic-resource-allocation/structured/:
- internal/stable/allocator_stable.go, `allocateOne`: claims in order, each claim's requests in
  order, each request's devices one at a time; for one device, every pool, its slices and their
  devices in published order; a device already in use is skipped, then the class's and the request's
  selectors, then `allocateDevice` (availability, constraints); the first complete solution is kept,
  depth first with backtracking. A request with `firstAvailable` tries its subrequests in order and
  keeps the first that completes the whole allocation.
- the same file, `matchAttributeConstraint`: the first device of the requests a constraint names
  (all requests when it names none; `request/subrequest` names one subrequest) fixes the attribute's
  value, a device without the attribute or with another value is refused; `lookupAttribute` finds
  `domain/name` as given or, in the driver's own domain, as `name`.
- internal/stable/pools_stable.go, `GatherPools`: per pool only the newest generation's slices; a pool
  with fewer slices than `resourceSliceCount` is incomplete, one with a device name twice invalid, and
  neither is allocated from. Pools come from a Go map there (no order); here they are sorted.
- internal/incubating/allocator_incubating.go and consumable_capacity.go (consumable capacity,
  KEP-5075, beta in 1.36): a device with `allowMultipleAllocations` is never "in use", not even
  within one claim; each allocation consumes, per capacity of the device, the request rounded up by
  the capacity's `requestPolicy` (`validRange` min and step, `validValues`), or the policy's default
  when the request names no amount, or all of it without a policy; a value over the policy's max or
  past the last valid value, or a total over the capacity, refuses the device.

Left out, as no request form here needs them: CEL (a selector is a predicate standing in for the
class's and the request's CEL), device taints, admin access, allocation mode `All`, shared counters
(partitionable devices) and the 32-result limit. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

AttrValue = str | int | bool
DeviceId = tuple[str, str, str]  # driver, pool, device


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A capacity's `requestPolicy`: `default`, `validRange` (min, max, step) or `validValues`."""

    default: int | None = None
    min: int | None = None
    max: int | None = None
    step: int | None = None
    values: tuple[int, ...] = ()  # sorted


@dataclass(frozen=True, slots=True)
class Capacity:
    value: int
    policy: RequestPolicy | None = None


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)
    capacity: Mapping[str, Capacity] = field(default_factory=dict)
    multiple: bool = False  # allowMultipleAllocations


@dataclass(frozen=True, slots=True)
class Slice:
    driver: str
    pool: str
    devices: tuple[Device, ...]
    generation: int = 0
    count: int = 1  # resourceSliceCount


Selector = Callable[[str, Device], bool]  # (driver, device) -> matches the class's and request's CEL


@dataclass(frozen=True, slots=True)
class Sub:
    """An exact request, or one subrequest of `firstAvailable`."""

    name: str
    count: int = 1
    selector: Selector | None = None
    capacity: Mapping[str, int] = field(default_factory=dict)  # capacity.requests


@dataclass(frozen=True, slots=True)
class Request:
    name: str
    exactly: Sub | None = None
    first_available: tuple[Sub, ...] = ()


@dataclass(frozen=True, slots=True)
class MatchAttribute:
    attribute: str  # fully qualified: domain/name
    requests: tuple[str, ...] = ()  # empty: every request


@dataclass(frozen=True, slots=True)
class Claim:
    requests: tuple[Request, ...]
    constraints: tuple[MatchAttribute, ...] = ()


@dataclass(frozen=True, slots=True)
class Result:
    request: str  # `request` or `request/subrequest`
    device: DeviceId
    shared: bool = False  # a multi-allocatable device: `consumed` is this allocation's share
    consumed: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class InUse:
    """What allocated claims hold: exclusive devices, and the capacity consumed on shared ones."""

    devices: set[DeviceId] = field(default_factory=set)
    consumed: dict[DeviceId, dict[str, int]] = field(default_factory=dict)


def gather_pools(slices: Sequence[Slice]) -> list[tuple[Slice, ...]]:
    """The complete, valid pools of the node's slices (newest generation only), sorted by pool."""
    pools: dict[tuple[str, str], list[Slice]] = {}
    for s in slices:
        have = pools.setdefault((s.driver, s.pool), [])
        if have and s.generation < have[0].generation:
            continue
        if have and s.generation > have[0].generation:
            have.clear()
        have.append(s)
    out = []
    for key in sorted(pools):
        got = pools[key]
        names = [d.name for s in got for d in s.devices]
        if len(got) == got[0].count and len(set(names)) == len(names):
            out.append(tuple(got))
    return out


def lookup(device: Device, driver: str, attribute: str) -> AttrValue | None:
    """`lookupAttribute`: the fully qualified name as published, else the bare name in the driver's domain."""
    if attribute in device.attributes:
        return device.attributes[attribute]
    domain, _, name = attribute.partition("/")
    return device.attributes.get(name) if domain == driver and name else None


def consumption(device: Device, driver: str, requests: Mapping[str, int]) -> dict[str, int] | None:
    """What one allocation takes of each capacity of a multi-allocatable device, or None when the
    request names a capacity the device lacks or breaks a request policy."""
    caps = {_qualified(n, driver): c for n, c in device.capacity.items()}
    wanted = {_qualified(n, driver): v for n, v in requests.items()}
    if not set(wanted) <= set(caps):
        return None
    out: dict[str, int] = {}
    for name, cap in caps.items():
        pol = cap.policy
        if name not in wanted:
            out[name] = pol.default if pol is not None and pol.default is not None else cap.value
            continue
        value = wanted[name]
        if pol is not None and pol.min is not None:
            value = max(value, pol.min)
            if pol.step:
                value = pol.min + -(-(value - pol.min) // pol.step) * pol.step
            if pol.max is not None and value > pol.max:
                return None
        elif pol is not None and pol.values:
            value = next((v for v in pol.values if v >= value), -1)
            if value < 0:
                return None
        out[name] = value
    return out


def _qualified(name: str, driver: str) -> str:
    return name if "/" in name else f"{driver}/{name}"


class _Search:
    """One Allocate call: the depth-first search of allocateOne, with its rollback."""

    def __init__(self, pools: list[tuple[Slice, ...]], claims: Sequence[Claim], in_use: InUse) -> None:
        self.candidates = [(s.driver, (s.driver, s.pool, d.name), d) for pool in pools for s in pool for d in s.devices]
        self.claims = claims
        self.in_use = in_use
        self.taking: set[DeviceId] = set()  # exclusive devices of this solution
        self.adding: dict[DeviceId, dict[str, int]] = {}  # capacity this solution consumes
        self.fixed: list[list[AttrValue | None]] = [[None] * len(c.constraints) for c in claims]
        self.counts: list[list[int]] = [[0] * len(c.constraints) for c in claims]
        self.results: list[list[Result]] = [[] for _ in claims]

    def run(self) -> list[list[Result]] | None:
        return self.results if self._claim(0) else None

    def _claim(self, ci: int) -> bool:
        return ci >= len(self.claims) or self._request(ci, 0)

    def _request(self, ci: int, ri: int) -> bool:
        claim = self.claims[ci]
        if ri >= len(claim.requests):
            return self._claim(ci + 1)
        req = claim.requests[ri]
        if req.exactly is not None:
            return self._device(ci, ri, req.name, "", req.exactly, 0)
        return any(self._device(ci, ri, req.name, sub.name, sub, 0) for sub in req.first_available)

    def _device(self, ci: int, ri: int, base: str, subname: str, sub: Sub, k: int) -> bool:
        if k >= sub.count:
            return self._request(ci, ri + 1)
        for driver, did, dev in self.candidates:
            if not dev.multiple and (did in self.in_use.devices or did in self.taking):
                continue
            if sub.selector is not None and not sub.selector(driver, dev):
                continue
            took = self._take(ci, base, subname, sub, driver, did, dev)
            if took is None:
                continue
            if self._device(ci, ri, base, subname, sub, k + 1):
                return True
            took()
        return False

    def _take(
        self, ci: int, base: str, subname: str, sub: Sub, driver: str, did: DeviceId, dev: Device
    ) -> Callable[[], None] | None:
        used: dict[str, int] = {}
        if dev.multiple:
            got = consumption(dev, driver, sub.capacity)
            if got is None:
                return None
            before = self.in_use.consumed.get(did, {})
            adding = self.adding.get(did, {})
            caps = {_qualified(n, driver): c.value for n, c in dev.capacity.items()}
            if any(before.get(n, 0) + adding.get(n, 0) + v > caps[n] for n, v in got.items()):
                return None
            used = got
        claim = self.claims[ci]
        applied: list[int] = []
        for i, con in enumerate(claim.constraints):
            if con.requests and base not in con.requests and f"{base}/{subname}" not in con.requests:
                continue
            value = lookup(dev, driver, con.attribute)
            if value is None or (self.counts[ci][i] and value != self.fixed[ci][i]):
                for j in applied:
                    self.counts[ci][j] -= 1
                return None
            if not self.counts[ci][i]:
                self.fixed[ci][i] = value
            self.counts[ci][i] += 1
            applied.append(i)
        if dev.multiple:
            adding = self.adding.setdefault(did, {})
            for n, v in used.items():
                adding[n] = adding.get(n, 0) + v
        else:
            self.taking.add(did)
        name = f"{base}/{subname}" if subname else base
        self.results[ci].append(Result(name, did, dev.multiple, used))

        def undo() -> None:
            self.results[ci].pop()
            for j in applied:
                self.counts[ci][j] -= 1
            if dev.multiple:
                adding = self.adding[did]
                for n, v in used.items():
                    adding[n] -= v
            else:
                self.taking.discard(did)

        return undo


def allocate(
    slices: Sequence[Slice], claims: Sequence[Claim], in_use: InUse | None = None
) -> list[list[Result]] | None:
    """The devices for each claim, in the allocator's first-found order, or None when the node has
    no solution."""
    return _Search(gather_pools(slices), claims, in_use or InUse()).run()


def commit(in_use: InUse, results: Sequence[Sequence[Result]]) -> None:
    """Record an allocation as held, as the allocated claims then are."""
    for claim in results:
        for r in claim:
            if r.shared:
                have = in_use.consumed.setdefault(r.device, {})
                for n, v in r.consumed.items():
                    have[n] = have.get(n, 0) + v
            else:
                in_use.devices.add(r.device)
