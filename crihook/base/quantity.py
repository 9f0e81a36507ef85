"""Kubernetes resource quantities ("23034Mi", "1.5Gi", "500m", "1e3", 100) as exact numbers.

Annotations written by Koordinator carry quantities as strings or JSON numbers; both the node side
and the scheduler read them here so they agree to the byte.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Context, Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_RE = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d{1,3})|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?\Z", re.ASCII)
MAX_INT64 = 2**63 - 1
MAX_TEXT = 64  # longer strings are not quantities anyone writes
# Exact arithmetic: 64 digits times a suffix of at most 19 digits never needs rounding, so a value
# one unit past a boundary stays past it (the default 28-digit context would round it back).
_EXACT = Context(prec=100, Emax=10_000, Emin=-10_000)


class QuantityError(ValueError):
    pass


def parse(value: object) -> Decimal:
    """Exact value of a quantity given as a string, int or float (JSON numbers)."""
    if isinstance(value, bool):
        raise QuantityError(f"expected a quantity, got boolean {value!r}")
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(f"expected a finite quantity, got {value!r}")
        number = Decimal(repr(value))
    elif isinstance(value, str):
        # Kubernetes accepts no surrounding white space, so neither do we.
        m = _RE.match(value) if len(value) <= MAX_TEXT else None
        if m is None:
            raise QuantityError(f"{value[:MAX_TEXT]!r} is not a Kubernetes quantity")
        digits, exponent, suffix = m.groups()
        try:
            number = Decimal(digits)
            if exponent:
                number = number.scaleb(int(exponent[1:]), _EXACT)
            elif suffix:
                number = _EXACT.multiply(number, _BINARY.get(suffix) or _DECIMAL[suffix])
        except InvalidOperation:
            raise QuantityError(f"{value!r} is not a Kubernetes quantity") from None
    else:
        raise QuantityError(f"expected a quantity (string or number), got {type(value).__name__}")
    if abs(number) > MAX_INT64:
        raise QuantityError(f"{value!r} is out of range")
    return number


def to_int(value: object) -> int:
    """Integer value rounded up, as Kubernetes' Quantity.Value() does."""
    return int(parse(value).to_integral_value(rounding=ROUND_CEILING, context=_EXACT))


def format_bytes(n: int) -> str:
    """Canonical form of a byte count: the largest binary suffix that divides it exactly."""
    if n < 0:
        raise QuantityError(f"negative byte count {n}")
    for suffix, factor in reversed(_BINARY.items()):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)
