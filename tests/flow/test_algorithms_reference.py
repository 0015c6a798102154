"""The policy loss against transcriptions of the reference implementations users know
(verl's PPO, dual-clip, TIS and GSPO losses with `agg_loss`, AReaL's decoupled PPO), and hand values
for combinations the unit tests do not reach."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.flow.algorithms import PolicyLossConfig, dr_grpo, policy_loss

LN = math.log
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def close(actual, expected, tol: float = 1e-12) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), expected, rtol=tol, atol=tol)


# --- transcriptions (what the references compute; none of tidal's code) -------------------


def verl_agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl `core_algos.agg_loss` (every row has a response token here)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_sums = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.mean()
    assert mode == "seq-mean-token-mean"
    return (seq_sums / mask.sum(-1)).mean()


def verl_ppo_loss(old, logp, adv, mask, mode, rollout=None, tis_cap=None):
    """verl `compute_policy_loss_vanilla` without dual-clip, with its truncated IS weight
    `min(exp(old - rollout), cap)` (`old` is the trainer's recomputed logprob)."""
    ratio = torch.exp(logp - old)
    losses = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    if rollout is not None:
        losses = losses * torch.clamp(torch.exp(old - rollout), max=tis_cap)
    return verl_agg_loss(losses, mask, mode)


def verl_ppo_loss_dual_clip(old, logp, adv, mask, mode, clip_ratio_c):
    """verl `compute_policy_loss_vanilla` with dual-clip (`clip_ratio_c`): its loss and its
    `pg_clipfrac` and `pg_clipfrac_lower` (the share of tokens the bound `-A * c` caps)."""
    assert clip_ratio_c > 1.0
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = ((pg_losses2 > pg_losses1).double() * mask).sum() / mask.sum()
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = ((clip_pg_losses1 > pg_losses3).double() * (adv < 0).double() * mask).sum() / mask.sum()
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, mask, mode), float(pg_clipfrac), float(pg_clipfrac_lower)


def areal_decoupled_loss(logp, prox, old, adv, mask):
    """AReaL `ppo_actor_loss_fn` with proximal logprobs, no dual-clip and no weight cap."""
    ratio = torch.where(mask.bool(), torch.exp(logp - prox), 0)
    loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    loss = loss * torch.where(mask.bool(), torch.exp(prox - old), 0.0)
    return torch.where(mask.bool(), loss, 0).sum() / mask.sum()


def verl_gspo_loss(old, logp, adv, mask):
    """verl `compute_policy_loss_gspo` (GSPO-token's stop-gradient form), seq-mean-token-mean."""
    seq_log_ratio = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1))
    losses = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    return verl_agg_loss(losses, mask, "seq-mean-token-mean")


def random_batch(seed: int):
    """Logprobs near each other (some tokens clipped, most not), a ragged mask, and
    per-sequence advantages of both signs, broadcast to tokens as verl stores them."""
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    behavior = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    prox = behavior + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    logp = prox + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 3, 1, 4])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    adv = torch.tensor([1.5, -0.7, 0.4, -2.0], dtype=torch.float64)
    return logp, prox, behavior, mask, adv


def loss_and_grad(fn, logp):
    leaf = logp.clone().requires_grad_()
    loss = fn(leaf)
    return loss.detach(), torch.autograd.grad(loss, leaf)[0]


