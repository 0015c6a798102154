"""PPO with a learned value function (`algorithm.advantage=gae`): the estimates against verl's
functions transcribed, and the workflow's use of a critic, through the real `Workflow`
with scripted engines."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.flow.test_overlong import MAX_NEW_TOKENS, RecordingTrainer, ScriptedRollout
from tidal.flow.algorithms import KLController, explained_variance, gae, kl_penalty_rewards, masked_whiten, value_loss
from tidal.flow.config import AlgorithmConfig
from tidal.flow.store import Store
from tidal.flow.workflow import Workflow, WorkflowConfig


def verl_gae(token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl/trainer/ppo/core_algos.py `compute_gae_advantage_return` (observation tokens
    skipped), before its whitening."""
    nextvalues, lastgaelam, advantages_reversed = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl/utils/torch_functional.py `masked_whiten` (`masked_var` unbiased)."""
    mean = (values * mask).sum() / mask.sum()
    centered = values - mean
    var = (centered**2 * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `compute_value_loss` with token-mean aggregation: (loss, clip fraction)."""
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1, vf_losses2 = (vpreds - returns) ** 2, (vpredclipped - returns) ** 2
    clipped = torch.max(vf_losses1, vf_losses2)
    return 0.5 * (clipped * response_mask).sum() / response_mask.sum(), (torch.gt(vf_losses2, vf_losses1).float() * response_mask).sum() / response_mask.sum()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows: a response after a prompt, one with an environment's tokens inside it (a
    hole in the mask), one with no loss token."""
    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    return torch.tensor([1.0, -0.5, 2.0]), torch.randn(3, 7), mask


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_is_verls_on_the_loss_tokens(gamma, lam):
    rewards, values, mask = _batch()
    token_rewards = torch.zeros_like(values)
    token_rewards[0, 5], token_rewards[1, 6] = rewards[0], rewards[1]  # each row's last loss token
    want_adv, want_ret = verl_gae(token_rewards, values, mask, gamma, lam)
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    on = mask.bool()
    torch.testing.assert_close(advantages[on], want_adv[on])
    torch.testing.assert_close(returns[on], want_ret[on])
    assert (advantages[~on] == 0).all() and (returns[~on] == 0).all()
    torch.testing.assert_close(masked_whiten(advantages, mask)[on], verl_masked_whiten(want_adv, mask)[on])


def test_with_gamma_and_lambda_one_the_advantage_is_the_reward_minus_the_value():
    rewards, values, mask = _batch()
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    on = mask.bool()
    torch.testing.assert_close(advantages[0][on[0]], rewards[0] - values[0][on[0]])
    torch.testing.assert_close(returns[1][on[1]], torch.full((4,), -0.5))


def test_value_loss_is_verls():
    torch.manual_seed(1)
    predicted, old, returns = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
    loss, num_clipped = value_loss(predicted, old, returns, mask, clip=0.2)
    want_loss, want_frac = verl_value_loss(predicted, returns, old, mask, 0.2)
    torch.testing.assert_close(loss / mask.sum(), want_loss)
    assert float(num_clipped) / float(mask.sum()) == pytest.approx(float(want_frac))
    unclipped, _ = value_loss(predicted, old, returns, mask, clip=None)
    torch.testing.assert_close(unclipped, 0.5 * ((predicted - returns) ** 2 * mask).sum())


def test_explained_variance():
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)


class RecordingCritic:
    """Values of 0.25 everywhere; records the order of its calls and what it was given."""

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.steps = calls, []

    def values(self, batch: Any) -> torch.Tensor:
        self.calls.append("values")
        return torch.full(batch.loss_mask.shape, 0.25) * batch.loss_mask.bool()

    def train_step(self, batch: Any, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        self.calls.append("critic")
        self.steps.append((batch, returns, old_values))
        return {"value_loss": 0.5}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class OrderedTrainer(RecordingTrainer):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def train_step(self, batch: Any, advantages: torch.Tensor, **kwargs: Any) -> dict[str, float]:
        self.calls.append("policy")
        return super().train_step(batch, advantages, **kwargs)


def _config(**keys: Any) -> WorkflowConfig:
    return WorkflowConfig.from_keys(**{"num_steps": 2, "prompts_per_step": 3, "group_size": 1, "max_staleness": 0, "max_new_tokens": MAX_NEW_TOKENS, "prompts_per_generate": 1, "tis_cap": None, "decoupled": False, **keys})


def _score(trajectories: Any) -> tuple[list[float], list[int]]:
    return [float(t.num_generated) for t in trajectories], []  # a reward per row: its length


def test_each_step_trains_the_policy_on_whitened_token_advantages_from_the_critics_values_then_the_critic():
    calls: list[str] = []
    steps: list[dict[str, Any]] = []
    critic, trainer = RecordingCritic(calls), OrderedTrainer(calls)
    prompts = iter([{"prompt_ids": [1, 2], "answer": "x"}] * 20)
    Workflow(store=Store(), rollout=ScriptedRollout(), trainer=trainer, prompts=prompts, score=_score, config=_config(advantage="gae", gamma=1.0, lam=1.0), on_step=steps.append, critic=critic).run()
    assert calls == ["values", "policy", "critic"] * 2
    assert [m["value_loss"] for m in steps] == [0.5, 0.5]
    for advantages, mask, (_, returns, old_values) in zip(trainer.advantages, trainer.masks, critic.steps):
        on = mask.bool()
        assert advantages.shape == mask.shape  # per token
        rewards = torch.tensor([float(n) for n in on.sum(1).tolist()])  # each row's reward: its generated tokens
        raw = torch.where(on, rewards[:, None] - 0.25, 0.0)  # gamma = lam = 1: the reward minus the value
        torch.testing.assert_close(advantages, masked_whiten(raw, mask))
        torch.testing.assert_close(returns, torch.where(on, rewards[:, None], 0.0))  # the critic's targets
        assert (old_values[on] == 0.25).all()


def test_a_value_based_estimator_needs_a_critic_and_the_others_take_none():
    prompts = iter([])
    with pytest.raises(ValueError, match="algorithm.advantage=gae needs a critic"):
        Workflow(store=Store(), rollout=ScriptedRollout(), trainer=RecordingTrainer(), prompts=prompts, score=_score, config=_config(advantage="gae"))
    with pytest.raises(ValueError, match="algorithm.advantage=grpo takes no critic"):
        Workflow(store=Store(), rollout=ScriptedRollout(), trainer=RecordingTrainer(), prompts=prompts, score=_score, config=_config(group_size=2), critic=RecordingCritic([]))


class WarmingTrainer(OrderedTrainer):
    """An `OrderedTrainer` that can sit a step out (`TakesFrozenSteps`)."""

    def frozen_step(self) -> None:
        self.calls.append("frozen")
        self.version += 1


def test_with_a_critic_warmup_the_first_steps_train_the_critic_alone_and_count_as_versions():
    """verl's critic_warmup: for `critic_warmup` steps the policy sits out (its version still
    counts each step, so rollout goes on and the staleness bound holds), the critic trains on
    each, and the policy's first step comes after them, on the same values-then-policy order."""
    calls: list[str] = []
    steps: list[dict[str, Any]] = []
    versions: list[int] = []
    critic, trainer = RecordingCritic(calls), WarmingTrainer(calls)
    prompts = iter([{"prompt_ids": [1, 2], "answer": "x"}] * 40)

    def on_step(metrics: dict[str, Any]) -> None:
        steps.append(metrics)
        versions.append(trainer.version)

    config = _config(advantage="gae", num_steps=4, critic_warmup=2, max_staleness=1)
    Workflow(store=Store(), rollout=ScriptedRollout(), trainer=trainer, prompts=prompts, score=_score, config=config, on_step=on_step, critic=critic).run()
    assert calls == ["values", "frozen", "critic"] * 2 + ["values", "policy", "critic"] * 2
    assert [m["step"] for m in steps] == versions == [1, 2, 3, 4]
    assert ["loss" in m for m in steps] == [False, False, True, True]  # the policy's metrics from its first step
    assert all(m["value_loss"] == 0.5 for m in steps) and len(critic.steps) == 4 and len(trainer.advantages) == 2


