"""argparse types the `tidal` commands share."""

from __future__ import annotations

import argparse


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
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers, each >= 1 (`1,4,16`)."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers >= 1")
    return values


def non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0 (milliseconds, seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def share(text: str) -> float:
    """An argparse type: a fraction in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in [0, 1]")
    return value