MODES = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean", "seq_mean_token_sum": "seq-mean-token-sum"}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("how", sorted(MODES))
def test_ppo_clip_higher_matches_verl(seed, how):
    logp, _, behavior, mask, adv = random_batch(seed)
    config = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, aggregation=how)
    ours = loss_and_grad(lambda x: policy_loss(x, adv, behavior_logprobs=behavior, mask=mask, config=config)[0], logp)
    verl = loss_and_grad(lambda x: verl_ppo_loss(behavior, x, adv[:, None].expand_as(x), mask, MODES[how]), logp)
    close(ours[0], verl[0])
    close(ours[1], verl[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncated_is_matches_verl(seed):
    logp, prox, behavior, mask, adv = random_batch(seed)
    config = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tis_cap=1.1)
    ours = loss_and_grad(lambda x: policy_loss(x, adv, behavior_logprobs=behavior, proximal_logprobs=prox, mask=mask, config=config)[0], logp)
    verl = loss_and_grad(lambda x: verl_ppo_loss(prox, x, adv[:, None].expand_as(x), mask, "token-mean", rollout=behavior, tis_cap=1.1), logp)
    close(ours[0], verl[0])
    close(ours[1], verl[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_ppo_matches_areal(seed):
    logp, prox, behavior, mask, adv = random_batch(seed)
    config = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    ours = loss_and_grad(lambda x: policy_loss(x, adv, behavior_logprobs=behavior, proximal_logprobs=prox, mask=mask, config=config)[0], logp)
    areal = loss_and_grad(lambda x: areal_decoupled_loss(x, prox, behavior, adv[:, None].expand_as(x), mask), logp)
    close(ours[0], areal[0])
    close(ours[1], areal[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_verl(seed):
    # verl's GSPO writes s_i on every token with the gradient of s_i / |y_i| per token (its
    # stop-gradient form): with per-sequence advantages, tidal's sequence level is the same
    # loss and gradient, clipped sequences included.
    logp, _, behavior, mask, adv = random_batch(seed)
    config = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, level="sequence", aggregation="seq_mean_token_mean")
    ours = loss_and_grad(lambda x: policy_loss(x, adv, behavior_logprobs=behavior, mask=mask, config=config)[0], logp)
    verl = loss_and_grad(lambda x: verl_gspo_loss(behavior, x, adv[:, None].expand_as(x), mask), logp)
    close(ours[0], verl[0])
    close(ours[1], verl[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("how", sorted(MODES))
@pytest.mark.parametrize("clip_ratio_c", [1.2, 3.0])
def test_dual_clip_matches_verl(seed, how, clip_ratio_c):
    # Ratios spread wide (log-ratio ~ N(0, 1)), so that with c = 1.2 some tokens of negative
    # advantage are dual-clipped, others clipped below, others not clipped at all.
    logp, _, behavior, mask, adv = random_batch(seed)
    logp = behavior + torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed + 10), dtype=torch.float64)
    per_token = adv[:, None].expand_as(logp)
    config = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, aggregation=how, dual_clip=clip_ratio_c)
    ours = loss_and_grad(lambda x: policy_loss(x, adv, behavior_logprobs=behavior, mask=mask, config=config)[0], logp)
    verl = loss_and_grad(lambda x: verl_ppo_loss_dual_clip(behavior, x, per_token, mask, MODES[how], clip_ratio_c)[0], logp)
    close(ours[0], verl[0])
    close(ours[1], verl[1])
    _, metrics = policy_loss(logp, adv, behavior_logprobs=behavior, mask=mask, config=config)
    _, clipfrac, clipfrac_lower = verl_ppo_loss_dual_clip(behavior, logp, per_token, mask, MODES[how], clip_ratio_c)
    assert metrics["clip_fraction"] == pytest.approx(clipfrac, abs=1e-12)
    assert metrics["dual_clip_fraction"] == pytest.approx(clipfrac_lower, abs=1e-12)
    if clip_ratio_c == 1.2:
        assert clipfrac_lower > 0  # the bound is reached, so the comparison covers it
        without = policy_loss(logp, adv, behavior_logprobs=behavior, mask=mask, config=PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, aggregation=how))[0]
        assert float(without) > float(ours[0])  # dual-clip only ever lowers the loss


# --- hand values --------------------------------------------------------------------------


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c_times_minus_a():
    # clip 0.2 / 0.28, c = 3; ratios [4, 2, 4, 0.5], A = [-1, -1, +1, -1]:
    # t0: max(4, 1.28) = 4, bounded by c: 3 (dual-clipped, gradient 0);
    # t1: max(2, 1.28) = 2 < 3: loss 2, gradient -A * r / 4 = 0.5 under the token mean;
    # t2: A > 0: -min(4, 1.28) = -1.28 (clipped above, gradient 0);
    # t3: max(0.5, 0.8) = 0.8 (clipped below, gradient 0).
    # Token mean (3 + 2 - 1.28 + 0.8) / 4 = 1.13; without dual-clip t0 costs 4: 1.38.
    behavior = torch.full((1, 4), -3.0, dtype=torch.float64)
    logp = (behavior + torch.tensor([[LN(4), LN(2), LN(4), LN(0.5)]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, metrics = policy_loss(logp, adv, behavior_logprobs=behavior, mask=mask, config=PolicyLossConfig(dual_clip=3.0))
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, 1.13)
    close(grad, [[0.0, 0.5, 0.0, 0.0]])
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 4) and metrics["clip_fraction"] == pytest.approx(2 / 4)
    plain, plain_metrics = policy_loss(logp, adv, behavior_logprobs=behavior, mask=mask, config=PolicyLossConfig())
    close(plain, 1.38)
    assert "dual_clip_fraction" not in plain_metrics


def test_dual_clip_bounds_the_sequence_ratio_under_gspo_and_weighs_by_the_behavior_weight():
    # Sequence 0 (2 tokens): log-ratios [ln 8, ln 2], s = exp(2 ln 2) = 4, A = -1: bounded at
    # c = 3 on both tokens, gradient 0. Sequence 1 (1 token): s = 2, A = -1: loss 2, but its
    # behavior weight exp(prox - behavior) = 1/2 makes it 1; gradient 0.5 * s / 2 = 0.5 under
    # seq_mean_token_mean, (3 + 1) / 2 = 2. Dual-clipped: 2 of the 3 tokens.
    behavior = torch.tensor([[-2.0, -1.0], [-1.0, 0.0]], dtype=torch.float64)
    prox = behavior + torch.tensor([[0.0, 0.0], [LN(0.5), 0.0]], dtype=torch.float64)
    logp = (prox + torch.tensor([[LN(8), LN(2)], [LN(2), 0.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    config = PolicyLossConfig(level="sequence", aggregation="seq_mean_token_mean", dual_clip=3.0, tis_cap=None)
    loss, metrics = policy_loss(logp, torch.tensor([-1.0, -1.0], dtype=torch.float64), behavior_logprobs=behavior, proximal_logprobs=prox, mask=mask, config=config)
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, 2.0)
    close(grad, [[0.0, 0.0], [0.5, 0.0]])
    assert metrics["dual_clip_fraction"] == pytest.approx(2 / 3) and metrics["clip_fraction"] == 0.0


def test_dual_clip_at_the_sequence_level_of_one_token_sequences_is_the_token_levels():
    logp, _, behavior, _, adv = random_batch(4)
    logp = behavior + torch.randn(logp.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mask = torch.zeros_like(logp)
    mask[:, 0] = 1.0
    token = PolicyLossConfig(dual_clip=1.5)
    sequence = PolicyLossConfig(dual_clip=1.5, level="sequence")
    ours = [loss_and_grad(lambda x, c=c: policy_loss(x, adv, behavior_logprobs=behavior, mask=mask, config=c)[0], logp) for c in (token, sequence)]
    close(ours[0][0], ours[1][0])
    close(ours[0][1], ours[1][1])




def test_dr_grpo_end_to_end():
    # One group, rewards [1, 0, 0, 1]: mean 1/2, advantages [1/2, -1/2, -1/2, 1/2] (no std).
    # Lengths 1, 2, 3, 4 at ratio 1: token sums 1/2, -1, -3/2, 2; the loss is minus their
    # sum, -(1/2 - 1 - 3/2 + 2) = 0, over 4 * 8 (max_tokens). Gradient per token: -A / 32.
    adv = dr_grpo(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), [0, 0, 0, 0])
    close(adv, [0.5, -0.5, -0.5, 0.5])
    mask = (torch.arange(4)[None, :] < torch.tensor([1, 2, 3, 4])[:, None]).double()
    logp = torch.full((4, 4), -1.0, dtype=torch.float64, requires_grad=True)
    config = PolicyLossConfig(aggregation="token_sum_norm", max_tokens=8)
    loss, _ = policy_loss(logp, adv, behavior_logprobs=logp.detach(), mask=mask, config=config)
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, 0.0)
    close(grad, -adv[:, None] * mask / 32)


def test_gspo_with_decoupled_weight_and_cap():
    # Sequence 0 (2 tokens): log(prox / behavior) = [ln 4, 0] -> weight exp(ln 2) = 2, capped
    # at 1.5; log(policy / prox) = [0.1, -0.1] -> s = 1, A = 1: loss -1.5 on each token.
    # Sequence 1 (1 token): weight exp(ln 0.5) = 0.5; s = exp(0.2) = 1.2214, inside
    # [0.8, 1.28]; A = -2: loss -0.5 * (-2 * 1.2214) = 1.2214.
    # seq_mean_token_mean: (-1.5 + 1.2214) / 2; the sequence-level truncation is on the
    # two tokens of sequence 0: 2 / 3 of the tokens.
    s1 = math.exp(0.2)
    behavior = torch.tensor([[-2.0, -1.0], [-1.0, 0.0]], dtype=torch.float64)
    prox = behavior + torch.tensor([[LN(4), 0.0], [LN(0.5), 0.0]], dtype=torch.float64)
    logp = (prox + torch.tensor([[0.1, -0.1], [0.2, 0.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    config = PolicyLossConfig(level="sequence", aggregation="seq_mean_token_mean", tis_cap=1.5)
    loss, metrics = policy_loss(logp, torch.tensor([1.0, -2.0], dtype=torch.float64), behavior_logprobs=behavior, proximal_logprobs=prox, mask=mask, config=config)
    close(loss, (-1.5 + s1) / 2)
    assert metrics["tis_truncated_fraction"] == pytest.approx(2 / 3)
    # d/dlogp_0t of -1.5 * s0 / 2 with ds0/dlogp_0t = s0 / 2 = 1/2: -0.375.
    # d/dlogp_10 of 0.5 * 2 * s1 / 2 = s1 / 2.
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-0.375, -0.375], [s1 / 2, 0.0]])


def test_kl_term_on_a_ragged_batch_with_seq_mean_token_mean():
    # A = 0, so the loss is the KL term alone. k3 with d = ref - logp:
    # row 0, d = [ln 2, 0]: k3 = [2 - ln 2 - 1, 0], token mean (1 - ln 2) / 2;
    # row 1, d = [-ln 2] (+ padding, ref nan): k3 = 1/2 + ln 2 - 1.
    # seq_mean_token_mean, kl_coef 0.5: 0.5 * ((1 - ln 2) / 2 + ln 2 - 1/2) / 2.
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]], dtype=torch.float64)
    ref = logp + torch.tensor([[LN(2), 0.0], [-LN(2), math.nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    config = PolicyLossConfig(aggregation="seq_mean_token_mean", kl_coef=0.5)
    loss, metrics = policy_loss(logp, torch.zeros(2, dtype=torch.float64), behavior_logprobs=logp, mask=mask, ref_logprobs=ref, config=config)
    kl = ((1 - LN(2)) / 2 + LN(2) - 0.5) / 2
    close(loss, 0.5 * kl)
    assert metrics["kl"] == pytest.approx(kl, abs=1e-12)


def test_float_mask_weights_weigh_tokens():
    # Weights [1, 0.5] on values (ratio 1, per-token A = minus the value) [2, 4]:
    # token_mean (2 * 1 + 4 * 0.5) / 1.5 = 8/3.
    logp = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.5]], dtype=torch.float64)
    loss, _ = policy_loss(logp, torch.tensor([[-2.0, -4.0]], dtype=torch.float64), behavior_logprobs=logp, mask=mask)
    close(loss, 8 / 3)


@pytest.mark.parametrize(("estimator", "slope"), [("k1", lambda d: 1.0), ("k2", lambda d: -d), ("k3", lambda d: 1.0 - math.exp(d))])
def test_kl_in_the_loss_has_the_estimators_gradient(estimator, slope):
    # With d = ref - logp: d k1 / d logp = 1, d k2 / d logp = -d, d k3 / d logp = 1 - e^d
    # (k2's is the true gradient of KL(policy || ref) per sample; k1's and k3's are what
    # verl's "kl" and "low_var_kl" give in the loss). A = 0: the KL term alone, token mean
    # over 2 tokens with kl_coef 0.5 -> 0.25 * slope per token.
    ds = [LN(2), -0.5]
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = logp.detach() + torch.tensor([ds], dtype=torch.float64)
    config = PolicyLossConfig(kl_coef=0.5, kl_estimator=estimator)
    loss, _ = policy_loss(logp, torch.zeros(1, dtype=torch.float64), behavior_logprobs=logp.detach(), mask=torch.ones(1, 2), ref_logprobs=ref, config=config)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.25 * slope(d) for d in ds]])