def test_a_critic_warmup_needs_a_critic_and_a_trainer_that_sits_steps_out():
    with pytest.raises(ValueError, match="algorithm.critic_warmup=2 trains a critic alone, and algorithm.advantage=grpo has none"):
        AlgorithmConfig(num_steps=4, critic_warmup=2).check()
    with pytest.raises(ValueError, match=r"algorithm.critic_warmup=2 must be < algorithm.num_steps \(2\): the policy would never train"):
        AlgorithmConfig(advantage="gae", group_size=1, num_steps=2, critic_warmup=2).check()
    AlgorithmConfig(advantage="gae", group_size=1, num_steps=3, critic_warmup=2).check()
    with pytest.raises(ValueError, match=r"algorithm.critic_warmup=1 has the policy sit steps out, which OrderedTrainer cannot \(`TakesFrozenSteps`\)"):
        Workflow(store=Store(), rollout=ScriptedRollout(), trainer=OrderedTrainer([]), prompts=iter([]), score=_score, config=_config(advantage="gae", critic_warmup=1), critic=RecordingCritic([]))


def verl_adaptive_kl(value: float, target: float, horizon: int, current_kl: float, n_steps: int) -> float:
    """verl/trainer/ppo/core_algos.py `AdaptiveKLController.update`."""
    proportional_error = float(np.clip(current_kl / target - 1, -0.2, 0.2))
    mult = 1 + proportional_error * n_steps / horizon
    return value * mult


