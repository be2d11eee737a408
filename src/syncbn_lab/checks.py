"""The one-line checks of config values that the config, the norm variants and the parallel
modes share: a positive integer, a number in an interval."""

from __future__ import annotations

from syncbn_lab.errors import ConfigError


def positive(value, key: str) -> None:
    """``key``'s value must be an int >= 1 (a bool is not a number here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value} must be a positive integer")


def in_range(
    value,
    key: str,
    low: float,
    high: float | None,
    low_allowed: bool,
    high_allowed: bool = True,
    nullable: bool = False,
) -> None:
    """``key``'s value must be a number in (low, high), each end included when allowed;
    None passes when ``nullable``."""
    if value is None and nullable:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        ok = (value > low or (low_allowed and value == low)) and (
            high is None or value < high or (high_allowed and value == high)
        )
    if not ok:
        upper = "inf)" if high is None else f"{high:g}{']' if high_allowed else ')'}"
        interval = f"{'[' if low_allowed else '('}{low:g}, {upper}"
        extra = " or null" if nullable else ""
        raise ConfigError(f"{key}={value} must be a number in {interval}{extra}")
