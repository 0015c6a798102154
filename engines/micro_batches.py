"""How the train engines cut a step's rows into micro-batches: at most `micro_batch_size`
rows each, and with a token budget (`train.max_tokens_per_micro_batch`) at most that many
tokens each, so memory follows tokens rather than rows: padded tokens (its rows times its
longest row), or with padding-free micro-batches (`engines.padding_free`) real tokens (the
sum of its rows' real tokens). A row longer than the budget runs alone. The engines weigh each micro-batch by its
share of the step's loss tokens (or sequences), so how the rows are cut changes no loss
and no gradient, only the rounding of their sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.flow.trajectory import TokenBatch


def row_lengths(batch: TokenBatch) -> torch.Tensor:
    """Each row's positions up to its last real token: the width it needs in a micro-batch."""
    positions = torch.arange(1, batch.input_ids.shape[1] + 1)
    return torch.where(batch.attention_mask.cpu() != 0, positions, 0).amax(dim=1)


def real_lengths(batch: TokenBatch) -> torch.Tensor:
    """Each row's real tokens: what it adds to a padding-free micro-batch."""
    return (batch.attention_mask.cpu() != 0).sum(dim=1)


def pack(lengths: Sequence[int], *, max_rows: int, max_tokens: int | None = None, padded: bool = True) -> list[slice]:
    """Consecutive runs of rows, in the order given, greedily as long as each stays within
    `max_rows` rows and (when set) `max_tokens` tokens: padded (rows x its longest row;
    sorted `lengths` waste the least padding), or with `padded=False` the sum of `lengths`."""
    out: list[slice] = []
    start, longest, total = 0, 0, 0
    for k, length in enumerate(lengths):
        wider, more = max(longest, int(length)), total + int(length)
        rows = k - start + 1
        if k > start and (rows > max_rows or (max_tokens is not None and (rows * wider if padded else more) > max_tokens)):
            out.append(slice(start, k))
            start, wider, more = k, int(length), int(length)
        longest, total = wider, more
    if len(lengths) > start:
        out.append(slice(start, len(lengths)))
    return out