def test_a_kl_penalty_in_the_reward_is_verls_apply_kl_penalty_and_gae_reads_it_per_token():
    rewards, values, mask = _batch()
    behavior, reference = -torch.rand(3, 7), -torch.rand(3, 7)
    penalties, per_row = kl_penalty_rewards(behavior, reference, mask, coef=0.1)
    kld = (behavior - reference) * mask  # verl's kl_penalty(..., "kl"), masked
    torch.testing.assert_close(penalties, -0.1 * kld)
    torch.testing.assert_close(per_row[:2], (kld.sum(1) / mask.sum(1))[:2])  # verl's masked_mean over each response
    assert per_row[2] == 0  # no loss token
    token_level = penalties.clone()  # verl's token_level_rewards: the score at the last token minus beta * kld
    token_level[0, 5] += rewards[0]
    token_level[1, 6] += rewards[1]
    want_adv, want_ret = verl_gae(token_level, values, mask, 0.99, 0.95)
    advantages, returns = gae(rewards, values, mask, gamma=0.99, lam=0.95, token_rewards=penalties)
    on = mask.bool()
    torch.testing.assert_close(advantages[on], want_adv[on])
    torch.testing.assert_close(returns[on], want_ret[on])


@pytest.mark.parametrize("kl", [0.0, 0.005, 0.011, 0.5])
def test_the_adaptive_kl_controller_is_verls_and_a_fixed_one_stays(kl):
    controller = KLController(0.2, target=0.01, horizon=1000)
    controller.update(kl, 64)
    assert controller.coef == pytest.approx(verl_adaptive_kl(0.2, 0.01, 1000, kl, 64))
    fixed = KLController(0.2)
    fixed.update(kl, 64)
    assert fixed.coef == 0.2


class ReferenceTrainer(OrderedTrainer):
    """Reference logprobs 0.5 below each behavior logprob: a KL of 0.5 per token."""

    def logprobs_under_reference(self, batch: Any) -> torch.Tensor:
        self.calls.append("reference")
        return (batch.behavior_logprobs - 0.5) * batch.loss_mask


def test_with_a_kl_in_the_reward_each_step_reads_the_reference_and_the_coefficient_adapts_and_is_saved(tmp_path):
    calls: list[str] = []
    steps: list[dict[str, Any]] = []
    critic, trainer = RecordingCritic(calls), ReferenceTrainer(calls)
    prompts = iter([{"prompt_ids": [1, 2], "answer": "x"}] * 20)
    config = _config(advantage="gae", gamma=1.0, lam=1.0, kl_in_reward=0.1, kl_target=0.25, kl_horizon=6)
    workflow = Workflow(store=Store(), rollout=ScriptedRollout(), trainer=trainer, prompts=prompts, score=_score, config=config, on_step=steps.append, critic=critic)
    workflow.run()
    assert calls == ["values", "reference", "policy", "critic"] * 2
    assert [m["reward_kl"] for m in steps] == [pytest.approx(0.5)] * 2
    assert [m["reward_kl_coef"] for m in steps] == [pytest.approx(0.1), pytest.approx(0.1 * 1.1)]  # KL twice the target: +20% x 3 samples / 6
    for k, ((_, returns, _), mask) in enumerate(zip(critic.steps, trainer.masks, strict=True)):
        on = mask.bool()
        rewards = torch.tensor([float(n) for n in on.sum(1).tolist()])
        after = torch.flip(torch.cumsum(torch.flip(on.float(), [1]), 1), [1]) * on  # loss tokens from each one to the last
        penalty = steps[k]["reward_kl_coef"] * 0.5 * after  # gamma = lam = 1: a token's return sums the penalties from it on
        torch.testing.assert_close(returns, torch.where(on, rewards[:, None] - penalty, 0.0))
    assert workflow.save(tmp_path / "store")["totals"]["reward_kl_coef"] == pytest.approx(0.1 * 1.1 * 1.1)
    resumed = Workflow(store=Store(), rollout=ScriptedRollout(), trainer=ReferenceTrainer([]), prompts=iter([]), score=_score, config=config, critic=RecordingCritic([]), totals={"reward_kl_coef": 0.3})
    assert resumed.reward_kl.coef == 0.3  # a resumed run goes on with its checkpoint's coefficient


def test_a_kl_in_the_reward_needs_a_trainer_that_gives_reference_logprobs():
    with pytest.raises(ValueError, match="does not give"):
        Workflow(store=Store(), rollout=ScriptedRollout(), trainer=OrderedTrainer([]), prompts=iter([]), score=_score, config=_config(advantage="gae", kl_in_reward=0.1), critic=RecordingCritic([]))
