"""The train-row format: finished trajectories as rows of the store's `train` partition.

Rollout writes them (`put_trajectories`); the reward stage reads them back as
`Trajectory` objects (`trajectories_of`) and the trainer as one `TokenBatch`
(`token_batch_of`), each without importing the stage that wrote them.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.flow.clock import ClockEvent
from tidal.flow.store.protocol import StoreApi
from tidal.flow.trajectory import ENV_VERSION, TokenBatch, Trajectory, check_lengths

TRAJECTORY_COLUMNS = ("sizes", "prompt_ids", "tokens", "logprobs", "token_versions", "finish_reason")
"""The `train` partition's columns that hold trajectories (`meta` is separate: reward reads it)."""


def put_trajectories(store: StoreApi, trajectories: list[Trajectory], *, cancel: ClockEvent | None = None, ack: tuple[str, str, list[int]] | None = None) -> None:
    """Finished trajectories as rows of the `train` partition (row version = oldest token's).

    Each token field is one right-padded tensor for all the rows (a put of a few tensors,
    not one per row and field; between processes, a few buffers): `prompt_ids`
    [rows, longest prompt], `tokens`, `logprobs`, `token_versions` [rows, longest
    continuation], and `sizes` [rows, 2] = (prompt length, continuation length).
    `trajectories_of` reads them back. `ack` (consumer, partition, indexes) acks the
    prompts they came from in the same step.
    """
    for t in trajectories:
        check_lengths(t)  # else padding below would hide a missing logprob or version
    prompt_width = max((len(t.prompt_ids) for t in trajectories), default=0)
    width = max((len(t.tokens) for t in trajectories), default=0)
    columns = {
        "sizes": torch.tensor([[len(t.prompt_ids), len(t.tokens)] for t in trajectories], dtype=torch.long).reshape(len(trajectories), 2),
        "prompt_ids": torch.tensor([t.prompt_ids + [0] * (prompt_width - len(t.prompt_ids)) for t in trajectories], dtype=torch.long).reshape(len(trajectories), prompt_width),
        "tokens": torch.tensor([t.tokens + [0] * (width - len(t.tokens)) for t in trajectories], dtype=torch.long).reshape(len(trajectories), width),
        "logprobs": torch.tensor([t.logprobs + [0.0] * (width - len(t.logprobs)) for t in trajectories], dtype=torch.float32).reshape(len(trajectories), width),
        "token_versions": torch.tensor([t.versions + [ENV_VERSION] * (width - len(t.versions)) for t in trajectories], dtype=torch.long).reshape(len(trajectories), width),
        "finish_reason": [t.finish_reason for t in trajectories],
        "meta": [t.meta for t in trajectories],
    }
    versions = [t.oldest_version for t in trajectories]
    store.put("train", columns, groups=[t.group for t in trajectories], versions=versions, cancel=cancel, ack=ack)


def trajectories_of(batch: Any) -> list[Trajectory]:
    """The trajectories in a batch of `train` rows (`TRAJECTORY_COLUMNS`, and `meta` if fetched)."""
    columns = batch.columns
    sizes = batch.stack("sizes").tolist()
    rows = {name: _padded(batch, name).tolist() for name in ("prompt_ids", "tokens", "logprobs", "token_versions")}
    metas = columns.get("meta")
    return [
        Trajectory(
            prompt_ids=rows["prompt_ids"][k][:p],
            group=group,
            tokens=rows["tokens"][k][:n],
            logprobs=rows["logprobs"][k][:n],
            versions=rows["token_versions"][k][:n],
            finish_reason=finish_reason,
            meta=dict(metas[k]) if metas is not None else {},
        )
        for k, ((p, n), group, finish_reason) in enumerate(zip(sizes, batch.groups, columns["finish_reason"]))
    ]


def token_batch_of(batch: Any, *, pad_id: int, order: Any = None) -> TokenBatch:
    """The `TokenBatch` of a batch of `train` rows, its rows in `order` (default: as they
    came): what `to_token_batch(trajectories_of(batch))` gives, made by a few tensor ops on
    the stored columns instead of a Python list per row and field (the trainer's step
    waits for this)."""
    sizes = batch.stack("sizes")
    prompts, tokens, logprobs, versions = (_padded(batch, name) for name in ("prompt_ids", "tokens", "logprobs", "token_versions"))
    if order is not None:
        rows = torch.as_tensor(order, dtype=torch.long)
        sizes, prompts, tokens, logprobs, versions = (t[rows] for t in (sizes, prompts, tokens, logprobs, versions))
    if len(sizes) == 0:
        raise ValueError("token_batch_of needs at least one row")
    p, k = sizes[:, :1], sizes[:, 1:]
    if bool((p < 1).any()):
        raise ValueError("a trajectory needs at least one prompt token")
    length = int((p + k).max())
    at = torch.arange(length)[None, :]
    real = at < p + k
    from_prompt = prompts.gather(1, at.clamp(max=prompts.shape[1] - 1).expand(len(p), -1))
    from_tokens = tokens.gather(1, (at - p).clamp(0, tokens.shape[1] - 1))
    ids = torch.where(real, torch.where(at < p, from_prompt, from_tokens), pad_id)
    # position t predicts ids[t + 1]: continuation token m is predicted at t = p - 1 + m
    m = torch.arange(length - 1)[None, :] - (p - 1)
    predicted = (m >= 0) & (m < k)
    m = m.clamp(0, tokens.shape[1] - 1)
    token_versions = torch.where(predicted, versions.gather(1, m), ENV_VERSION)
    return TokenBatch(
        ids,
        real.long(),
        (token_versions != ENV_VERSION).float(),
        torch.where(predicted, logprobs.gather(1, m), 0.0),
        token_versions,
    )


def _padded(batch: Any, name: str) -> torch.Tensor:
    """A padded column as one [rows, width >= 1] tensor (puts padded to different widths
    padded again to the widest)."""
    try:
        column = batch.stack(name)
    except RuntimeError:  # puts padded to different widths
        column = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(cell) for cell in batch.columns[name]], batch_first=True)
    return column if column.shape[1] > 0 else torch.zeros(column.shape[0], 1, dtype=column.dtype)
