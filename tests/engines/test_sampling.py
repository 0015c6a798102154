"""`rollout.top_k` / `rollout.top_p`: the truncation follows transformers' warpers (and so
vLLM's sampler), and the trainer's logprobs are taken under the same cut, so on-policy
samples have importance ratio 1. That the hf rollout draws what `generate` draws with them:
test_engines.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from tests.engines.test_engines import T, tiny
from tidal.engines import token_logprobs
from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.engines.sampling import truncate
from tidal.engines.torch_train import TorchTrainEngine
from tidal.engines.train_steps import next_token_stats
from tidal.flow.trajectory import Trajectory, to_token_batch

CUTS = [(0, 0.9), (5, 1.0), (5, 0.7), (50, 0.95), (1, 0.5), (0, 0.01), (3, 0.0001)]


@pytest.mark.parametrize(("top_k", "top_p"), CUTS)
def test_truncation_is_transformers_top_k_then_top_p(top_k, top_p):
    torch.manual_seed(0)
    scores = torch.randn(64, 300) * 3
    scores[0, :10] = 2.0  # ties at the k-th score are kept, as both libraries keep them
    expected = scores.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(truncate(scores, top_k=top_k, top_p=top_p), expected)


def test_truncation_keeps_the_given_tokens_and_cuts_nothing_when_off():
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    assert truncate(scores) is scores
    cut = truncate(scores, top_k=1, keep=torch.tensor([2, 0]))
    assert cut.tolist() == [[3.0, -torch.inf, 1.0, -torch.inf], [0.0, -torch.inf, -torch.inf, 3.0]]


def _samples(top_k: int, top_p: float, temperature: float = 0.8) -> tuple[torch.nn.Module, list[Trajectory]]:
    model = tiny(0)
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, temperature=temperature, top_k=top_k, top_p=top_p, chunk_tokens=3)
    torch.manual_seed(1)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-4=", "7="] for _ in range(6)]
    engine.generate(trajectories, max_new_tokens=6)
    return model, trajectories


@pytest.mark.parametrize(("top_k", "top_p"), [(4, 1.0), (0, 0.6), (6, 0.8)])
def test_the_trainer_takes_its_logprobs_under_rollouts_cut(top_k, top_p):
    """With the weights that sampled them, the trainer's logprobs are the behavior ones: the
    importance ratio is 1. Without the cut they are lower on every token (ratio < 1)."""
    model, trajectories = _samples(top_k, top_p)
    batch = to_token_batch(trajectories, pad_id=T.pad_id)
    behavior = batch.behavior_logprobs[batch.loss_mask != 0]
    cut = TorchTrainEngine(copy.deepcopy(model), temperature=0.8, top_k=top_k, top_p=top_p).logprobs(batch)[batch.loss_mask != 0]
    full = TorchTrainEngine(copy.deepcopy(model), temperature=0.8).logprobs(batch)[batch.loss_mask != 0]
    assert torch.allclose(cut, behavior, atol=1e-5)
    assert (full <= cut + 1e-6).all() and (full < cut - 1e-3).float().mean() > 0.3


@pytest.mark.parametrize(("top_k", "top_p"), [(4, 1.0), (0, 0.6), (3, 0.5)])
def test_chunked_logprobs_and_gradients_under_a_cut_are_the_whole_batchs(top_k, top_p, monkeypatch):
    torch.manual_seed(0)
    logits = (torch.randn(3, 40, 50) * 2).requires_grad_()
    targets = torch.randint(0, 50, (3, 40))  # many outside the kept set: kept in, finite
    whole, _ = next_token_stats(logits, targets, temperature=0.9, top_k=top_k, top_p=top_p)
    (grad_whole,) = torch.autograd.grad((whole * torch.linspace(-1, 1, 40)).sum(), logits)
    monkeypatch.setattr(token_logprobs, "CHUNK", 500)  # 10 positions a chunk
    chunked, entropy = token_logprobs.token_logprobs(logits, targets, temperature=0.9, top_k=top_k, top_p=top_p, entropy=True)
    (grad_chunked,) = torch.autograd.grad((chunked * torch.linspace(-1, 1, 40)).sum(), logits)
    assert torch.isfinite(whole).all() and torch.equal(whole, chunked)
    assert torch.isfinite(grad_whole).all() and torch.allclose(grad_whole, grad_chunked, atol=1e-7)
    assert torch.isfinite(entropy).all()
    scaled = logits.detach() / 0.9
    cut_off = torch.isinf(truncate(scaled, top_k=top_k, top_p=top_p, keep=targets))
    assert cut_off.any() and (grad_whole[cut_off] == 0).all()  # a token cut off takes no gradient


@pytest.mark.parametrize(("keys", "error"), [({"top_k": -1}, "top_k must be an integer >= 0"), ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"), ({"top_p": 1.5}, "top_p must be in")])
def test_engines_refuse_a_cut_out_of_bounds(keys, error):
    with pytest.raises(ValueError, match=error):
        HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id, **keys)
    with pytest.raises(ValueError, match=error):
        TorchTrainEngine(tiny(), **keys)
