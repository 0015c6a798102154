"""The fsdp train engine in a group of one process (in this process): what it refuses
before running anything, where positions count from under left padding, logprobs without
dropout, gradients freed after a step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from tidal.engines.fsdp_train import FSDPTrainEngine
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch
from tidal.hal import current_platform

T = CharTokenizer()
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=2)


def _model() -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)


def _batch() -> tuple[TokenBatch, torch.Tensor]:
    rows = []
    for prompt, response in [("1+2=", [5, 6]), ("13-4=", [5, 6, 7, 8, 9]), ("7=", [8])]:
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend(response, [-1.0] * len(response), 0)
        rows.append(t)
    return to_token_batch(rows, pad_id=T.pad_id), torch.tensor([1.0, -0.5, 0.25])


@pytest.fixture
def group(tmp_path):
    """A process group of this process alone."""
    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    yield
    dist.destroy_process_group()


def _gpt2(**dropout: float) -> FSDPTrainEngine:
    """An engine on a tiny GPT-2: learned absolute positions, and dropout unless told otherwise."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return FSDPTrainEngine(transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=T.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2, **dropout)))


_IDS = [11, 12, 13, 14, 15]
_ZEROS = torch.zeros(1, 7)
PLAIN = TokenBatch(torch.tensor([_IDS]), torch.ones(1, 5, dtype=torch.long), _ZEROS[:, :4], _ZEROS[:, :4], _ZEROS[:, :4].long())
LEFT_PADDED = TokenBatch(torch.tensor([[T.pad_id] * 3 + _IDS]), torch.tensor([[0] * 3 + [1] * 5]), _ZEROS, _ZEROS, _ZEROS.long())
"""One row, and the same row left-padded by 3."""


def test_a_kl_term_without_a_reference_is_refused_before_anything_runs(group):
    """An engine built without `kl_reference` holds no reference policy: a loss with
    `kl_coef > 0` once failed inside its first micro-batch (led by rank 0: after the followers
    had joined the step), with policy_loss's "ref_logprobs is required"."""
    batch, advantages = _batch()
    engine = FSDPTrainEngine(_model(), **ENGINE)
    with pytest.raises(ValueError, match=r"kl_coef=0.1 needs a reference policy: build the engine with kl_reference=True"):
        engine.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))
    assert engine.version == 0 and not engine.optimizer.state


def test_a_kl_reference_is_the_built_weights_whole_and_kept_through_a_state_round_trip(group, tmp_path):
    """The reference is a frozen copy of the weights the engine was built with, sharded as the
    model is; `state_dict()` (whole) and the sharded checkpoint carry it, and `load_state_dict`
    and `load_checkpoint` set it (another engine's reference)."""
    batch, advantages = _batch()
    built = {k: v.clone() for k, v in _model().state_dict().items()}
    engine = FSDPTrainEngine(_model(), **ENGINE, kl_reference=True)
    metrics = engine.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))
    assert metrics["kl"] == 0.0  # the first step's policy is its reference
    engine.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))
    state = engine.state_dict()
    assert state["reference"].keys() == built.keys() and all(torch.equal(state["reference"][k], built[k]) for k in built)
    assert not any(p.requires_grad for p in engine.reference.parameters()) and all(isinstance(p, DTensor) for p in engine.reference.parameters())
    other = FSDPTrainEngine(build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=3), **ENGINE, kl_reference=True)
    other.load_state_dict(state)
    assert all(torch.equal(other.state_dict()["reference"][k], built[k]) for k in built)
    assert other.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))["kl"] > 0
    engine.save_checkpoint(tmp_path / "sharded")
    third = FSDPTrainEngine(build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=4), **ENGINE, kl_reference=True)
    third.load_checkpoint(tmp_path / "sharded")
    assert all(torch.equal(third.state_dict()["reference"][k], built[k]) for k in built)
    assert not any(p.requires_grad for p in third.reference.parameters())
    assert third.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))["kl"] == engine.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))["kl"] > 0


def test_advantages_whose_shape_does_not_fit_the_batch_are_refused(group):
    """Advantages for more rows than the batch has were cut to its rows without a word."""
    batch, advantages = _batch()
    engine = FSDPTrainEngine(_model(), **ENGINE)
    with pytest.raises(ValueError, match=r"advantages must be \[batch\] or \[batch, seq - 1\] = \[3, 10\], got \[4\]"):
        engine.train_step(batch, torch.ones(4), loss=PolicyLossConfig())
    assert engine.version == 0 and not engine.optimizer.state


def test_a_left_padded_row_gets_the_logprobs_it_has_unpadded(group):
    """Positions count from a row's first real token, as the rollout engine's do: on a model
    with absolute positions (GPT-2) they once shifted with the padding."""
    engine = _gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.testing.assert_close(engine.logprobs(LEFT_PADDED)[:, 3:], engine.logprobs(PLAIN), atol=1e-6, rtol=0)


def test_logprobs_are_the_current_weights_without_dropout(group):
    """With dropout in the model (GPT-2's defaults) logprobs are still a function of the weights
    (eval mode, as a rollout engine's); the train steps keep the model's mode."""
    engine = _gpt2()
    assert torch.equal(engine.logprobs(PLAIN), engine.logprobs(PLAIN)) and engine.model.training


def test_a_step_leaves_no_gradients_behind(group):
    """Gradients are dead once the optimizer stepped: freed, not held (or parked) until the next step."""
    batch, advantages = _batch()
    engine = FSDPTrainEngine(_model(), **ENGINE)
    engine.train_step(batch, advantages, loss=PolicyLossConfig())
    assert engine.optimizer.state and all(p.grad is None for p in engine.model.parameters())
    engine.sft_step(batch)
    assert all(p.grad is None for p in engine.model.parameters())


def test_a_state_taken_before_the_first_step_is_a_snapshot(group):
    """Without optimizer state, `state_dict()` once returned the live weights (a group of one
    on CPU gathers and offloads nothing): the next step changed the state already taken."""
    batch, advantages = _batch()
    engine = FSDPTrainEngine(_model(), **ENGINE)
    state = engine.state_dict()
    before = {name: tensor.clone() for name, tensor in state["model"].items()}
    engine.train_step(batch, advantages, loss=PolicyLossConfig())
    assert all(torch.equal(tensor, before[name]) for name, tensor in state["model"].items())


@pytest.mark.parametrize("setting", [{"grad_clip": 0.0}, {"temperature": 0.0}, {"micro_batch_size": 0}])
def test_settings_out_of_bounds_are_refused_before_any_process_group_is_needed(setting):
    (name,) = setting
    with pytest.raises(ValueError, match=f"{name} must be"):
        FSDPTrainEngine(_model(), **setting)



def test_train_forwards_build_no_kv_cache(group):
    """A training forward asks for no KV cache (transformers' default built one each pass, and
    logged "`use_cache=True` is incompatible with gradient checkpointing" in every run)."""
    batch, advantages = _batch()
    engine = FSDPTrainEngine(_model(), **ENGINE)
    seen: list = []
    engine.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
    engine.train_step(batch, advantages, loss=PolicyLossConfig())
    engine.sft_step(batch)
    assert seen and set(seen) == {False}
