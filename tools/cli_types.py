"""argparse types the `tidal` commands share."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers, at least one (`0,1`)."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    return values


def count(text: str) -> int:
    """An argparse type: an integer >= 1 (runs, trials, steps, puts in flight)."""
    return _integer(text, at_least=1)


def whole(text: str) -> int:
    """An argparse type: an integer >= 0 (0: no limit, where the option says so)."""
    return _integer(text, at_least=0)


def _integer(text: str, *, at_least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = at_least - 1
    if value < at_least:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {at_least}")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers, each >= 1 (`1,4,16`)."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers >= 1")
    return values


def non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0 (milliseconds, seconds)."""
    return _number(text, lambda v: 0 <= v < float("inf"), "a number >= 0")


def share(text: str) -> float:
    """An argparse type: a fraction in [0, 1]."""
    return _number(text, lambda v: 0 <= v <= 1, "a share in [0, 1]")


def _number(text: str, ok: Callable[[float], bool], what: str) -> float:
    """`text` as a float that passes `ok`, else argparse's error saying it is not `what`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
