"""Group-relative advantage estimators: one advantage per row from its reward and group.

Every estimator takes `rewards`, a 1-D floating-point tensor with one entry per row, and
`groups`, one group id per row: a 1-D integer tensor or a list of hashable ids (e.g. the
prompt uid). Rows of one group need not be contiguous. A group with a single row carries
no baseline information, and one whose rewards are all equal no signal, so their
advantages are exactly 0 under every estimator. A reward that is not finite (NaN marks a
failed reward; the reward functions flag an infinity as failed too) leaves its row out:
the row's advantage is 0 and its group's statistics are those of the other rows, so one
failed reward neither poisons its group (NaN) nor silences it. The result has the
shape, dtype and device of `rewards`; it is computed in float64, so float32 rewards near
float32's range (which a reward function may return) do not overflow the group sums.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

Groups = torch.Tensor | Sequence[Hashable]
"""One group id per row: a 1-D integer tensor or a sequence of hashable ids."""


def _group_index(rewards: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, int]:
    """Checks the arguments; returns each row's dense group index and the number of groups."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D floating-point tensor [num_rows], got {_describe(rewards)}")
    num_rows = rewards.shape[0]
    if isinstance(groups, torch.Tensor):
        if groups.dim() != 1 or groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
            raise ValueError(f"groups must be a 1-D integer tensor or a list of ids, got {_describe(groups)}")
        if groups.shape[0] != num_rows:
            raise ValueError(f"groups has {groups.shape[0]} ids but rewards has {num_rows} rows")
        _, index = torch.unique(groups.to(rewards.device), return_inverse=True)
    else:
        ids = [_hashable(g) for g in groups]
        if len(ids) != num_rows:
            raise ValueError(f"groups has {len(ids)} ids but rewards has {num_rows} rows")
        dense: dict[Hashable, int] = {}
        index = torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.int64, device=rewards.device)
    num_groups = int(index.max()) + 1 if num_rows else 0
    return index, num_groups


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _hashable(group: Any) -> Hashable:
    """A group id by its value: a tensor hashes by identity (`list(uid_tensor)` made every
    row a group of its own, and every advantage 0), so a 0-d one stands for its number."""
    if isinstance(group, torch.Tensor):
        if group.dim() != 0:
            raise ValueError(f"a group id must be a number or another hashable id, got a tensor of shape {tuple(group.shape)} (pass groups as a 1-D integer tensor, or ids.tolist())")
        return group.item()
    return group


