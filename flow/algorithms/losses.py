"""Policy losses: PPO-clip, dual-clip, decoupled PPO, truncated IS, sequence masking, GSPO, KL and entropy terms.

Token tensors are `[batch, seq]` with a `mask` of the same shape (bool or float; nonzero
marks a response token, a float mask's values weight the tokens). Values at masked-out
positions never reach the loss or its gradient, even when they are inf or nan (padding).

Three log-probabilities of each sampled token meet in `policy_loss`:

- `behavior_logprobs`: under the policy that generated the sample (the rollout engine),
- `proximal_logprobs`: under the policy the PPO trust region is centred on (AReaL's
  decoupled PPO: the trainer's weights before this update; with one optimizer step per
  batch these are `logprobs.detach()`, which `PolicyLossConfig.proximal_is_policy`
  uses without a tensor); without either the behavior policy is the proximal one
  (plain PPO),
- `logprobs`: under the policy being trained (carries the gradient).
"""

from __future__ import annotations

import dataclasses
import math

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
"""Ways `aggregate` turns per-token values into one scalar."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""Per-token estimators of KL(policy || reference) that `kl_estimate` offers."""
K3_MAX_LOG_RATIO = 20.0
K3_MAX = 10.0
"""The bounds of the k3 estimate (verl's `low_var_kl`): its log-ratio `d` within
`[-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO]`, the estimate at most `K3_MAX`."""