def verl_reinforce_plus_plus_baseline(scores: torch.Tensor, index: list, response_mask: torch.Tensor) -> torch.Tensor:
    """verl `core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage` (token-level
    rewards summed to a score per row, each row's index its prompt), with `masked_whiten`."""
    scores = scores.clone()
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(scores[i])
    means = {g: (torch.tensor(0.0, dtype=scores.dtype) if len(v) == 1 else torch.mean(torch.stack(v))) for g, v in groups.items()}
    for i, g in enumerate(index):
        scores[i] = scores[i] - means[g]
    tiled = scores.unsqueeze(-1).tile([1, response_mask.shape[-1]]) * response_mask
    mean = (tiled * response_mask).sum() / response_mask.sum()
    var = ((tiled - mean) ** 2 * response_mask).sum() / response_mask.sum() * (response_mask.sum() / (response_mask.sum() - 1))
    return (tiled - mean) * torch.rsqrt(var + 1e-8) * response_mask


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_plus_plus_baseline_matches_verl(seed):
    from tidal.flow.algorithms import compute_advantages, token_whiten

    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (12,), generator=g).double()
    index = [k // 4 for k in range(12)]
    lengths = torch.randint(1, 9, (12,), generator=g)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).double()
    want = verl_reinforce_plus_plus_baseline(rewards, index, mask)
    got = token_whiten(compute_advantages("reinforce_plus_plus_baseline", rewards, index), lengths)
    close(got[:, None] * mask, want, tol=1e-10)


def test_token_whitening_leaves_a_batch_of_one_token_and_rows_without_tokens_alone():
    from tidal.flow.algorithms import token_whiten

    assert token_whiten(torch.tensor([0.5, 2.0]), torch.tensor([1, 0])).tolist() == [0.5, 2.0]
    out = token_whiten(torch.tensor([1.0, -1.0, 3.0]), torch.tensor([2, 2, 0]))
    assert out[2] == 3.0 and out[0] == -out[1] and out[0] > 0