def _group_sums(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return values.new_zeros(num_groups).index_add_(0, index, values)


def _scored(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards in float64 with every failed (non-finite) one at 0, and which rows scored."""
    wide = rewards.double()
    scored = torch.isfinite(wide)
    return torch.where(scored, wide, 0.0), scored


def _silent(wide: torch.Tensor, scored: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per row, `[num_rows]` bool: whether its advantage is exactly 0 - its reward failed, or
    every scored reward of its group is the same (a group with one scored row too). A mean
    computed in floating point can be a rounding step off the reward it averages (eight
    rewards of 0.1 in float32), and dividing that by a std of the same size would give every
    row of a tied group one large advantage of one sign."""
    high = wide.new_full((num_groups,), -torch.inf).scatter_reduce_(0, index, torch.where(scored, wide, -torch.inf), "amax")
    low = wide.new_full((num_groups,), torch.inf).scatter_reduce_(0, index, torch.where(scored, wide, torch.inf), "amin")
    return (high == low)[index] | ~scored


def grpo(rewards: torch.Tensor, groups: Groups, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: the reward minus its group's mean, divided by the group's std.

    The std is the unbiased sample std (Bessel's correction, `torch.std`'s default), as in
    verl and TRL. A group whose rewards are all equal has advantage exactly 0 (any `eps`).

    Args:
        rewards: Rewards, `[num_rows]`, floating point.
        groups: One group id per row.
        normalize_std: Divide by `std + eps`; False gives `r - mean` ("grpo_no_std").
        eps: Added to the std before dividing.

    Returns:
        Advantages, `[num_rows]`.

    Raises:
        ValueError: If `rewards` or `groups` is malformed, or `eps` is negative.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    index, num_groups = _group_index(rewards, groups)
    wide, scored = _scored(rewards)
    counts = _group_sums(scored.double(), index, num_groups)  # scored rows per group
    centered = wide - (_group_sums(wide, index, num_groups) / counts.clamp(min=1))[index]
    centered = torch.where(_silent(wide, scored, index, num_groups), 0.0, centered)
    if not normalize_std:
        return centered.to(rewards.dtype)
    var = _group_sums(centered.square(), index, num_groups) / (counts - 1).clamp(min=1)
    std = var.sqrt()[index]
    return torch.where(std > 0, centered / (std + eps), 0.0).to(rewards.dtype)  # std 0: a tied group (0 / 0 with eps=0)


def rloo(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """RLOO advantages: the reward minus the mean reward of the other rows of its group.

    Args:
        rewards: Rewards, `[num_rows]`, floating point.
        groups: One group id per row.

    Returns:
        Advantages, `[num_rows]`; 0 for a group with one scored row or all rewards equal,
        and for a failed (non-finite) reward.

    Raises:
        ValueError: If `rewards` or `groups` is malformed.
    """
    index, num_groups = _group_index(rewards, groups)
    wide, scored = _scored(rewards)
    counts = _group_sums(scored.double(), index, num_groups)[index]  # scored rows in the row's group
    others = _group_sums(wide, index, num_groups)[index] - wide  # a failed row's is wrong, and unused
    baseline = others / (counts - 1).clamp(min=1)
    return torch.where(_silent(wide, scored, index, num_groups), 0.0, wide - baseline).to(rewards.dtype)


def dr_grpo(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Dr.GRPO advantages: the reward minus its group's mean, without std division.

    Dr.GRPO pairs these with a constant-normalised token sum in the loss:
    `PolicyLossConfig(aggregation="token_sum_norm", max_tokens=...)`.

    Args:
        rewards: Rewards, `[num_rows]`, floating point.
        groups: One group id per row.

    Returns:
        Advantages, `[num_rows]`.

    Raises:
        ValueError: If `rewards` or `groups` is malformed.
    """
    return grpo(rewards, groups, normalize_std=False)


def silent_groups(rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Per row, `[num_rows]` bool: True for every row of a group without signal, one whose
    every advantage is exactly 0 under every estimator: all its scored rewards are the same,
    or fewer than two of its rewards scored (DAPO's dynamic sampling leaves such groups out).

    Args:
        rewards: Rewards, `[num_rows]`, floating point (non-finite: failed).
        groups: One group id per row.

    Raises:
        ValueError: If `rewards` or `groups` is malformed.
    """
    index, num_groups = _group_index(rewards, groups)
    wide, scored = _scored(rewards)
    silent = _silent(wide, scored, index, num_groups)
    loud = _group_sums((~silent).double(), index, num_groups)  # rows with an advantage, per group
    return (loud == 0)[index]


def token_whiten(advantages: torch.Tensor, num_tokens: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """Row advantages whitened over a batch's tokens, as verl's `masked_whiten` whitens them
    over the response mask (REINFORCE++): each row's advantage counts once per loss token,
    the batch's token mean is subtracted and the result divided by the tokens' unbiased std
    (`rsqrt(var + eps)`). Rows without a loss token count nowhere and keep what they had, so
    a step of one row, or of one token, returns the advantages unchanged.

    Args:
        advantages: `[num_rows]` per-row advantages, floating point.
        num_tokens: `[num_rows]` loss tokens of each row (>= 0).
        eps: Added to the variance.

    Returns:
        `[num_rows]`, in `advantages`' dtype.
    """
    if advantages.shape != num_tokens.shape or advantages.dim() != 1:
        raise ValueError(f"advantages and num_tokens must be 1-D and alike, got {tuple(advantages.shape)} and {tuple(num_tokens.shape)}")
    wide, weights = advantages.double(), num_tokens.double()
    total = float(weights.sum())
    if total < 2:
        return advantages
    mean = (wide * weights).sum() / total
    var = ((wide - mean).square() * weights).sum() / (total - 1)
    return torch.where(weights > 0, (wide - mean) * torch.rsqrt(var + eps), wide).to(advantages.dtype)


ADVANTAGES: dict[str, Callable[[torch.Tensor, Groups], torch.Tensor]] = {
    "grpo": grpo,
    "grpo_no_std": functools.partial(grpo, normalize_std=False),
    "rloo": rloo,
    "dr_grpo": dr_grpo,
    "reinforce_plus_plus_baseline": functools.partial(grpo, normalize_std=False),
}
"""Advantage estimators by the name a recipe uses; each is `fn(rewards, groups)`, a group's
part. Those in `TOKEN_WHITENED` are whitened over each step's tokens besides."""

TOKEN_WHITENED = frozenset({"reinforce_plus_plus_baseline"})
"""Estimators whose advantages the trainer whitens over each step's loss tokens
(`token_whiten`): REINFORCE++-baseline (verl's `reinforce_plus_plus_baseline`, OpenRLHF's
`reinforce_baseline`) is the reward minus its group's mean, normalised by the whole batch's
std instead of the group's, which keeps a group of near-equal rewards from being blown up."""


VALUE_BASED = frozenset({"gae"})
"""Estimators (not in `ADVANTAGES`: they compare no group) whose advantages come from a
learned value function at the step that trains the rows (PPO with a critic:
`flow.algorithms.gae`), per token; a group of one sample learns. Until then the rows carry
an advantage of 0 (`compute_advantages`)."""


def compute_advantages(name: str, rewards: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Runs the estimator registered under `name` in `ADVANTAGES`.

    Args:
        name: A key of `ADVANTAGES`, or of `VALUE_BASED` (zeros: the trainer's critic gives them).
        rewards: Rewards, `[num_rows]`, floating point.
        groups: One group id per row.

    Returns:
        Advantages, `[num_rows]`.

    Raises:
        ValueError: If `name` is not registered, or the inputs are malformed.
    """
    if name in VALUE_BASED:
        return torch.zeros_like(rewards)
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator name={name!r}; valid names: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, groups)
