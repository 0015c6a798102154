from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The logprob of one token at one position, its vocabulary rank (>= 1) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
