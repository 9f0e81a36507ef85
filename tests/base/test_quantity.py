"""Kubernetes quantity parsing: the syntax Kubernetes accepts, exact values, and clean rejection."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base import quantity
from crihook.base.quantity import MAX_INT64, QuantityError


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("100", 100),
        ("+7", 7),
        ("-7", -7),
        ("1Ki", 1024),
        ("23034Mi", 23034 * 2**20),
        ("1.5Gi", 3 * 2**29),
        ("16Gi", 16 * 2**30),
        ("2Ti", 2 * 2**40),
        ("1Pi", 2**50),
        ("7Ei", 7 * 2**60),
        ("500m", Decimal("0.5")),
        ("250u", Decimal("0.00025")),
        ("3n", Decimal("3e-9")),
        ("1k", 1000),
        ("2M", 2_000_000),
        ("3G", 3 * 10**9),
        ("4T", 4 * 10**12),
        ("5P", 5 * 10**15),
        ("1E", 10**18),  # exa, not an exponent
        ("1e3", 1000),
        ("1E3", 1000),
        ("2e+2", 200),
        ("5e-1", Decimal("0.5")),
        ("1.", 1),
        (".5", Decimal("0.5")),
        ("0.5Ki", 512),
        ("9223372036854775807", MAX_INT64),
    ],
)
def test_string_syntax(text: str, value: int | Decimal) -> None:
    assert quantity.parse(text) == value


@pytest.mark.parametrize(("number", "value"), [(0, 0), (100, 100), (1.5, Decimal("1.5")), (1e3, 1000)])
def test_json_numbers(number: float, value: int | Decimal) -> None:
    assert quantity.parse(number) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        " 1",
        "1 ",
        "1\n",
        "Mi",
        "1K",  # Kubernetes' kilo is lower-case only
        "1mi",
        "1KiB",
        "1e",
        "1e1Ki",
        "1.2.3",
        "0x10",
        "1_000",
        "\u0661\u0660",  # Arabic-Indic digits: Decimal would take them, Kubernetes does not
        "--1",
        "1e1000",
        "9223372036854775808",
        "8Ei",
        "1" * 65,
        "nan",
        "inf",
    ],
)
def test_rejected_strings(text: str) -> None:
    with pytest.raises(QuantityError):
        quantity.parse(text)


@pytest.mark.parametrize("value", [True, False, None, [1], {"a": 1}, float("nan"), float("inf"), -float("inf"), 2**63])
def test_rejected_values(value: object) -> None:
    with pytest.raises(QuantityError):
        quantity.parse(value)


def test_error_names_the_value() -> None:
    with pytest.raises(QuantityError, match="'12XB' is not a Kubernetes quantity"):
        quantity.parse("12XB")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("500m", 1),
        ("1m", 1),
        ("0", 0),
        ("1.5", 2),
        ("1e-9", 1),
        ("-1.5", -1),
        ("100", 100),
        # one unit past an integer stays past it however many digits it takes
        ("1.0000000000000000000000000000000001Ki", 1025),
        ("4611686018427387903.5", 4611686018427387904),
    ],
)
def test_to_int_rounds_up(value: str, expected: int) -> None:
    assert quantity.to_int(value) == expected


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (1, "1"),
        (1023, "1023"),
        (1024, "1Ki"),
        (1536, "1536"),
        (23034 * 2**20, "23034Mi"),
        (16 * 2**30, "16Gi"),
        (2**60, "1Ei"),
        (3 * 2**61, "6Ei"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert quantity.format_bytes(n) == text


def test_format_bytes_rejects_negative() -> None:
    with pytest.raises(QuantityError, match="negative"):
        quantity.format_bytes(-1)


@given(st.integers(min_value=0, max_value=MAX_INT64))
def test_format_bytes_round_trips(n: int) -> None:
    text = quantity.format_bytes(n)
    assert quantity.to_int(text) == n
    assert quantity.parse(text) == n


@given(st.integers(min_value=-MAX_INT64, max_value=MAX_INT64))
def test_integers_are_exact(n: int) -> None:
    assert quantity.parse(n) == n
    assert quantity.parse(str(n)) == n
    assert quantity.to_int(str(n)) == n


@given(st.text(max_size=80))
def test_any_text_parses_or_raises_quantity_error(text: str) -> None:
    try:
        value = quantity.parse(text)
    except QuantityError:
        return
    assert abs(value) <= MAX_INT64
    assert isinstance(quantity.to_int(text), int)


@given(
    st.integers(min_value=0, max_value=10**6),
    st.sampled_from(["", "Ki", "Mi", "Gi", "k", "M", "G", "m"]),
)
def test_suffix_scales(n: int, suffix: str) -> None:
    scale = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9, "m": Decimal("0.001")}
    assert quantity.parse(f"{n}{suffix}") == n * scale[suffix]
