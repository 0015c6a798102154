"""The critic of `algorithm.advantage=gae` (`engines.critic`) on the tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from tidal.engines.critic import Critic
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.flow.algorithms import value_loss
from tidal.flow.trajectory import TokenBatch

T = CharTokenizer()


def _policy() -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, seed=0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)


def _returns(batch: TokenBatch) -> torch.Tensor:
    """A target per loss token that differs by row and by position."""
    on = batch.loss_mask.bool()
    rows = torch.arange(len(batch), dtype=torch.float32)[:, None]
    return torch.where(on, 0.5 * rows - 0.1 * torch.arange(on.shape[1]), 0.0)


def test_values_start_at_zero_and_follow_the_policys_token_layout(six_rows):
    batch, _ = six_rows
    critic = Critic(_policy(), micro_batch_size=4)
    values = critic.values(batch)
    assert values.shape == batch.loss_mask.shape and values.dtype == torch.float32 and (values == 0).all()  # a head of zeros
    torch.nn.init.normal_(critic.model.head.weight)
    values = critic.values(batch)
    assert (values[~batch.loss_mask.bool()] == 0).all() and (values[batch.loss_mask.bool()] != 0).all()
    pad = lambda t, value: torch.cat([torch.full((t.shape[0], 3), value, dtype=t.dtype), t], dim=1)
    left = TokenBatch(pad(batch.input_ids, T.pad_id), pad(batch.attention_mask, 0), pad(batch.loss_mask, 0), pad(batch.behavior_logprobs, 0), pad(batch.versions, -1))
    torch.testing.assert_close(critic.values(left)[:, 3:], values, atol=1e-5, rtol=0)  # positions count from each row's first real token


def test_steps_bring_the_values_to_the_returns_and_leave_the_policy_alone(six_rows):
    batch, _ = six_rows
    policy = _policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    critic = Critic(policy, lr=1e-2, value_clip=None, micro_batch_size=4)
    returns, on = _returns(batch), batch.loss_mask.bool()
    losses = []
    for _ in range(30):
        values = critic.values(batch)
        metrics = critic.train_step(batch, returns, values)
        losses.append(metrics["value_loss"])
    assert set(metrics) == {"value_loss", "value_clipfrac", "value_grad_norm", "values_mean", "returns_mean", "explained_variance"}
    assert losses[0] == pytest.approx(float(value_loss(torch.zeros_like(returns), torch.zeros_like(returns), returns, on, clip=None)[0]) / int(on.sum()))
    assert losses[-1] < 0.2 * losses[0] and metrics["explained_variance"] > 0.5
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # the critic trains a copy of the body


def test_value_clipping_holds_the_values_near_the_old_ones(six_rows):
    batch, _ = six_rows
    critic = Critic(_policy(), lr=1e-2, value_clip=1e-3, micro_batch_size=6)
    returns = _returns(batch) + 5.0 * batch.loss_mask
    old = critic.values(batch)
    metrics = critic.train_step(batch, returns, old)
    assert metrics["value_clipfrac"] == 0.0  # at the old values nothing is clipped yet
    for _ in range(5):
        metrics = critic.train_step(batch, returns, old)
    assert metrics["value_clipfrac"] == 1.0  # every value moved past the clip: the clipped term rules, without a gradient


def test_a_critic_loaded_from_anothers_state_goes_on_as_it_would(six_rows):
    batch, _ = six_rows
    a = Critic(_policy(), lr=1e-2, micro_batch_size=4)
    returns = _returns(batch)
    a.train_step(batch, returns, a.values(batch))
    b = Critic(build_tiny_qwen2(T.vocab_size, seed=5, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32), lr=1e-2, micro_batch_size=4)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a checkpoint gives it back: its own tensors
    for critic in (a, b):
        critic.train_step(batch, returns, critic.values(batch))
    assert torch.equal(a.values(batch), b.values(batch))


@pytest.mark.gpu
def test_gpu_critic_matches_the_cpu_one_and_resumes_from_a_cpu_state(six_rows):
    """On a real GPU: the critic's values and its step equal the CPU critic's (float64), and a
    state saved on the host (AdamW unfused) loads into the GPU's fused AdamW and steps."""
    from tidal.hal import select_platform
    from tidal.hal.cpu import CpuPlatform

    batch, _ = six_rows
    gpu = select_platform("cuda").platform
    returns = _returns(batch).double()
    critics = []
    for platform in (CpuPlatform(), gpu):
        critic = Critic(_policy().double(), lr=1e-2, micro_batch_size=4, platform=platform)
        torch.nn.init.constant_(critic.model.head.weight, 0.1)
        critic.train_step(batch, returns, critic.values(batch))
        critics.append(critic)
    cpu, cuda = critics
    assert next(cuda.model.parameters()).device.type == "cuda"
    torch.testing.assert_close(cuda.values(batch), cpu.values(batch), rtol=1e-5, atol=1e-6)
    resumed = Critic(_policy().double(), lr=1e-2, micro_batch_size=4, platform=gpu)
    resumed.load_state_dict(copy.deepcopy(cpu.state_dict()))
    for critic in (cpu, resumed):
        critic.train_step(batch, returns, critic.values(batch))
    torch.testing.assert_close(resumed.values(batch), cpu.values(batch), rtol=1e-5, atol=1e-6)


def test_a_critic_started_from_a_reward_model_values_each_token_as_its_score_head_does(six_rows, tmp_path):
    """`critic.path` at a reward model: the critic's body and value head are its body and score
    head, so the first values are the reward model's score at each token."""
    import transformers

    from tidal.engines.train_steps import padded_positions
    from tidal.tools.bench.fixture import build_tiny_reward_model

    batch, _ = six_rows
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(build_tiny_reward_model(tmp_path / "rm"))
    critic = Critic(rm, head=rm.score, micro_batch_size=4)
    with torch.no_grad():
        hidden = rm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=padded_positions(batch.attention_mask)).last_hidden_state
        want = rm.score(hidden)[:, :-1, 0] * batch.loss_mask.bool()
    torch.testing.assert_close(critic.values(batch), want, atol=1e-5, rtol=0)
    assert (want[batch.loss_mask.bool()] != 0).all() and critic.model.head.weight.data_ptr() != rm.score.weight.data_ptr()  # a copy
