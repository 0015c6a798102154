"""The entropy of next-token distributions and the entropy bonus of `policy_loss`, against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.flow.algorithms import PolicyLossConfig, losses, policy_loss, token_entropy


def test_token_entropy_of_known_distributions():
    uniform = torch.log_softmax(torch.zeros(2, 3, 4), dim=-1)
    assert torch.allclose(token_entropy(uniform), torch.full((2, 3), math.log(4)))
    two = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    assert token_entropy(two).item() == pytest.approx(0.5 * math.log(2) + 2 * 0.25 * math.log(4))


def test_a_zero_probability_adds_nothing_and_no_nan_to_the_gradient():
    logits = torch.tensor([[0.0, 0.0, -math.inf]], requires_grad=True)
    entropy = token_entropy(torch.log_softmax(logits, dim=-1))
    assert entropy.item() == pytest.approx(math.log(2))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_the_metric_path_is_chunked_detached_and_equal(monkeypatch):
    logprobs = torch.log_softmax(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)), dim=-1).requires_grad_()
    whole = token_entropy(logprobs)
    monkeypatch.setattr(losses, "ENTROPY_CHUNK", 14)  # 2 positions of 7 values each: 15 positions in 8 chunks
    chunked = token_entropy(logprobs, grad=False)
    assert not chunked.requires_grad and chunked.shape == (3, 5)
    torch.testing.assert_close(chunked, whole.detach())
    assert token_entropy(torch.zeros(0, 4), grad=False).shape == (0,)


def test_the_metric_path_takes_a_single_distribution_like_the_bonus_path():
    """`[..., vocab]` with no leading dimension: the chunked path flattened dimension -2,
    which a 1-D tensor does not have, and raised where the gradient path gave a scalar."""
    two = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    entropy = token_entropy(two, grad=False)
    assert entropy.shape == () and entropy.item() == pytest.approx(1.5 * math.log(2))


def _inputs():
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(2, 4, generator=g) - 0.1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    entropy = torch.rand(2, 4, generator=g) + 0.5
    return logprobs, torch.tensor([1.0, -1.0]), mask, entropy


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_bonus_subtracts_coef_times_the_aggregated_entropy(aggregation):
    logprobs, adv, mask, entropy = _inputs()
    entropy[1, 3] = math.nan  # padding: reaches neither loss nor metric
    base, _ = policy_loss(logprobs, adv, behavior_logprobs=logprobs, mask=mask, config=PolicyLossConfig(aggregation=aggregation))
    with_bonus, metrics = policy_loss(logprobs, adv, behavior_logprobs=logprobs, mask=mask, entropy=entropy, config=PolicyLossConfig(aggregation=aggregation, entropy_coef=0.1))
    e = entropy.nan_to_num(0)
    by_hand = (e * mask).sum() / 5 if aggregation == "token_mean" else ((e[0, :3].sum() / 3) + (e[1, :2].sum() / 2)) / 2
    assert with_bonus.item() == pytest.approx(base.item() - 0.1 * by_hand.item())
    assert metrics["entropy"] == pytest.approx(((e * mask).sum() / 5).item())


def test_the_bonus_gradient_raises_the_entropy_and_a_zero_coef_only_reports_it():
    logprobs, adv, mask, _ = _inputs()
    logits = torch.tensor([[2.0, 0.0, -1.0]] * 8).view(2, 4, 3).requires_grad_()
    entropy = token_entropy(torch.log_softmax(logits, dim=-1))
    loss, _ = policy_loss(logprobs, torch.zeros(2), behavior_logprobs=logprobs, mask=mask, entropy=entropy, config=PolicyLossConfig(entropy_coef=1.0))
    loss.backward()
    step = logits - 0.1 * logits.grad  # descending the loss ascends the entropy, on loss tokens only
    after = token_entropy(torch.log_softmax(step, dim=-1))
    assert (after[mask != 0] > entropy[mask != 0]).all() and torch.equal(after[mask == 0], entropy[mask == 0].detach())
    _, metrics = policy_loss(logprobs, adv, behavior_logprobs=logprobs, mask=mask, entropy=entropy.detach())
    assert metrics["entropy"] == pytest.approx(entropy[mask != 0].mean().item())
    assert "entropy" not in policy_loss(logprobs, adv, behavior_logprobs=logprobs, mask=mask)[1]


def test_a_bonus_without_entropy_or_a_negative_coef_is_refused():
    logprobs, adv, mask, entropy = _inputs()
    with pytest.raises(ValueError, match=r"entropy is required when entropy_coef > 0 \(entropy_coef=0.1\)"):
        policy_loss(logprobs, adv, behavior_logprobs=logprobs, mask=mask, config=PolicyLossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef must be >= 0, got -1"):
        PolicyLossConfig(entropy_coef=-1)
    with pytest.raises(ValueError, match=r"entropy has shape \(2, 3\) but logprobs has \(2, 4\)"):
        policy_loss(logprobs, adv, behavior_logprobs=logprobs, mask=mask, entropy=entropy[:, :3])
    assert PolicyLossConfig(entropy_coef=0.1).zero_advantage_counts and PolicyLossConfig(kl_coef=0.1).zero_advantage_counts
    assert not PolicyLossConfig().zero_advantage_counts
