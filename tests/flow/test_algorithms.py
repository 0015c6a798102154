"""Advantage estimators and policy losses against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.flow.algorithms import (
    ADVANTAGES,
    PolicyLossConfig,
    aggregate,
    compute_advantages,
    dr_grpo,
    grpo,
    kl_estimate,
    masked_mean,
    policy_loss,
    rloo,
    sequence_keep,
)

EPS = 1e-6
LN = math.log


def f64(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, tol: float = 1e-12) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), expected, rtol=tol, atol=tol)


# Group a = rows 0, 2, 3, 5 with rewards [1, 0, 1, 1]; group b = rows 1, 4 with [0, 0].
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
GROUPS = ["a", "b", "a", "a", "b", "a"]


# --- advantages ---------------------------------------------------------------------------


def test_grpo_on_non_contiguous_groups():
    # a: mean 0.75, deviations [0.25, -0.75, 0.25, 0.25], squares sum to 3 * 0.0625 + 0.5625
    # = 0.75, unbiased var 0.75 / 3 = 0.25, std 0.5. b: all 0, std 0, advantage 0 / eps = 0.
    up, down = 0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS)
    close(grpo(REWARDS, GROUPS), [up, 0, down, up, 0, up])
    close(compute_advantages("grpo", REWARDS, GROUPS), [up, 0, down, up, 0, up])


def test_grpo_uses_the_unbiased_std_like_torch_std():
    rewards = torch.tensor([0.3, 2.0, -1.0, 0.7, 5.0], dtype=torch.float64)
    groups = torch.tensor([4, 9, 4, 9, 4])
    expected = torch.empty_like(rewards)
    for g in (4, 9):
        rows = groups == g
        expected[rows] = (rewards[rows] - rewards[rows].mean()) / (rewards[rows].std() + EPS)
    close(grpo(rewards, groups), expected)


def test_grpo_without_std_and_dr_grpo_subtract_the_group_mean():
    # a: mean 0.75 -> [0.25, -0.75, 0.25, 0.25]; b: mean 0 -> [0, 0].
    expected = [0.25, 0.0, -0.75, 0.25, 0.0, 0.25]
    close(grpo(REWARDS, GROUPS, normalize_std=False), expected)
    close(compute_advantages("grpo_no_std", REWARDS, GROUPS), expected)
    close(dr_grpo(REWARDS, GROUPS), expected)
    close(compute_advantages("dr_grpo", REWARDS, GROUPS), expected)


def test_rloo_subtracts_the_mean_of_the_other_rows():
    # a, row 0: 1 - mean(0, 1, 1) = 1/3; row 2: 0 - mean(1, 1, 1) = -1; rows 3, 5 like row 0.
    # b: 0 - 0 = 0.
    expected = [1 / 3, 0.0, -1.0, 1 / 3, 0.0, 1 / 3]
    close(rloo(REWARDS, GROUPS), expected)
    close(compute_advantages("rloo", REWARDS, GROUPS), expected)


def test_integer_tensor_groups_match_list_groups():
    ids = torch.tensor([10, -3, 10, 10, -3, 10])
    for name in ADVANTAGES:
        close(compute_advantages(name, REWARDS, ids), compute_advantages(name, REWARDS, GROUPS))
        close(compute_advantages(name, REWARDS, list(ids)), compute_advantages(name, REWARDS, GROUPS))  # 0-d tensors, by value
    with pytest.raises(ValueError, match=r"a tensor of shape \(1,\)"):
        compute_advantages("grpo", REWARDS, [torch.tensor([1])] * 6)


def test_a_group_of_one_row_gets_advantage_zero():
    # Row 0 is alone. Group 5 = rows 1, 2 with rewards [1, 2]: mean 1.5, deviations
    # [-0.5, 0.5], unbiased var 0.5 / 1, std sqrt(0.5); RLOO: 1 - 2 = -1 and 2 - 1 = 1.
    rewards = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([7, 5, 5])
    s = math.sqrt(0.5) + EPS
    close(grpo(rewards, groups), [0.0, -0.5 / s, 0.5 / s])
    close(grpo(rewards, groups, normalize_std=False), [0.0, -0.5, 0.5])
    close(rloo(rewards, groups), [0.0, -1.0, 1.0])
    close(dr_grpo(rewards, groups), [0.0, -0.5, 0.5])
    for name in ADVANTAGES:
        assert compute_advantages(name, rewards[:1], ["only"]).tolist() == [0.0]


def test_a_group_whose_rewards_are_all_equal_gets_advantage_exactly_zero():
    # In float32 eight rewards of 0.1 average to 0.1 plus a rounding step; GRPO divided that
    # by a std of the same size (-0.0074 for each row), RLOO and Dr.GRPO left 7e-9.
    rewards = torch.tensor([0.1] * 8 + [0.7] * 16 + [0.0, 1.0], dtype=torch.float32)
    groups = [0] * 8 + [1] * 16 + [2, 2]
    for name in ADVANTAGES:
        out = compute_advantages(name, rewards, groups)
        assert out[:24].tolist() == [0.0] * 24, name
        assert out[24] < 0 < out[25], name
    for eps in (0.0, 1e-6):  # eps=0: no 0 / 0 for a tied group or a lone row
        assert grpo(torch.tensor([0.3, 0.3, 5.0]), [0, 0, 1], eps=eps).tolist() == [0.0, 0.0, 0.0]


def test_advantages_keep_dtype_and_handle_float32():
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float32)
    out = grpo(rewards, [0, 0])
    assert out.dtype == torch.float32 and out.shape == (2,)
    # mean 0.5, unbiased std sqrt(0.5)
    close(out.double(), [0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)], tol=1e-6)


def test_rewards_near_float32s_range_do_not_overflow_the_group_sums():
    # Rewards a reward function may return (finite float32) summed to inf in float32: GRPO
    # gave NaN for every row, RLOO -inf.
    huge = torch.tensor([3e38, 2e38, 3.1e38, 2.5e38], dtype=torch.float32)
    for name in ADVANTAGES:
        out = compute_advantages(name, huge, [0, 0, 0, 0])
        expected = compute_advantages(name, huge.double(), [0, 0, 0, 0]).float()
        assert out.dtype == torch.float32 and torch.isfinite(out).all(), name
        close(out.double(), expected.double().tolist(), tol=1e-6 * 1e38)
    assert grpo(huge, [0, 0, 0, 0]).abs().max() < 2


def test_advantage_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"name='ppo'.*'dr_grpo', 'grpo', 'grpo_no_std', 'reinforce_plus_plus_baseline', 'rloo'"):
        compute_advantages("ppo", REWARDS, GROUPS)
    with pytest.raises(ValueError, match="groups has 2 ids but rewards has 6 rows"):
        rloo(REWARDS, ["a", "b"])
    with pytest.raises(ValueError, match="groups has 3 ids"):
        grpo(REWARDS, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="groups must be a 1-D integer tensor"):
        grpo(REWARDS, torch.zeros(6))
    with pytest.raises(ValueError, match="rewards must be a 1-D floating-point tensor"):
        grpo(REWARDS.reshape(2, 3), GROUPS)
    with pytest.raises(ValueError, match="rewards must be a 1-D floating-point tensor"):
        rloo(torch.tensor([1, 0]), [0, 0])


# --- aggregation --------------------------------------------------------------------------

# Lengths 3 and 1; the padding holds nan, which must not leak.
VALUES = f64([1.0, 2.0, 3.0], [4.0, math.nan, math.nan])
RAGGED = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


def test_aggregations_on_a_ragged_mask():
    close(aggregate(VALUES, RAGGED, how="token_mean"), (1 + 2 + 3 + 4) / 4)  # 2.5
    close(aggregate(VALUES, RAGGED, how="seq_mean_token_mean"), ((1 + 2 + 3) / 3 + 4 / 1) / 2)  # 3
    close(aggregate(VALUES, RAGGED, how="seq_mean_token_sum"), ((1 + 2 + 3) + 4) / 2)  # 5
    close(aggregate(VALUES, RAGGED, how="token_sum_norm", max_tokens=4), (1 + 2 + 3 + 4) / (2 * 4))  # 1.25
    close(aggregate(VALUES, RAGGED.double(), how="token_mean"), 2.5)


def test_aggregations_skip_empty_rows_except_the_constant_norm():
    values = torch.cat([VALUES, f64([7.0, 7.0, 7.0])])
    mask = torch.cat([RAGGED, torch.zeros(1, 3, dtype=torch.bool)])
    close(aggregate(values, mask, how="token_mean"), 2.5)
    close(aggregate(values, mask, how="seq_mean_token_mean"), 3.0)
    close(aggregate(values, mask, how="seq_mean_token_sum"), 5.0)
    close(aggregate(values, mask, how="token_sum_norm", max_tokens=4), 10 / (3 * 4))
    close(aggregate(values, torch.zeros_like(mask), how="seq_mean_token_mean"), 0.0)


def test_masked_mean_along_a_dim():
    close(masked_mean(VALUES, RAGGED, dim=-1), [2.0, 4.0])
    close(masked_mean(VALUES, RAGGED), 2.5)


def test_aggregate_errors_name_the_argument():
    with pytest.raises(ValueError, match="how='mean'"):
        aggregate(VALUES, RAGGED, how="mean")
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(VALUES, RAGGED, how="token_sum_norm")
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(VALUES, RAGGED[:, :2], how="token_mean")


# --- KL -----------------------------------------------------------------------------------


def test_kl_estimators():
    # logp = ln 0.5, ref = ln 0.25, d = ref - logp = -ln 2.
    # k1 = -d = ln 2; k2 = d^2 / 2 = (ln 2)^2 / 2; k3 = e^d - d - 1 = 0.5 + ln 2 - 1.
    logp, ref = f64([LN(0.5)]), f64([LN(0.25)])
    expected = {"k1": LN(2), "k2": 0.5 * LN(2) ** 2, "k3": LN(2) - 0.5}
    for name, value in expected.items():
        close(kl_estimate(logp, ref, estimator=name), [[value]])
        # With a zero advantage the policy term is 0 and the loss is kl_coef * estimate.
        config = PolicyLossConfig(kl_coef=0.1, kl_estimator=name)
        loss, metrics = policy_loss(logp, f64(0.0), behavior_logprobs=logp, mask=torch.ones(1, 1), ref_logprobs=ref, config=config)
        close(loss, 0.1 * value)
        assert metrics["kl"] == pytest.approx(value, abs=1e-12)
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_estimate(logp, ref, estimator="k4")


def test_kl_is_reported_only_with_a_reference():
    logp = f64([-1.0, -2.0])
    _, metrics = policy_loss(logp, f64(1.0), behavior_logprobs=logp, mask=torch.ones(1, 2))
    assert "kl" not in metrics
    _, metrics = policy_loss(logp, f64(1.0), behavior_logprobs=logp, mask=torch.ones(1, 2), ref_logprobs=logp)
    assert metrics["kl"] == 0.0


# --- policy loss --------------------------------------------------------------------------

# Five tokens with ratios and advantages, symmetric clip 0.2 -> ratio range [0.8, 1.2]:
#   r=1.5, A=+1: min(1.5, 1.2) = 1.2    clipped      loss -1.2
#   r=0.5, A=-1: min(-0.5, -0.8) = -0.8  clipped      loss +0.8
#   r=1.1, A=+1: min(1.1, 1.1) = 1.1    not clipped  loss -1.1
#   r=0.7, A=+1: min(0.7, 0.8) = 0.7    not clipped  loss -0.7
#   r=1.5, A=-1: min(-1.5, -1.2) = -1.5  not clipped  loss +1.5
# token mean: (-1.2 + 0.8 - 1.1 - 0.7 + 1.5) / 5 = -0.14; clip fraction 2 / 5.
RATIOS = [1.5, 0.5, 1.1, 0.7, 1.5]
SIGNS = [1.0, -1.0, 1.0, 1.0, -1.0]
SYMMETRIC = PolicyLossConfig(clip_low=0.2, clip_high=0.2)


def test_plain_ppo_clips_only_where_the_clipped_term_is_smaller():
    logprobs = f64([LN(r) for r in RATIOS])
    behavior = torch.zeros(1, 5, dtype=torch.float64)
    loss, metrics = policy_loss(logprobs, f64(SIGNS), behavior_logprobs=behavior, mask=torch.ones(1, 5), config=SYMMETRIC)
    close(loss, -0.14)
    assert metrics["clip_fraction"] == pytest.approx(0.4)
    assert metrics["ratio_mean"] == pytest.approx(sum(RATIOS) / 5)
    assert metrics["approx_kl"] == pytest.approx(-sum(LN(r) for r in RATIOS) / 5)
    assert metrics["tis_truncated_fraction"] == 0.0 and metrics["seq_masked_fraction"] == 0.0


def test_per_sequence_advantages_broadcast_over_tokens():
    # The same five tokens as five one-token sequences with advantages [batch].
    logprobs = f64(*[[LN(r)] for r in RATIOS])
    advantages, behavior = torch.tensor(SIGNS, dtype=torch.float64), torch.zeros(5, 1, dtype=torch.float64)
    loss, metrics = policy_loss(logprobs, advantages, behavior_logprobs=behavior, mask=torch.ones(5, 1), config=SYMMETRIC)
    close(loss, -0.14)
    assert metrics["clip_fraction"] == pytest.approx(0.4)


def test_gradient_is_zero_on_clipped_and_masked_tokens():
    # A sixth, masked token holds padding garbage (behavior -inf): it must not reach the loss.
    logprobs = f64([LN(r) for r in RATIOS] + [0.0]).requires_grad_()
    behavior = f64([0.0] * 5 + [-math.inf])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, _ = policy_loss(logprobs, f64(SIGNS + [1.0]), behavior_logprobs=behavior, mask=mask, config=SYMMETRIC)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # d(-r * A / 5) / d(log r) = -r * A / 5 on unclipped tokens; 0 on clipped and masked ones.
    close(loss, -0.14)
    close(grad, [[0.0, 0.0, -1.1 / 5, -0.7 / 5, 1.5 / 5, 0.0]])


def test_asymmetric_clip_higher():
    # r = 1.25, A = 1: inside [0.8, 1.28] with clip_high 0.28 -> loss -1.25, not clipped;
    # outside [0.8, 1.2] with clip_high 0.2 -> loss -1.2, clipped.
    logprobs, behavior, one = f64([LN(1.25)]), f64([0.0]), torch.ones(1, 1)
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.28)
    loss, metrics = policy_loss(logprobs, f64(1.0), behavior_logprobs=behavior, mask=one, config=config)
    close(loss, -1.25)
    assert metrics["clip_fraction"] == 0.0
    config = PolicyLossConfig(clip_low=0.2, clip_high=0.2)
    loss, metrics = policy_loss(logprobs, f64(1.0), behavior_logprobs=behavior, mask=one, config=config)
    close(loss, -1.2)
    assert metrics["clip_fraction"] == 1.0


def test_decoupled_ppo_weights_by_proximal_over_behavior():
    # policy 0.6, proximal 0.5, behavior 0.25: ratio 0.6 / 0.5 = 1.2 (inside [0.8, 1.28]),
    # weight 0.5 / 0.25 = 2, A = 1 -> loss -2 * 1.2 = -2.4, gradient -2 * 1.2 (weight detached).
    logprobs = f64([LN(0.6)]).requires_grad_()
    proximal = f64([LN(0.5)]).requires_grad_()
    behavior, one = f64([LN(0.25)]), torch.ones(1, 1)
    loss, metrics = policy_loss(logprobs, f64(1.0), behavior_logprobs=behavior, proximal_logprobs=proximal, mask=one)
    close(loss, -2.4)
    assert metrics["ratio_mean"] == pytest.approx(1.2)
    assert metrics["approx_kl"] == pytest.approx(LN(0.5) - LN(0.6))
    grad_logprobs, grad_proximal = torch.autograd.grad(loss, [logprobs, proximal], allow_unused=True)
    close(grad_logprobs, [[-2.4]])
    assert grad_proximal is None or torch.all(grad_proximal == 0)
    # Plain PPO on the same sample: ratio 0.6 / 0.25 = 2.4, clipped at 1.28 -> loss -1.28.
    loss, metrics = policy_loss(logprobs, f64(1.0), behavior_logprobs=behavior, mask=one)
    close(loss, -1.28)
    assert metrics["clip_fraction"] == 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_proximal_is_policy_equals_passing_the_detached_logprobs(level):
    # One optimizer step per batch: the proximal policy is the trained one before the step,
    # so `proximal_is_policy` must be exactly `proximal_logprobs=logprobs.detach()`.
    torch.manual_seed(0)
    logprobs = (-torch.rand(3, 4, dtype=torch.float64) * 3).requires_grad_()
    behavior = logprobs.detach() + 0.3 * torch.randn(3, 4, dtype=torch.float64)  # another version sampled them
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    advantages = f64(1.0, -0.5, 2.0).reshape(3)
    for tis_cap in (None, 1.2):
        given = PolicyLossConfig(level=level, tis_cap=tis_cap, seq_mask_high=1.5)
        own = PolicyLossConfig(level=level, tis_cap=tis_cap, seq_mask_high=1.5, proximal_is_policy=True)
        expected, expected_metrics = policy_loss(logprobs, advantages, behavior_logprobs=behavior, proximal_logprobs=logprobs.detach(), mask=mask, config=given)
        actual, actual_metrics = policy_loss(logprobs, advantages, behavior_logprobs=behavior, mask=mask, config=own)
        assert torch.equal(actual, expected) and actual_metrics == expected_metrics
        assert torch.equal(*(torch.autograd.grad(x, logprobs)[0] for x in (actual, expected)))
        assert actual_metrics["ratio_mean"] == 1.0 and actual_metrics["clip_fraction"] == 0.0
    # Without it, a None proximal still means plain PPO (behavior is proximal).
    plain, _ = policy_loss(logprobs, advantages, behavior_logprobs=behavior, mask=mask)
    assert not torch.equal(plain, actual)


def test_truncated_importance_sampling_caps_the_behavior_weight():
    # Token 0: ratio 1.2, weight 2 capped at 1.5 -> -1.5 * 1.2 = -1.8 (truncated).
    # Token 1: ratio 1, weight 1 -> -1 (not truncated). Token mean (-1.8 - 1) / 2 = -1.4.
    logprobs = f64([LN(0.6), LN(0.5)])
    proximal = f64([LN(0.5), LN(0.5)])
    behavior = f64([LN(0.25), LN(0.5)])
    config = PolicyLossConfig(tis_cap=1.5)
    mask = torch.ones(1, 2)
    loss, metrics = policy_loss(logprobs, f64(1.0), behavior_logprobs=behavior, proximal_logprobs=proximal, mask=mask, config=config)
    close(loss, -1.4)
    assert metrics["tis_truncated_fraction"] == 0.5
    # Without decoupling the weight is exp(behavior - behavior) = 1: below the cap, no change.
    loss, metrics = policy_loss(proximal, f64(1.0), behavior_logprobs=proximal, mask=mask, config=config)
    close(loss, -1.0)
    assert metrics["tis_truncated_fraction"] == 0.0


def test_sequence_masking_drops_a_sequence():
    # Sequence 0: proximal - behavior = ln 2 on its one real token (the padded second token
    # holds ln 1000, which the masked mean ignores) -> geometric mean ratio 2, outside
    # [0.5, 1.5]: dropped. Sequence 1: proximal = behavior, ratio 1: kept.
    # logprobs = proximal, so every PPO ratio is 1; sequence 1's tokens cost -1 * 1 * A = -1.
    proximal = f64([LN(2), LN(1000)], [-1.0, -2.0]).requires_grad_()
    behavior = f64([0.0, 0.0], [-1.0, -2.0])
    logprobs = proximal.detach().clone().requires_grad_()
    mask = torch.tensor([[1, 0], [1, 1]])
    advantages = f64(5.0, 1.0)
    config = PolicyLossConfig(seq_mask_low=0.5, seq_mask_high=1.5)
    loss, metrics = policy_loss(logprobs, advantages, behavior_logprobs=behavior, proximal_logprobs=proximal, mask=mask, config=config)
    close(loss, -1.0)
    assert metrics["seq_masked_fraction"] == 0.5
    assert metrics["ratio_mean"] == 1.0
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[0.0, 0.0], [-0.5, -0.5]])
    # Unmasked, sequence 0 costs -2 (weight) * 1 * 5 = -10 on its one token: (-10 - 1 - 1) / 3.
    loss, metrics = policy_loss(logprobs, advantages, behavior_logprobs=behavior, proximal_logprobs=proximal, mask=mask)
    close(loss, -4.0)
    assert metrics["seq_masked_fraction"] == 0.0
    # One bound is enough: ratio 2 is above 1.5; ratio 1 is not below 0.9.
    for bounds in ({"seq_mask_high": 1.5}, {"seq_mask_low": 0.9}):
        config = PolicyLossConfig(**bounds)
        _, metrics = policy_loss(logprobs, advantages, behavior_logprobs=behavior, proximal_logprobs=proximal, mask=mask, config=config)
        assert metrics["seq_masked_fraction"] == (0.5 if "seq_mask_high" in bounds else 0.0)


def test_gspo_uses_one_ratio_per_sequence():
    # Sequence 0: token log-ratios [0.1, 0.3] (+ padding) -> s = exp(0.2) = 1.2214, inside
    # [0.8, 1.28]: loss -s on each of its 2 tokens, gradient -s / (its 2 tokens) through each.
    # Sequence 1: one token, log-ratio 0.5 -> s = exp(0.5) = 1.6487 > 1.28: clipped, loss -1.28.
    s0 = math.exp(0.2)
    logprobs = f64([0.1, 0.3, 0.0], [0.5, 0.0, 0.0]).requires_grad_()
    behavior = torch.zeros(2, 3, dtype=torch.float64)
    behavior[0, 2] = math.nan
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    config = PolicyLossConfig(level="sequence", aggregation="token_mean")
    loss, metrics = policy_loss(logprobs, f64(1.0, 1.0), behavior_logprobs=behavior, mask=mask, config=config)
    close(loss, (-s0 - s0 - 1.28) / 3)  # token mean over 3 response tokens
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx((2 * s0 + math.exp(0.5)) / 3)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # d(token mean) / d logp_0t = (2 / 3) * d(-s0) / d logp_0t = (2 / 3) * (-s0 / 2) = -s0 / 3.
    close(grad, [[-s0 / 3, -s0 / 3, 0.0], [0.0, 0.0, 0.0]])
    # The GSPO paper's form: the mean over sequences.
    config = PolicyLossConfig(level="sequence", aggregation="seq_mean_token_mean")
    loss, _ = policy_loss(logprobs, f64([1.0, 1.0, 9.0], [1.0, 9.0, 9.0]), behavior_logprobs=behavior, mask=mask, config=config)
    close(loss, (-s0 - 1.28) / 2)  # [batch, seq] advantages reduce to their masked mean, 1


def test_aggregation_modes_reach_policy_loss():
    # Ratio 1 everywhere, per-token advantages = minus the values, so each token costs its value.
    logprobs = torch.zeros(2, 3, dtype=torch.float64)
    advantages = -torch.nan_to_num(VALUES)
    expected = {"token_mean": 2.5, "seq_mean_token_mean": 3.0, "seq_mean_token_sum": 5.0, "token_sum_norm": 1.25}
    for how, value in expected.items():
        config = PolicyLossConfig(aggregation=how, max_tokens=4)
        loss, _ = policy_loss(logprobs, advantages, behavior_logprobs=logprobs, mask=RAGGED, config=config)
        close(loss, value)


def test_policy_loss_errors_name_the_argument():
    logp, adv, mask = torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(logp, adv, behavior_logprobs=logp, mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="behavior_logprobs has shape"):
        policy_loss(logp, adv, behavior_logprobs=torch.zeros(3, 3), mask=mask)
    with pytest.raises(ValueError, match="proximal_logprobs has shape"):
        policy_loss(logp, adv, behavior_logprobs=logp, proximal_logprobs=torch.zeros(2), mask=mask)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logp, torch.zeros(3), behavior_logprobs=logp, mask=mask)
    with pytest.raises(ValueError, match="logprobs must be"):
        policy_loss(torch.zeros(6), adv, behavior_logprobs=logp, mask=mask)
    with pytest.raises(ValueError, match="ref_logprobs is required when kl_coef > 0"):
        policy_loss(logp, adv, behavior_logprobs=logp, mask=mask, config=PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        policy_loss(logp, adv, behavior_logprobs=logp, mask=mask, ref_logprobs=torch.zeros(2, 2))


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"aggregation": "sum"}, "aggregation"),
        ({"aggregation": "token_sum_norm"}, "max_tokens"),
        ({"level": "group"}, "level"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"seq_mask_low": 2.0, "seq_mask_high": 1.0}, "seq_mask_low"),
        ({"seq_mask_high": 0.0}, "seq_mask_high"),  # dropped every sequence, the loss silently 0
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),  # at 1 it would cut into the clip range
        ({"dual_clip": 0.5}, "dual_clip must be > 1"),
        ({"dual_clip": math.nan}, "dual_clip must be a number"),
        # nan passes every comparison: a nan seq_mask_low dropped every sequence (loss 0),
        # a nan clip_high made the loss nan
        *(({name: math.nan}, f"{name} must be a number, got nan") for name in ("clip_high", "tis_cap", "seq_mask_low", "seq_mask_high", "kl_coef")),
    ],
)
def test_config_errors_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        PolicyLossConfig(**fields)


def test_config_is_checked_again_when_used():
    config = PolicyLossConfig()
    config.aggregation = "sum"
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1), behavior_logprobs=torch.zeros(1, 1), mask=torch.ones(1, 1), config=config)


def test_sequence_keep_is_policy_losss_own_decision():
    # row means of (proximal - behavior) over the mask: 0, ln 2, -ln 4 -> weights 1, 2, 0.25;
    # the padding of row 0 (nan) is outside the mask and never counts.
    prox = torch.tensor([[0.3, -0.3, float("nan")], [math.log(2), math.log(2), 0.0], [-math.log(4), 0.0, 0.0]])
    behavior = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    keep = sequence_keep(prox, behavior, mask, low=0.5, high=1.5)
    assert keep.tolist() == [True, False, False]
    assert sequence_keep(prox, behavior, mask, low=None, high=None).tolist() == [True, True, True]
    _, metrics = policy_loss(torch.zeros(3, 3), torch.ones(3), behavior_logprobs=behavior, mask=mask, proximal_logprobs=prox, config=PolicyLossConfig(seq_mask_low=0.5, seq_mask_high=1.5))
    assert metrics["seq_masked_fraction"] == pytest.approx(2 / 3)


def test_k3_is_bounded_as_verls_low_var_kl_so_a_far_token_loses_no_step():
    """d = ref - logp = 100: e^d overflows float32, and the loss and its gradient were inf
    (the engine then skipped the step). Clamped as verl clamps it: the estimate is 10 and
    that token passes no gradient; a token within the bounds keeps its exact value."""
    logp = torch.tensor([[-101.0, LN(0.5)]], dtype=torch.float32, requires_grad=True)
    ref = torch.tensor([[-1.0, LN(0.25)]], dtype=torch.float32)
    estimate = kl_estimate(logp, ref, estimator="k3")
    assert estimate[0, 0].item() == 10.0 and estimate[0, 1].item() == pytest.approx(LN(2) - 0.5)
    config = PolicyLossConfig(kl_coef=0.1)
    loss, _ = policy_loss(logp, torch.zeros(1), behavior_logprobs=logp.detach(), mask=torch.ones(1, 2), ref_logprobs=ref, config=config)
    loss.backward()
    assert torch.isfinite(loss) and logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(0.1 * (1 - 0.5) / 2)
    # the policy far above the reference (d = -50): bounded too; d = -5 is within the bounds
    assert kl_estimate(torch.tensor([0.0, 0.0]), torch.tensor([-50.0, -5.0]), estimator="k3").tolist() == pytest.approx([10.0, math.exp(-5) + 5 - 1])
