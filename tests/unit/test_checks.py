"""The one check of "an int, not a bool, within bounds" and its number and flag siblings
(``tierkv.checks``), and the settings declared with them (``tierkv.settings``)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from tierkv.checks import check_flag, check_int, is_int, is_number
from tierkv.errors import ConfigError
from tierkv.settings import INVALID, check_settings, declared, derived, setting


class _Level(enum.IntEnum):
    HIGH = 3


@pytest.mark.parametrize("value", [0, 1, -7, 1 << 70, _Level.HIGH])
def test_is_int_takes_ints_and_int_subclasses(value: object) -> None:
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, float("nan"), "3", b"3",
                                   None, Decimal(3), Fraction(3), np.int64(3), [3]])
def test_is_int_refuses_bools_and_what_is_not_an_int(value: object) -> None:
    """A bool is an int to Python but never a count to tierkv; numpy ints, floats with a
    whole value and numeric strings are refused too (the checks it replaced did the same)."""
    assert not is_int(value)


def test_bounds_are_inclusive_and_each_optional() -> None:
    assert is_int(1, low=1) and not is_int(0, low=1) and is_int(-5, high=-5)
    assert is_int(65535, 1, 65535) and not is_int(65536, 1, 65535)
    assert not is_int(True, low=0)  # a bool within the bounds is still no int


@pytest.mark.parametrize("value", [0, 0.5, 1, -2.5, math.inf, _Level.HIGH])
def test_is_number_takes_ints_and_floats(value: object) -> None:
    assert is_number(value)


@pytest.mark.parametrize("value", [True, math.nan, "1", None, Decimal(1), np.float32(1)])
def test_is_number_refuses_bools_nan_and_what_is_not_a_number(value: object) -> None:
    """NaN compares false with every bound: were it taken, no bound would hold it."""
    assert not is_number(value) and not is_number(value, low=0, high=1)


def test_number_bounds_and_the_exclusive_one() -> None:
    assert is_number(0.0, low=0) and not is_number(0.0, above=0) and is_number(1e-9, above=0)
    assert is_number(1.0, 0.0, 1.0) and not is_number(1.01, 0.0, 1.0)


def test_the_checks_name_what_they_check_and_the_value() -> None:
    assert check_int("disk tier: replica", 0, low=0) == 0
    for call, message in [
        (lambda: check_int("disk tier: replica", -1, low=0),
         "disk tier: replica must be an int >= 0, got -1"),
        (lambda: check_int("store: tp_size", True, 1, 65535),
         "store: tp_size must be an int in [1, 65535], got True"),
        (lambda: check_int("part: index", "0"), "part: index must be an int, got '0'"),
        (lambda: check_flag("disk.direct_io", 1), "disk.direct_io must be true or false, got 1"),
    ]:
        with pytest.raises(ConfigError) as raised:
            call()
        assert str(raised.value) == message


def test_a_check_raises_the_error_it_is_given() -> None:
    with pytest.raises(ValueError, match="^line 3: flag must be true or false, got 'yes'$"):
        check_flag("line 3: flag", "yes", error=ValueError)


@dataclass(frozen=True)
class _Config:
    count: int = setting(4, low=1, help="how many")
    size: int = setting(1024, unit="bytes")
    wait: float | None = setting(None, kind="number", above=0)
    mode: str = setting("a", choices=("a", "b"))
    on: bool = setting(True)

    def __post_init__(self) -> None:
        check_settings(self, "demo")


@dataclass(frozen=True)
class _Renamed:
    how_many: int = derived(_Config, "count", help="renamed")
    mode: str = derived(_Config, "mode", default="b")


def test_declared_settings_are_checked_and_sizes_become_ints() -> None:
    assert _Config(size="2KiB").size == 2048  # type: ignore[arg-type]
    specs = declared(_Config)
    assert [spec.kind for spec in specs.values()] == ["int", "size", "number", "choice", "flag"]
    assert specs["wait"].optional and specs["size"].need() == \
        "an int >= 1 (bytes) or a size such as '32GiB' or '32G'"
    for name, bad in [("count", 0), ("size", "2 parsecs"), ("wait", 0), ("mode", "c"),
                      ("on", "yes"), ("count", None)]:
        with pytest.raises(ConfigError, match=rf"^demo\.{name} must be .*, got {bad!r}$"):
            _Config(**{name: bad})


def test_a_derived_setting_is_the_source_under_another_name() -> None:
    renamed, source = declared(_Renamed), declared(_Config)
    assert renamed["how_many"].source == "_Config.count"
    assert (renamed["how_many"].kind, renamed["how_many"].low) == ("int", 1)
    assert renamed["how_many"].help == "how many; renamed"
    assert _Renamed().how_many == 4 and _Renamed().mode == "b"  # the source's default, or its own
    assert renamed["mode"].choices == source["mode"].choices
    assert renamed["how_many"].accept(0) is INVALID and renamed["how_many"].accept(3) == 3
    assert renamed["how_many"].need() == source["count"].need() == "an int >= 1"
    assert source["wait"].need(none="null") == "a number > 0 or null"


def test_a_declaration_of_an_unknown_kind_is_refused() -> None:
    bad: Any = {"kind": "colour"}
    with pytest.raises(TypeError, match="kind must be one of"):
        setting("red", **bad)
