"""The torch train engine's logprobs: padding, positions of left-padded rows, and no dropout."""

from __future__ import annotations

import contextlib

import torch

from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch

T = CharTokenizer()


def tiny():
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=0)


def test_logprobs_are_zero_where_padding_is_predicted_whatever_the_micro_batches():
    """A short row beside a long one in a micro-batch (cut to the long one) once came back
    with the pad token's logprob where it predicts padding, and 0 when it ran alone."""
    rows = []
    for prompt, response in [("1+2=", [5, 6]), ("13-4=", [5, 6, 7, 8, 9])]:
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend(response, [-1.0] * len(response), 0)
        rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)
    padding = batch.attention_mask[:, 1:] == 0
    assert padding.any()
    alone, together = (TorchTrainEngine(tiny(), micro_batch_size=m).logprobs(batch) for m in (1, 2))
    assert (alone[padding] == 0).all() and (together[padding] == 0).all()
    response = ~padding & (batch.loss_mask.cumsum(1) > 0)  # before it, a prompt's positions: 0 where no loss of the micro-batch reads them
    assert (alone[response] != 0).all() and (together[response] != 0).all()


def _gpt2(**dropout: float) -> torch.nn.Module:
    """A tiny GPT-2: learned absolute positions, and dropout unless told otherwise."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=T.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2, **dropout)
        return transformers.GPT2LMHeadModel(config)


def _left_padded(width: int) -> tuple[TokenBatch, TokenBatch]:
    """One row left-padded to `width`, and the same row without padding."""
    ids = [11, 12, 13, 14, 15]
    pad = width - len(ids)
    plain = TokenBatch(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), torch.ones(1, len(ids) - 1), torch.zeros(1, len(ids) - 1), torch.zeros(1, len(ids) - 1, dtype=torch.long))
    left = TokenBatch(
        torch.tensor([[T.pad_id] * pad + ids]),
        torch.tensor([[0] * pad + [1] * len(ids)]),
        torch.cat([torch.zeros(1, pad), plain.loss_mask], 1),
        torch.zeros(1, width - 1),
        torch.zeros(1, width - 1, dtype=torch.long),
    )
    return left, plain


def test_a_left_padded_row_gets_the_logprobs_it_has_unpadded():
    """Positions count from a row's first real token (as the rollout engine's do): a model
    with absolute positions (GPT-2) once saw a left-padded row shifted by its padding."""
    engine = TorchTrainEngine(_gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), micro_batch_size=4)
    left, plain = _left_padded(8)
    torch.testing.assert_close(engine.logprobs(left)[:, 3:], engine.logprobs(plain), atol=1e-6, rtol=0)


def test_logprobs_are_the_current_weights_without_dropout():
    """`logprobs` is a function of the weights: a model with dropout (GPT-2's defaults) gave
    another answer at every call, unlike the rollout engine, which samples in eval mode."""
    engine = TorchTrainEngine(_gpt2(), micro_batch_size=4)
    _, batch = _left_padded(8)
    first, second = engine.logprobs(batch), engine.logprobs(batch)
    assert torch.equal(first, second)
    assert engine.model.training  # the train steps' forwards keep the model's dropout


def test_a_padded_micro_batch_makes_logits_only_from_its_first_loss_token():
    """A prompt's positions, which no loss reads, cost no lm_head rows and no log-softmax
    (`logits_to_keep`); the logprobs and entropies a loss reads, and their gradients, are those
    of the whole forward, and the positions before are 0."""
    from tidal.engines.padding_free import keeps_logits
    from tidal.engines.train_steps import padded_token_stats

    rows = []
    for prompt, response in [("12+34=", [5, 6, 7]), ("1+2+3+4=", [8, 9])]:
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend(response, [-1.0] * len(response), 0)
        rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)  # right-padded: the rows' first loss tokens at 5 and 7
    start = int(batch.loss_mask.any(0).nonzero()[0])
    assert start == len(T.encode("12+34=")) - 1 > 0  # the shorter prompt's last token predicts the first response token
    model = tiny()
    assert keeps_logits(model)
    widths: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    results = []
    for keep in (True, False):
        model.zero_grad()
        inputs = {"attention_mask": batch.attention_mask, "use_cache": False}
        logprobs, entropies = padded_token_stats(model, batch, inputs=inputs, keeps_logits=keep, temperature=0.7, entropy="grad", autocast=contextlib.nullcontext())
        ((logprobs + entropies) * batch.loss_mask).sum().backward()
        results.append((logprobs, entropies, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert widths == [batch.input_ids.shape[1] - start, batch.input_ids.shape[1]]
    (lp, ent, grads), (want_lp, want_ent, want_grads) = results
    read = batch.loss_mask != 0
    torch.testing.assert_close(lp[read], want_lp[read], atol=1e-6, rtol=0)
    torch.testing.assert_close(ent[read], want_ent[read], atol=1e-6, rtol=0)
    assert (lp[:, :start] == 0).all() and (ent[:, :start] == 0).all()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-6, rtol=1e-5, msg=name)
