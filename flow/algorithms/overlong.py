"""Overlong responses (DAPO, Yu et al. 2025, section 3.4): what a response cut at the token
budget (`finish_reason` "length") does to training, chosen by `algorithm.overlong`.

- `none`: nothing; a cut response is trained on like any other (the strict verifiers
  already score it 0).
- `filter` (overlong filtering): a cut response gives no gradient: its tokens leave the
  loss mask, so they count in no aggregation's denominator either. Its reward still enters
  its group's advantage baseline.
- `penalty` (soft overlong punishment): a length-aware penalty added to the reward. With
  `max_tokens` the budget and `buffer` the last tokens before it, a response of `length`
  generated tokens gets 0 up to `max_tokens - buffer`, then down linearly to -1 at
  `max_tokens`: `(max_tokens - buffer - length) / buffer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

OVERLONG = ("none", "filter", "penalty")
"""The values of `algorithm.overlong`."""


def overlong_penalty(length: int, *, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong penalty of a response of `length` generated tokens: 0 while
    `length <= max_tokens - buffer`, then linear down to -1 at `max_tokens` (and beyond)."""
    if buffer < 1 or buffer > max_tokens:
        raise ValueError(f"buffer must be within 1..max_tokens ({max_tokens}), got {buffer}")
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return max((start - length) / buffer, -1.0)


def truncated(finish_reasons: Sequence[str | None]) -> torch.Tensor:
    """A bool per response: whether it was cut at the token budget."""
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)


def filter_truncated(loss_mask: torch.Tensor, finish_reasons: Sequence[str | None]) -> torch.Tensor:
    """`loss_mask` ([rows, positions]) with the rows of cut responses zeroed (a new tensor)."""
    return torch.where(truncated(finish_reasons)[:, None], torch.zeros_like(loss_mask), loss_mask)