LEVELS = ("token", "sequence")
"""Where the importance ratio lives: per token (PPO) or per sequence (GSPO)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class PolicyLossConfig:
    """How `policy_loss` turns log-probabilities and advantages into a loss."""

    clip_low: float = 0.2
    """PPO clip below: the ratio is clipped at `1 - clip_low`. In [0, 1)."""
    clip_high: float = 0.28
    """PPO clip above: the ratio is clipped at `1 + clip_high` (DAPO's clip-higher);
    set it equal to `clip_low` for symmetric PPO. >= 0."""
    level: str = "token"
    """"token": one ratio per token (PPO). "sequence": GSPO, one ratio per sequence, the
    exp of the masked mean of its token log-ratios."""
    aggregation: str = "token_mean"
    """How per-token losses become a scalar: one of `AGGREGATIONS` (see `aggregate`)."""
    max_tokens: int | None = None
    """The constant in "token_sum_norm" (Dr.GRPO): loss = sum / (batch * max_tokens).
    Required for that aggregation, typically the maximum response length. > 0."""
    tis_cap: float | None = None
    """Truncated importance sampling: the behavior weight exp(proximal - behavior) is
    capped at this value. None: no cap. > 0."""
    seq_mask_low: float | None = None
    """Sequence masking: drop sequences whose exp(masked mean of proximal - behavior) is
    below this. None: no lower bound."""
    seq_mask_high: float | None = None
    """Sequence masking: drop sequences whose exp(masked mean of proximal - behavior) is
    above this. None: no upper bound. > 0."""
    kl_coef: float = 0.0
    """Weight of the KL(policy || reference) term added to the loss; needs
    `ref_logprobs` when > 0. >= 0."""
    kl_estimator: str = "k3"
    """Per-token KL estimator: one of `KL_ESTIMATORS` (see `kl_estimate`)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (verl's `entropy_coeff`): `entropy_coef` times the
    aggregated entropy of the policy's next-token distributions is subtracted from the
    loss, against entropy collapse; needs `entropy` when > 0. >= 0."""
    dual_clip: float | None = None
    """Dual-clip PPO (Ye et al. 2020; verl's `clip_ratio_c`, AReaL's `c_clip`): where the
    advantage is negative, the loss is at most `-dual_clip * A`, so a token (a sequence
    with `level="sequence"`) whose ratio exceeds `dual_clip` gets no gradient however far
    the policy moved. None: off. > 1 (at or below 1 it would cut into the clip range)."""
    proximal_is_policy: bool = False
    """Decoupled PPO without a pass of its own: when `proximal_logprobs` is None, the
    proximal policy is the trained policy before this update, `logprobs.detach()`. That
    is exact when a train step is one optimizer step over its batch (every tidal train
    engine's: micro-batches accumulate gradients, the weights change once at the end)
    and the model has no dropout, where it equals recomputing the proximal logprobs with
    the trainer's weights before the step, minus that forward pass (TRL's GRPOTrainer does the same at
    `num_iterations=1`). The PPO ratio is then 1 with the policy gradient's gradient, and
    the off-policy correction is the behavior weight. False: a None `proximal_logprobs`
    makes the behavior policy the proximal one (plain PPO)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first field that is out of bounds."""
        for field in dataclasses.fields(self):  # nan passes every comparison below
            value = getattr(self, field.name)
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{field.name} must be a number, got nan")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {list(LEVELS)}, got {self.level!r}")
        _check_aggregation(self.aggregation, self.max_tokens)
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        low, high = self.seq_mask_low, self.seq_mask_high
        if high is not None and high <= 0:  # exp(mean log weight) > 0: every sequence would be dropped
            raise ValueError(f"seq_mask_high must be > 0 or None, got {high}")
        if low is not None and high is not None and low > high:
            raise ValueError(f"seq_mask_low ({low}) must be <= seq_mask_high ({high})")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:  # `not >`: nan is refused too
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")

    @property
    def zero_advantage_counts(self) -> bool:
        """Whether a row whose advantage is zero on every token still adds to the loss and
        its gradient: through the KL or the entropy term. Without them a train engine may
        leave such rows out of its passes."""
        return self.kl_coef > 0 or self.entropy_coef > 0


def _check_aggregation(how: str, max_tokens: int | None) -> None:
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregation how={how!r} is not one of {list(AGGREGATIONS)}")
    if how == "token_sum_norm" and (max_tokens is None or max_tokens <= 0):
        raise ValueError(f"max_tokens must be a positive int for aggregation 'token_sum_norm', got {max_tokens}")


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    weighted = torch.where(mask != 0, values * mask, 0)
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, *, dim: int | None = None) -> torch.Tensor:
    """The mask-weighted mean of `values`, over all elements or along `dim`.

    Args:
        values: Any tensor.
        mask: Same shape as `values`; bool or float weights.
        dim: Reduce along this dimension; None reduces everything.

    Returns:
        The mean; 0 where the mask is all zero.
    """
    mask = mask.to(values.dtype)
    return _masked_sum(values, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1e-12)


def aggregate(values: torch.Tensor, mask: torch.Tensor, *, how: str, max_tokens: int | None = None) -> torch.Tensor:
    """Reduces per-token values `[batch, seq]` to a scalar.

    - "token_mean": the mean over all response tokens of the batch; long sequences count
      more (DAPO).
    - "seq_mean_token_mean": each sequence's token mean, averaged over sequences that have
      at least one response token (GRPO paper; GSPO paper with `level="sequence"`).
    - "seq_mean_token_sum": each sequence's token sum, averaged over sequences that have at
      least one response token.
    - "token_sum_norm": the sum over all response tokens divided by the constant
      `batch * max_tokens`, `batch = values.shape[0]` (Dr.GRPO): no length bias.

    Args:
        values: Per-token values, `[batch, seq]`.
        mask: `[batch, seq]`, bool or float weights; zero marks tokens to leave out.
        how: One of `AGGREGATIONS`.
        max_tokens: The constant for "token_sum_norm"; ignored otherwise.

    Returns:
        A scalar tensor; 0 when no token is in the mask.

    Raises:
        ValueError: If `how` is unknown, `max_tokens` is missing for "token_sum_norm", or
            the shapes disagree.
    """
    _check_aggregation(how, max_tokens)
    if values.dim() != 2:
        raise ValueError(f"values must be [batch, seq], got shape {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but values has {tuple(values.shape)}")
    mask = mask.to(values.dtype)
    if how == "token_mean":
        return masked_mean(values, mask)
    if how == "token_sum_norm":
        assert max_tokens is not None  # _check_aggregation
        return _masked_sum(values, mask) / (max(values.shape[0], 1) * max_tokens)  # an empty batch: 0, not 0 / 0
    per_seq = _masked_sum(values, mask, dim=-1)
    if how == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1e-12)
    has_tokens = (mask != 0).any(-1).to(values.dtype)
    return masked_mean(per_seq, has_tokens)


def _within(seq_log_weight: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    keep = torch.ones_like(seq_log_weight, dtype=torch.bool)
    if low is not None:
        keep &= seq_log_weight.exp() >= low
    if high is not None:
        keep &= seq_log_weight.exp() <= high
    return keep


def _log_weight(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per token `proximal - behavior` (detached), 0 at padding so that inf or nan there
    cannot reach exp or gradients; half-precision inputs in float32. `sequence_keep` and
    `policy_loss` both decide sequence masking from it, so they decide alike."""
    dtype = torch.promote_types(torch.promote_types(proximal_logprobs.dtype, behavior_logprobs.dtype), torch.float32)
    return torch.where(valid, proximal_logprobs.detach().to(dtype) - behavior_logprobs.detach().to(dtype), 0)


def sequence_keep(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, *, low: float | None, high: float | None) -> torch.Tensor:
    """Sequence masking's decision, `[batch]` bool: True where `exp(masked mean of (proximal
    - behavior))` lies within `[low, high]` (None: unbounded), as `policy_loss` decides it.
    A train engine that cuts a batch into micro-batches decides it for the whole batch first,
    so each micro-batch is weighed by the tokens it keeps."""
    log_weight = _log_weight(proximal_logprobs, behavior_logprobs, mask != 0)
    return _within(masked_mean(log_weight, mask, dim=-1), low, high)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimates of KL(policy || reference) from samples of the policy.

    With `d = ref_logprobs - logprobs` (Schulman, "Approximating KL divergence"):
    "k1" is `-d` (unbiased, high variance, can be negative), "k2" is `0.5 * d**2`
    (biased, low variance), "k3" is `exp(d) - d - 1` (unbiased, low variance, >= 0), with
    `d` clamped to `[-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO]` and the estimate to at most
    `K3_MAX`, as verl's `low_var_kl` does: a token the policy moved far below the
    reference (`d` past ~88 in float32) made the estimate, the loss and the gradient
    infinite, and the step was lost; clamped, that token's KL is bounded and passes no
    gradient.

    Args:
        logprobs: Log-probabilities under the policy, any shape.
        ref_logprobs: Log-probabilities under the reference policy, same shape.
        estimator: One of `KL_ESTIMATORS`.

    Returns:
        The estimates, elementwise, same shape.

    Raises:
        ValueError: If `estimator` is unknown or the shapes disagree.
    """
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs has shape {tuple(ref_logprobs.shape)} but logprobs has {tuple(logprobs.shape)}")
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        d = d.clamp(-K3_MAX_LOG_RATIO, K3_MAX_LOG_RATIO)
        return (torch.expm1(d) - d).clamp(max=K3_MAX)
    raise ValueError(f"kl estimator={estimator!r} is not one of {list(KL_ESTIMATORS)}")


ENTROPY_CHUNK = 1 << 24
"""Values (positions x vocabulary) per chunk when `token_entropy` runs without gradient:
64 MB of float32 temporaries, about 110 positions of a 150k-token vocabulary."""


def token_entropy(logprobs: torch.Tensor, *, grad: bool = True) -> torch.Tensor:
    """The entropy `-sum p log p` of each distribution given by its log-probabilities.

    A probability of 0 (log-probability -inf) adds 0, and no nan to the gradient. Without
    `grad` the result is detached and computed a chunk of positions at a time (about
    `ENTROPY_CHUNK` values each), so a large vocabulary's temporaries are a chunk's, not
    the batch's (the metric's case).

    Args:
        logprobs: `[..., vocab]` log-probabilities (a `log_softmax`).
        grad: Whether the result carries gradient to `logprobs` (the entropy bonus).

    Returns:
        `[...]`, in nats.
    """
    def entropy(lp: torch.Tensor) -> torch.Tensor:
        lp = lp.clamp(min=torch.finfo(lp.dtype).min)  # exp(min) * min = 0, where exp(-inf) * -inf is nan
        return -(lp.exp() * lp).sum(-1)

    if grad:
        return entropy(logprobs)
    with torch.no_grad():
        flat = logprobs.detach().reshape(math.prod(logprobs.shape[:-1]), logprobs.shape[-1])  # [vocab] too, where flatten(0, -2) has no dim -2
        parts = [entropy(chunk) for chunk in flat.split(max(1, ENTROPY_CHUNK // max(flat.shape[-1], 1)))]
        return (torch.cat(parts) if parts else flat.new_zeros(0)).view(logprobs.shape[:-1])


def _behavior_weight(log_weight: torch.Tensor, adv: torch.Tensor, *, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The behavior weight `min(exp(log_weight), cap)` and where the cap truncated it.

    Capped in log space, and 0 where the advantage is 0 (the token, or sequence, adds
    nothing to the loss whatever its weight): an overflowing exp times a zero surrogate
    made the loss NaN. Without a cap an overflowing weight with a non-zero advantage still
    gives an infinite loss: that is what `tis_cap` is for.
    """
    truncated = torch.zeros_like(log_weight, dtype=torch.bool)
    if cap is not None:
        truncated = log_weight > math.log(cap)
        log_weight = log_weight.clamp(max=math.log(cap))
    return torch.where(adv != 0, log_weight.exp(), 0), truncated


def _clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, *, clip_low: float, clip_high: float, dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate `min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)` with
    `r = exp(log_ratio)`, where the clipped term is the smaller (so it has no gradient),
    and where dual-clip bounds it: with `dual_clip = c` and A < 0 the surrogate is at least
    `c * A` (the loss at most `-c * A`; Ye et al. 2020, verl's `clip_ratio_c`).

    Computed as `A * exp(min(log r, log(1 + clip_high)))` for A >= 0 and `A * exp(max(log r,
    log(1 - clip_low)))` for A < 0 (with dual-clip, `A * exp(min(max(log r, log(1 -
    clip_low)), log c))`), the same value and gradient, so that exp cannot overflow where
    the clip, the dual clip or a zero advantage makes the ratio irrelevant: there an
    overflow gave a NaN gradient (0 * inf in exp's backward) or a NaN loss (inf * 0).
    Where the unclipped term is selected (A < 0 and a huge ratio, without dual-clip) the
    loss is as large as the ratio. A NaN advantage (a fault upstream) keeps its ratio
    unbounded, so the NaN reaches the gradient and the train engine skips the step (a
    clamp would pass back 0 on a clipped token, and the step would go on without the row,
    its loss NaN).

    Returns:
        The surrogate, where the PPO clip selected the clipped term, and where the dual
        clip's bound did (A < 0 and r > c; never both).
    """
    upper, lower = math.log1p(clip_high), math.log1p(-clip_low)
    rising, falling = adv >= 0, adv < 0
    falling_bounded = log_ratio.clamp(min=lower)
    is_dual_clipped = torch.zeros_like(falling)
    if dual_clip is not None:
        is_dual_clipped = falling & (log_ratio > math.log(dual_clip))
        falling_bounded = falling_bounded.clamp(max=math.log(dual_clip))  # log c > 0 > lower: the clamps never cross
    bounded = torch.where(rising, log_ratio.clamp(max=upper), torch.where(falling, falling_bounded, log_ratio))
    is_clipped = torch.where(rising, log_ratio > upper, log_ratio < lower) & (adv != 0)
    return bounded.exp() * adv, is_clipped, is_dual_clipped


def policy_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    config: PolicyLossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss, with dual-clip, decoupled PPO, truncated IS, masking, KL and entropy.

    Per token (`level="token"`), with `prox` = `proximal_logprobs` (when None:
    `logprobs.detach()` if `config.proximal_is_policy`, else `behavior_logprobs`) and the
    advantage `A` broadcast over tokens when given per sequence:

        ratio  = exp(logprobs - prox)
        weight = min(exp(prox - behavior), tis_cap)                  # detached
        loss_t = -weight * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)

    and with `dual_clip = c` (dual-clip PPO) `loss_t = -weight * max(min(...), c * A)` where
    A < 0: the bound `-c * A` on a token with negative advantage (before the weight, as in
    verl and AReaL).

    With `level="sequence"` (GSPO) the ratio, the behavior weight and the advantage are
    per sequence: `s = exp(masked mean of (logprobs - prox))`, which passes gradient to
    every response token of the sequence, `weight = min(exp(masked mean of (prox -
    behavior)), tis_cap)`, `A` is the sequence's advantage (the masked mean over its tokens
    when `advantages` is `[batch, seq]`), and the sequence's loss `-weight * min(s * A,
    clip(s) * A)` (dual-clipped on `s` likewise) is written to each of its response
    tokens. "seq_mean_token_mean" then gives the GSPO paper's mean over sequences;
    "token_mean" weights sequences by length.

    Sequence masking first drops (zeroes the mask of) every sequence whose
    `exp(masked mean of (prox - behavior))` lies outside `[seq_mask_low, seq_mask_high]`;
    everything below, the KL term and the metrics use the remaining tokens. The loss is
    `aggregate(loss_t) + kl_coef * aggregate(kl_estimate(logprobs, ref_logprobs)) -
    entropy_coef * aggregate(entropy)`, each with `config.aggregation`. Only `logprobs` and
    `entropy` carry gradient; the other tensors are treated as constants. Half-precision
    inputs are computed in float32 (the loss is float32; the gradient reaches `logprobs` in
    its own dtype), so a ratio above float16's
    65504 or an advantage rounded to bfloat16 does not change the loss. A token (sequence
    for GSPO) whose clipped term is selected, or whose advantage is 0, has gradient 0 even
    when its ratio or behavior weight overflows (see `_clipped_surrogate`).

    Args:
        logprobs: Log-probabilities under the trained policy, `[batch, seq]`.
        advantages: `[batch]` (per sequence) or `[batch, seq]` (per token).
        behavior_logprobs: Log-probabilities under the sampling policy, `[batch, seq]`.
        mask: `[batch, seq]`, bool or float; nonzero marks response tokens.
        proximal_logprobs: Log-probabilities under the proximal policy, `[batch, seq]`;
            None for `logprobs.detach()` (`config.proximal_is_policy`) or plain PPO.
        ref_logprobs: Log-probabilities under the reference policy, `[batch, seq]`; needed
            when `config.kl_coef > 0`.
        entropy: The entropy of the policy's distribution at each token, `[batch, seq]`
            (with gradient for the bonus); needed when `config.entropy_coef > 0`.
        config: The loss settings; None uses `PolicyLossConfig()`.

    Returns:
        The scalar loss and metrics, each a float over the tokens left after sequence
        masking (masked means, token-weighted): "clip_fraction" (tokens whose clipped
        term was selected, so they get no gradient), "ratio_mean" (the PPO ratio, or `s`
        per token for GSPO), "approx_kl" (`proximal - logprobs`, the k1 estimate of
        KL(proximal || policy) as in verl's `ppo_kl`), "tis_truncated_fraction" (tokens
        whose behavior weight hit `tis_cap`), "seq_masked_fraction" (dropped sequences
        over sequences with at least one response token), "dual_clip_fraction" (tokens
        with a negative advantage whose ratio exceeded `dual_clip`, so they get no
        gradient; only when `dual_clip` is set, and apart from "clip_fraction": a token is
        in at most one), "kl" (the aggregated KL estimate; only when `ref_logprobs`
        is given) and "entropy" (the mean entropy over tokens; only when `entropy` is
        given).

    Raises:
        ValueError: If a shape disagrees with `logprobs`, the config is invalid,
            `kl_coef > 0` without `ref_logprobs`, or `entropy_coef > 0` without `entropy`.
    """
    config = PolicyLossConfig() if config is None else config
    config.validate()
    if logprobs.dim() != 2 or not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating-point [batch, seq] tensor, got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"behavior_logprobs": behavior_logprobs, "mask": mask, "proximal_logprobs": proximal_logprobs, "ref_logprobs": ref_logprobs, "entropy": entropy}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but logprobs has {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [batch] or [batch, seq] = {tuple(shape)}, got {tuple(advantages.shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when kl_coef > 0 (kl_coef={config.kl_coef})")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy is required when entropy_coef > 0 (entropy_coef={config.entropy_coef})")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # half-precision inputs: the loss in float32
    logprobs = logprobs.to(dtype)
    mask = mask.to(dtype)
    valid = mask != 0
    if proximal_logprobs is None:
        proximal_logprobs = logprobs if config.proximal_is_policy else behavior_logprobs
    prox = proximal_logprobs.detach().to(dtype)
    prox_log_weight = _log_weight(proximal_logprobs, behavior_logprobs, valid)
    num_seqs_with_tokens = valid.any(-1).sum()

    seq_log_weight = masked_mean(prox_log_weight, mask, dim=-1)
    keep = _within(seq_log_weight, config.seq_mask_low, config.seq_mask_high)
    num_dropped = (~keep & valid.any(-1)).sum()
    mask = mask * keep.unsqueeze(-1)
    valid = mask != 0

    log_ratio = torch.where(valid, logprobs - prox, 0)
    adv = advantages.detach().to(dtype)
    if config.level == "token":
        adv = adv.unsqueeze(-1).expand(shape) if adv.dim() == 1 else torch.where(valid, adv, 0)
        level_log_ratio, level_log_weight = log_ratio, prox_log_weight
    else:
        adv = adv if adv.dim() == 1 else masked_mean(adv, mask, dim=-1)
        level_log_ratio, level_log_weight = masked_mean(log_ratio, mask, dim=-1), seq_log_weight
    weight, truncated = _behavior_weight(level_log_weight, adv, cap=config.tis_cap)
    surrogate, is_clipped, is_dual_clipped = _clipped_surrogate(level_log_ratio, adv, clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip)
    per_token = -weight * surrogate
    ratio = level_log_ratio.detach().exp()  # for the metric
    if config.level == "sequence":
        per_token, ratio, is_clipped, is_dual_clipped, truncated = (t.unsqueeze(-1).expand(shape) for t in (per_token, ratio, is_clipped, is_dual_clipped, truncated))
    loss = aggregate(per_token, mask, how=config.aggregation, max_tokens=config.max_tokens)

    metrics: dict[str, torch.Tensor] = {}
    if ref_logprobs is not None:
        ref = torch.where(valid, ref_logprobs.detach(), 0)
        kl = kl_estimate(torch.where(valid, logprobs, 0), ref, estimator=config.kl_estimator)
        kl = aggregate(kl, mask, how=config.aggregation, max_tokens=config.max_tokens)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        entropy = torch.where(valid, entropy.to(dtype), 0)  # a masked position's value (even nan) reaches neither the loss nor the gradient
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * aggregate(entropy, mask, how=config.aggregation, max_tokens=config.max_tokens)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    with torch.no_grad():
        metrics["clip_fraction"] = masked_mean(is_clipped.to(mask.dtype), mask)
        metrics["ratio_mean"] = masked_mean(ratio, mask)
        metrics["approx_kl"] = masked_mean(-log_ratio, mask)
        metrics["tis_truncated_fraction"] = masked_mean(truncated.to(mask.dtype), mask)
        metrics["seq_masked_fraction"] = num_dropped / num_seqs_with_tokens.clamp(min=1)
        if config.dual_clip is not None:
            metrics["dual_clip_fraction"] = masked_mean(is_dual_clipped.to(mask.dtype), mask)
    return loss, {name: float(value) for name, value in metrics.items()}
