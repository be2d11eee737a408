"""The one-line checks of config values that the config, the norm variants and the parallel
modes share: a positive integer, a whole number in an interval, a number in an interval, true
or false, one of some names, a string."""

from __future__ import annotations

import math
from collections.abc import Iterable

from omegaconf import OmegaConf

from syncbn_lab.errors import ConfigError


def _integer(value) -> bool:
    """An int that is not a bool (True is no number here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive(value, key: str) -> None:
    """``key``'s value must be an int >= 1 (a bool is not a number here)."""
    if not _integer(value) or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer")


def whole(value, key: str, low: int = 0, high: int | None = None, nullable: bool = False) -> None:
    """``key``'s value must be an int in [low, high] (high None: no upper end); None passes
    when ``nullable``."""
    if value is None and nullable:
        return
    if not _integer(value) or value < low or (high is not None and value > high):
        upper = "" if high is None else f" and at most {high}"
        extra = " (or null)" if nullable else ""
        raise ConfigError(f"{key}={value} must be an integer >= {low}{upper}{extra}")


def in_range(
    value,
    key: str,
    low: float,
    high: float | None,
    low_allowed: bool,
    high_allowed: bool = True,
    nullable: bool = False,
) -> None:
    """``key``'s value must be a finite number in (low, high), each end included when
    allowed; None passes when ``nullable``."""
    if value is None and nullable:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low or (low_allowed and value == low)) and (
            high is None or value < high or (high_allowed and value == high)
        )
    if not ok:
        upper = "inf)" if high is None else f"{high:g}{']' if high_allowed else ')'}"
        interval = f"{'[' if low_allowed else '('}{low:g}, {upper}"
        extra = " or null" if nullable else ""
        raise ConfigError(f"{key}={value} must be a number in {interval}{extra}")


def boolean(value, key: str) -> None:
    """``key``'s value must be true or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value} must be true or false")


def one_of(value, key: str, choices: Iterable[str]) -> None:
    """``key``'s value must be one of ``choices``."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{key}={value} is unknown; choose one of {', '.join(choices)}")


def text(value, key: str, nullable: bool = False) -> None:
    """``key``'s value must be a non-empty string (a number is quoted: key='5'); None passes
    when ``nullable``."""
    if value is None and nullable:
        return
    if not isinstance(value, str) or not value.strip():
        extra = " (or null)" if nullable else ""
        if isinstance(value, int | float):  # the command line read it as a number
            extra += f"; quote it: {key}='{value}'"
        raise ConfigError(f"{key}={value} must be a non-empty string{extra}")


def texts(value, key: str) -> None:
    """``key``'s value must be a list of non-empty strings."""
    if not OmegaConf.is_list(value) and not isinstance(value, list):
        raise ConfigError(f"{key}={value} must be a list of strings, e.g. {key}=[a,b]")
    for i, item in enumerate(value):
        text(item, f"{key}[{i}]")
