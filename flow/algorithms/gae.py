"""PPO with a learned value function (`algorithm.advantage=gae`): generalized advantage
estimation over each response's tokens, the advantages whitened over a step's tokens, and
the critic's clipped value loss, as pure tensor functions (verl's
`compute_gae_advantage_return`, `masked_whiten` and `compute_value_loss`; OpenRLHF's
`get_advantages_and_returns`).

Positions follow the trainer's token layout: column t of `[batch, seq - 1]` is the choice of
token t + 1 after reading tokens 0..t, so the value at t is the critic's at token t.
Only positions in `mask` (the loss tokens) are steps of the episode; the sequence's reward
comes at its last one. Positions outside the mask (the prompt, padding, tokens an
environment wrote) are skipped: advantage and return 0 there, and the recursion passes
over them.
"""

from __future__ import annotations

import dataclasses

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 1.0, token_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages and returns.

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, from the
    last loss token back, where r_t is the row's reward at its last loss token and 0
    elsewhere (plus `token_rewards` at t), and V_next, A_next are those of the next loss
    token (0 after the last). Returns are A_t + V_t.

    Args:
        rewards: `[batch]` sequence rewards.
        values: `[batch, seq - 1]` the critic's values.
        mask: `[batch, seq - 1]` loss tokens (bool or 0/1).
        gamma: Discount per token, in [0, 1].
        lam: GAE's lambda, in [0, 1].
        token_rewards: `[batch, seq - 1]` rewards of every token besides (a KL penalty in
            the reward, `kl_penalty_rewards`); read at the loss tokens only. None: none.

    Returns:
        (advantages, returns), each `[batch, seq - 1]` in float32, 0 outside `mask`.
    """
    if values.shape != mask.shape or values.dim() != 2 or rewards.shape != values.shape[:1]:
        raise ValueError(f"rewards [batch] and values, mask [batch, seq - 1] must agree, got {tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    on = mask.bool()
    values = values.float() * on
    num_rows, width = values.shape
    positions = torch.arange(width, device=values.device).expand(num_rows, -1)
    last = torch.where(on, positions, -1).max(dim=1).values  # -1: a row without a loss token
    if token_rewards is not None and token_rewards.shape != values.shape:
        raise ValueError(f"token_rewards must be shaped as values {tuple(values.shape)}, got {tuple(token_rewards.shape)}")
    per_token = torch.zeros_like(values) if token_rewards is None else token_rewards.float() * on
    has = last >= 0
    per_token[has, last[has]] += rewards.float()[has]
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(num_rows, device=values.device)
    next_advantage = torch.zeros(num_rows, device=values.device)
    for t in range(width - 1, -1, -1):
        here = on[:, t]
        delta = per_token[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_advantage = torch.where(here, advantage, next_advantage)
        next_value = torch.where(here, values[:, t], next_value)
    return advantages, (advantages + values) * on


def kl_penalty_rewards(behavior_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor, *, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-token KL penalty in the reward (InstructGPT's PPO; verl's `apply_kl_penalty` with
    its default "kl" estimator, OpenRLHF's and TRL's): `-coef * (behavior - reference logprob)`
    at each loss token, 0 elsewhere. Returns (those rewards, each row's mean KL over its loss
    tokens: `[batch]`, what `KLController.update` reads; 0 for a row without one)."""
    on = mask.bool()
    kl = (behavior_logprobs.float() - reference_logprobs.float()) * on
    per_row = kl.sum(dim=1) / on.sum(dim=1).clamp(min=1)
    return -coef * kl, per_row


@dataclasses.dataclass
class KLController:
    """The coefficient of a KL penalty in the reward (verl's `kl_ctrl`; Ziegler et al. 2019):
    fixed, or with a `target` adapted after each step toward that KL: the coefficient times
    1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon."""

    coef: float
    target: float | None = None
    """The KL per token (each sequence's mean over its tokens, averaged) to steer toward; None: a fixed coefficient."""
    horizon: int = 10000
    """Samples over which a KL off the target moves the coefficient by its (clipped) relative error."""

    def update(self, kl: float, num_samples: int) -> None:
        """After a step whose `num_samples` sequences had a mean `kl` (`kl_penalty_rewards`)."""
        if self.target is None:
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_samples / self.horizon


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8) -> torch.Tensor:
    """`values` minus their mean over `mask`, over the unbiased std there (`rsqrt(var + eps)`),
    0 outside `mask`; unchanged (0 outside) with fewer than two positions in it."""
    on = mask.bool()
    count = int(on.sum())
    if count < 2:
        return values * on
    picked = values[on].double()
    mean, var = picked.mean(), picked.var(unbiased=True)
    return (((values.double() - mean) * torch.rsqrt(var + eps)) * on).to(values.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's loss summed over `mask`: 0.5 * max((V - R)^2, (V_clipped - R)^2) per token,
    where V_clipped is V kept within `clip` of the values the advantages were computed with
    (`old_values`; `clip` None: no clipping, 0.5 * (V - R)^2). The caller divides by the
    step's tokens. Returns (loss sum, number of tokens where the clipped term was larger)."""
    on = mask.bool()
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped[on].sum(), torch.zeros((), device=values.device)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped)[on].sum(), ((clipped > unclipped) & on).sum()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over `mask`: 1 when the critic predicts the returns, 0 when it
    does no better than their mean, NaN when the returns do not vary."""
    on = mask.bool()
    r, v = returns[on].double(), values[on].double()
    if r.numel() < 2:
        return float("nan")
    var = r.var(unbiased=False)
    return float("nan") if var == 0 else float(1 - (r - v).var(unbiased=False) / var)
