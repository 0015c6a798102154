"""Next-token logprobs a chunk of positions at a time (`tidal.engines.token_logprobs`): the
whole-batch expression's values and gradients bit for bit, with only the logits kept for the
backward pass, and the train engines' steps unchanged by it."""

from __future__ import annotations

import pytest
import torch

from tidal.engines import token_logprobs as tl
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.engines.train_steps import next_token_stats
from tidal.flow.algorithms import PolicyLossConfig, token_entropy
from tidal.flow.trajectory import Trajectory, to_token_batch


def whole(logits, targets, temperature):
    """The expression `token_logprobs` replaces."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, targets[..., None]).squeeze(-1), token_entropy(logprobs, grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("shape", "shifted"), [((3, 7, 50), True), ((11, 50), False), ((2, 9, 1000), True), ((1, 0, 50), False)])
def test_values_entropy_and_gradients_are_the_whole_expressions_bit_for_bit(monkeypatch, dtype, shape, shifted):
    """Chunks of 3 positions (CHUNK 150 over 50 values a position), and rows cut as the
    padded engines cut them (`logits[:, :-1]`, targets `ids[:, 1:]`: neither a view of 2-D)."""
    monkeypatch.setattr(tl, "CHUNK", 150)
    generator = torch.Generator().manual_seed(0)
    full = (torch.randn(*shape, generator=generator) * 3).to(dtype).requires_grad_(True)
    ids = torch.randint(0, shape[-1], (*shape[:-1][:-1], shape[-2] + 1) if shifted else shape[:-1], generator=generator)
    logits, targets = (full[:, :-1], ids[:, 2:]) if shifted else (full, ids)
    weights = torch.randn(targets.shape, generator=generator)

    chosen, entropy = tl.token_logprobs(logits, targets, temperature=0.7, entropy=True)
    (chosen * weights).sum().backward()
    grad, full.grad = full.grad, None
    expected, expected_entropy = whole(logits, targets, 0.7)
    (expected * weights).sum().backward()

    assert chosen.dtype == torch.float32 and chosen.shape == targets.shape
    assert torch.equal(chosen, expected) and torch.equal(entropy, expected_entropy) and not entropy.requires_grad
    assert grad.dtype == dtype and torch.equal(grad, full.grad)


def test_only_the_logits_are_kept_for_the_backward_pass(monkeypatch):
    """What autograd keeps beside the targets: the whole expression a float32 [positions,
    vocab] log_softmax (twice the bf16 logits' bytes), the chunked one the logits themselves."""
    monkeypatch.setattr(tl, "CHUNK", 1000)
    logits = torch.randn(4, 64, 500, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 500, (4, 64))
    logit_bytes = logits.numel() * logits.element_size()

    def saved_bytes(compute) -> int:
        kept: dict[int, int] = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            compute()
        return sum(kept.values())

    target_bytes = targets.numel() * targets.element_size()
    assert saved_bytes(lambda: whole(logits * 1, targets, 1.0)) == 2 * logit_bytes + target_bytes  # the float32 log_softmax
    assert saved_bytes(lambda: next_token_stats(logits * 1, targets, temperature=1.0, entropy="metric")) == logit_bytes + target_bytes  # the logits (the product)


T = CharTokenizer()


def _batch():
    rows = []
    for prompt, response in [("1+2=", [5, 6]), ("13-4=", [5, 6, 7, 8, 9]), ("7=", [8]), ("2*3=", [9, 9, 4])]:
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend(response, [-1.0] * len(response), 0)
        rows.append(t)
    return to_token_batch(rows, pad_id=T.pad_id), torch.tensor([1.0, -0.5, 0.25, 0.75])


@pytest.mark.parametrize("padding_free", [True, False])
def test_a_train_engine_takes_the_same_steps_through_the_chunks(monkeypatch, padding_free):
    """The tiny model's logits are far below CHUNK (the whole expression runs); with CHUNK
    at 2 positions of its vocabulary every micro-batch goes through the chunks, and two steps
    give the same metrics and weights, bit for bit (padding-free: logits of 2-D; padded:
    `logits[:, :-1]`)."""
    batch, advantages = _batch()

    def two_steps():
        engine = TorchTrainEngine(build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32), lr=1e-2, micro_batch_size=2, padding_free=padding_free)
        metrics = [engine.train_step(batch, advantages, loss=PolicyLossConfig(), proximal_logprobs=engine.logprobs(batch)) for _ in range(2)]
        return metrics, engine.model.state_dict()

    calls = []
    real = tl.token_logprobs
    monkeypatch.setattr(tl, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    metrics, weights = two_steps()
    assert not calls
    monkeypatch.setattr(tl, "CHUNK", 2 * T.vocab_size)
    chunked_metrics, chunked_weights = two_steps()
    assert calls
    assert chunked_metrics == metrics
    assert all(torch.equal(chunked_weights[k], weights[k]) for k in weights)
