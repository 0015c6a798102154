"""Numerics of the advantage estimators and the policy loss: failed rewards, overflowing
ratios and weights, half-precision inputs, empty batches."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.flow.algorithms import ADVANTAGES, PolicyLossConfig, aggregate, compute_advantages, grpo, policy_loss, rloo, sequence_keep

LN = math.log
NAN, INF = math.nan, math.inf


def close(actual, expected, tol: float = 1e-12) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), expected, rtol=tol, atol=tol)


# --- failed rewards -----------------------------------------------------------------------


def test_a_failed_reward_is_left_out_of_its_group_and_gets_advantage_zero():
    # Group 0 = rows 0..3 with row 1 failed (NaN): the others, [1, 0, 1], are scored as a
    # group of three: mean 2/3, deviations [1/3, -2/3, 1/3], unbiased var (1/9 + 4/9 + 1/9) / 2
    # = 1/3. RLOO: 1 - mean(0, 1) = 1/2, 0 - mean(1, 1) = -1. Group 1 (rows 4, 5) is untouched.
    # GRPO gave the whole of group 0 advantage 0; RLOO and Dr.GRPO gave it NaN, which made
    # the step's loss NaN (and every other group's signal was lost with it).
    rewards = torch.tensor([1.0, NAN, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    groups = [0, 0, 0, 0, 1, 1]
    std0, std1 = math.sqrt(1 / 3) + 1e-6, math.sqrt(0.5) + 1e-6
    close(grpo(rewards, groups), [1 / 3 / std0, 0.0, -2 / 3 / std0, 1 / 3 / std0, -0.5 / std1, 0.5 / std1])
    close(grpo(rewards, groups, normalize_std=False), [1 / 3, 0.0, -2 / 3, 1 / 3, -0.5, 0.5])
    close(compute_advantages("dr_grpo", rewards, groups), [1 / 3, 0.0, -2 / 3, 1 / 3, -0.5, 0.5])
    close(rloo(rewards, groups), [0.5, 0.0, -1.0, 0.5, -1.0, 1.0])


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_failed_rewards_never_give_nan_and_count_as_absent(name):
    # An infinity is a failed reward too (the reward functions flag it so); a group left with
    # one scored row, or none, has no baseline: advantage 0. The scored rows of a group with
    # a failed row get what they get without that row.
    rewards = torch.tensor([INF, 2.0, NAN, NAN, -INF, 0.0, 1.0], dtype=torch.float32)
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    out = compute_advantages(name, rewards, groups)
    assert out.dtype == torch.float32 and torch.isfinite(out).all(), out
    assert out[:5].tolist() == [0.0] * 5
    close(out[5:], compute_advantages(name, rewards[5:], [2, 2]), tol=1e-6)


# --- overflowing ratios and weights -------------------------------------------------------


def test_an_overflowing_ratio_on_a_clipped_token_has_gradient_zero_not_nan():
    # Token 0: log-ratio 100 (behavior -100.1, a token the sampler barely chose): exp overflows
    # float32. With A = +1 its clipped term 1.28 is selected: loss -1.28 and gradient 0, as for
    # any clipped token; exp's backward gave 0 * inf = NaN for the whole step.
    # Token 1: ratio 1, loss -1, gradient -1 / 2 under the token mean.
    logprobs = torch.tensor([[-0.1, -0.2]], requires_grad=True)
    behavior = torch.tensor([[-100.1, -0.2]])
    loss, metrics = policy_loss(logprobs, torch.tensor([1.0]), behavior_logprobs=behavior, mask=torch.ones(1, 2))
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(loss, (-1.28 - 1.0) / 2, tol=1e-6)
    close(grad, [[0.0, -0.5]], tol=1e-6)
    assert metrics["clip_fraction"] == 0.5


def test_a_zero_advantage_token_costs_zero_whatever_its_ratio_or_weight():
    # Token 0 has A = 0 and a ratio (and, decoupled, a behavior weight) that overflows:
    # inf * 0 made the loss NaN. Token 1: ratio 1, weight 1, A = 1: loss -1, mean -1/2.
    logprobs = torch.tensor([[-0.1, -0.2]], requires_grad=True)
    behavior = torch.tensor([[-100.1, -0.2]])
    advantages = torch.tensor([[0.0, 1.0]])
    for proximal in (None, logprobs.detach()):
        loss, _ = policy_loss(logprobs, advantages, behavior_logprobs=behavior, proximal_logprobs=proximal, mask=torch.ones(1, 2))
        (grad,) = torch.autograd.grad(loss, logprobs)
        close(loss, -0.5, tol=1e-6)
        close(grad, [[0.0, -0.5]], tol=1e-6)


def test_gspo_with_an_overflowing_sequence_ratio_is_finite_where_clipped():
    # Sequence 0: log-ratios [100, 100] -> s = e^100 (inf in float32), A = +1: clipped at 1.28.
    # Sequence 1: s = 1, A = 1: loss -1 on its token. seq_mean_token_mean: (-1.28 - 1) / 2.
    logprobs = torch.tensor([[-0.1, -0.1], [-0.5, 0.0]], requires_grad=True)
    behavior = torch.tensor([[-100.1, -100.1], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    config = PolicyLossConfig(level="sequence", aggregation="seq_mean_token_mean")
    loss, _ = policy_loss(logprobs, torch.tensor([1.0, 1.0]), behavior_logprobs=behavior, mask=mask, config=config)
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(loss, (-1.28 - 1.0) / 2, tol=1e-6)
    close(grad, [[0.0, 0.0], [-0.5, 0.0]], tol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_dual_clip_bounds_an_overflowing_ratio_of_a_negative_advantage(level):
    # Row 0: log-ratio 100 (e^100 is inf in float32) with A = -1. Without dual-clip its
    # unclipped term is selected and the loss is inf, as documented; with c = 3 the loss is
    # 3 and its gradient 0, not NaN (the bound is taken in log space, before exp). Row 1:
    # ratio 1, A = 1: loss -1, gradient -1 / 2 under the token mean. (3 - 1) / 2 = 1.
    logprobs = torch.tensor([[-0.1], [-0.2]], requires_grad=True)
    behavior = torch.tensor([[-100.1], [-0.2]])
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2, 1)
    loss, metrics = policy_loss(logprobs, adv, behavior_logprobs=behavior, mask=mask, config=PolicyLossConfig(level=level, dual_clip=3.0))
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(loss, 1.0, tol=1e-6)
    close(grad, [[0.0], [-0.5]], tol=1e-6)
    assert metrics["dual_clip_fraction"] == 0.5 and metrics["clip_fraction"] == 0.0
    unbounded, _ = policy_loss(logprobs.detach(), adv, behavior_logprobs=behavior, mask=mask, config=PolicyLossConfig(level=level))
    assert unbounded.item() == INF


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_nan_advantage_reaches_the_gradient_under_dual_clip(level):
    # As without dual-clip (test below): the bound must not pass back 0 for a NaN advantage.
    logprobs = torch.full((2, 3), 2.0, requires_grad=True)  # ratio e^2 > c: dual-clipped were A < 0
    loss, _ = policy_loss(logprobs, torch.tensor([-1.0, math.nan]), behavior_logprobs=torch.zeros(2, 3), mask=torch.ones(2, 3), config=PolicyLossConfig(level=level, dual_clip=3.0))
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(logprobs.grad[1]).all()


# --- half-precision inputs ----------------------------------------------------------------


def test_fp16_inputs_are_computed_in_float32():
    # log-ratio 11.5 with A = -1: the unclipped term r = e^11.5 = 98715 is selected. It
    # overflows float16 (max 65504), which made the loss inf (and the step was skipped); in
    # float32 the loss is (r + 1) / 2 and token 0's gradient -A * r / 2, which float16 holds.
    logprobs = torch.tensor([[-0.1, -0.2]], dtype=torch.float16, requires_grad=True)
    behavior = torch.tensor([[-11.6, -0.2]], dtype=torch.float16)
    loss, metrics = policy_loss(logprobs, torch.tensor([-1.0]), behavior_logprobs=behavior, mask=torch.ones(1, 2))
    ratio = math.exp(logprobs[0, 0].item() - behavior[0, 0].item())
    assert loss.dtype == torch.float32
    close(loss, (ratio + 1.0) / 2, tol=1e-3)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.dtype == torch.float16
    close(grad.double(), [[ratio / 2, 0.5]], tol=ratio * 1e-3)
    assert metrics["ratio_mean"] == pytest.approx((ratio + 1.0) / 2, rel=1e-5)


def test_bf16_inputs_keep_float32_advantages():
    # A = 0.3 on 1001 tokens at ratio 1: loss -0.3. In bfloat16 the advantage was rounded to
    # 0.30078 and the token count to 1000, and the loss came back as bfloat16 -0.3027.
    logprobs = torch.full((1, 1001), -0.5, dtype=torch.bfloat16)
    loss, _ = policy_loss(logprobs, torch.tensor([0.3]), behavior_logprobs=logprobs, mask=torch.ones(1, 1001))
    assert loss.dtype == torch.float32
    close(loss, -0.3, tol=1e-6)


# --- empty batches ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"])
def test_an_empty_batch_aggregates_to_zero(how):
    # "0 when no token is in the mask": token_sum_norm divided by batch * max_tokens = 0 (NaN).
    assert aggregate(torch.zeros(0, 3), torch.zeros(0, 3), how=how, max_tokens=4).item() == 0.0


def test_a_batch_with_every_token_masked_has_loss_and_gradient_zero():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behavior = torch.tensor([[NAN, -INF]])  # padding garbage
    for level in ("token", "sequence"):
        loss, metrics = policy_loss(logprobs, torch.tensor([1.0]), behavior_logprobs=behavior, mask=torch.zeros(1, 2), config=PolicyLossConfig(level=level))
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert loss.item() == 0.0 and grad.tolist() == [[0.0, 0.0]]
        assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_sequence_keep_decides_bf16_inputs_as_policy_loss_does():
    # A train engine decides sequence masking for the whole batch with `sequence_keep` and
    # policy_loss must agree with it. Eight sequences of 300 tokens whose geometric-mean
    # weight is near the bound 1.5: summed in bfloat16, row 4's mean came out on the other
    # side of the bound than in float32, where policy_loss computes.
    g = torch.Generator().manual_seed(0)
    prox = (torch.randn(8, 300, generator=g) * 0.05 + 0.4).bfloat16()
    behavior, mask = torch.zeros(8, 300, dtype=torch.bfloat16), torch.ones(8, 300)
    keep = sequence_keep(prox, behavior, mask, low=None, high=1.5)
    assert keep.tolist() == sequence_keep(prox.float(), behavior.float(), mask, low=None, high=1.5).tolist()
    assert not keep.all()  # the bound is inside the rows' spread
    _, metrics = policy_loss(prox, torch.ones(8), behavior_logprobs=behavior, proximal_logprobs=prox, mask=mask, config=PolicyLossConfig(seq_mask_high=1.5))
    assert metrics["seq_masked_fraction"] == pytest.approx(float((~keep).sum()) / 8)


@pytest.mark.parametrize("log_ratio", [-1.0, 0.0, 1.0])
def test_a_nan_advantage_reaches_the_gradient_clipped_or_not(log_ratio):
    """A NaN advantage is a fault upstream: its NaN must reach the gradient, so the train
    engine's non-finite guard skips the step. Computing the clip as a clamp passed back 0
    on a clipped token (log_ratio -1 or 1 here), and the step went on without the row."""
    logprobs = torch.full((2, 3), log_ratio, requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.tensor([1.0, math.nan]), behavior_logprobs=torch.zeros(2, 3), mask=torch.ones(2, 3), config=PolicyLossConfig())
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(logprobs.grad[1]).all()
