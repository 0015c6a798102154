"""Padding-free micro-batches (`engines.padding_free`, `train.padding_free`): the packed
layout, the forward against the padded one (logprobs, entropies, gradients), the torch
engine's step and token budget, which layout the torch engine takes, and what is refused.
The fsdp engine's: tests/engines/test_fsdp_padding_free.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tidal.engines import torch_train
from tidal.engines.fsdp_train import FSDPTrainEngine
from tidal.engines.micro_batches import real_lengths
from tidal.engines.padding_free import PaddingFree, cannot_pack, pack_rows, padding_free_for
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.engines.train_steps import next_token_stats, padded_positions
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch

T = CharTokenizer()


def tiny(dtype: torch.dtype = torch.float32, attention: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64, seed=seed, attention=attention).to(dtype)


def _batch(responses: list[tuple[str, int]], dtype: torch.dtype = torch.float32) -> TokenBatch:
    """Rows of distinct prompts (no shared-prompt packing) with responses of the given lengths."""
    rows = []
    for k, (prompt, n) in enumerate(responses):
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend([5 + (3 * k + i) % 9 for i in range(n)], [-1.0 - 0.05 * i for i in range(n)], 0)
        rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)
    return dataclasses.replace(batch, behavior_logprobs=batch.behavior_logprobs.to(dtype))


LONG_TAIL = [("1+2=", 2), ("13-4=", 30), ("7=", 1), ("2-9=", 11), ("3+3=", 45), ("8=", 4), ("9-1=", 19)]
"""Rows of 5 to 50 tokens."""


def _left_padded(batch: TokenBatch, row: int) -> TokenBatch:
    """`batch` with `row` moved to the right end of its columns (left padding)."""
    shift = int(batch.input_ids.shape[1] - batch.attention_mask[row].sum())
    ids, mask = batch.input_ids.clone(), batch.attention_mask.clone()
    ids[row], mask[row] = ids[row].roll(shift), mask[row].roll(shift)
    return dataclasses.replace(batch, input_ids=ids, attention_mask=mask)


def test_rows_are_laid_out_back_to_back_with_positions_from_zero():
    """Rows of 2, 6, 1 and 4 tokens: each goes in without its last token (1, 5, 0 and 3
    tokens). Flash attention's layout is one row of all of them, in order; the others' is rows
    as wide as the longest (5), filled longest first: [row 1], [row 3, row 0, padding],
    the padding's positions going on from row 0's."""
    ids = torch.tensor([[10, 11, 0, 0, 0, 0], [20, 21, 22, 23, 24, 25], [30, 0, 0, 0, 0, 0], [40, 41, 42, 43, 0, 0]])
    mask = (ids != 0).long()
    one = pack_rows(ids, mask, one_row=True)
    assert one.input_ids.tolist() == [[10, 20, 21, 22, 23, 24, 40, 41, 42]]
    assert one.position_ids.tolist() == [[0, 0, 1, 2, 3, 4, 0, 1, 2]]
    assert one.source is None  # every packed token predicts a real one, in order
    assert one.targets.tolist() == [11, 21, 22, 23, 24, 25, 41, 42, 43]
    rows = pack_rows(ids, mask, one_row=False)
    assert rows.input_ids.tolist() == [[20, 21, 22, 23, 24], [40, 41, 42, 10, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert rows.source.tolist() == [8, 0, 1, 2, 3, 4, 5, 6, 7]  # row 0's token, then row 1's, then row 3's
    assert rows.scatter(torch.arange(1.0, 10.0)).tolist() == [[1, 0, 0, 0, 0], [2, 3, 4, 5, 6], [0, 0, 0, 0, 0], [7, 8, 9, 0, 0]]
    empty = pack_rows(torch.tensor([[7, 0], [8, 0]]), torch.tensor([[1, 0], [1, 0]]), one_row=False)
    assert empty.input_ids.shape == (1, 1) and len(empty.targets) == 0  # nothing is predicted: one token still runs


def test_rows_that_would_not_share_packed_rows_run_padded():
    """Rows as wide as the longest sequence must hold at most four fifths as many rows as
    sequences, or the micro-batch runs padded (no mask); one row of all tokens always packs."""
    similar = _batch([("1+2=", 10), ("13-4=", 9), ("7=", 12), ("2-9=", 11), ("3+3=", 10)])
    assert PaddingFree(one_row=False).pack(similar) is None  # 5 rows of 13-15 tokens: 5 packed rows
    assert PaddingFree(one_row=True).pack(similar).input_ids.shape[0] == 1
    tailed = _batch(LONG_TAIL)
    assert PaddingFree(one_row=False).pack(tailed).input_ids.shape == (3, 49)  # 7 rows in 3: [49], [35, 6, 6], [23, 15, 3]


def _padded_stats(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    mask = batch.attention_mask
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=padded_positions(mask)).logits[:, :-1]
    logprobs, entropy = next_token_stats(logits, batch.input_ids[:, 1:], temperature=0.7, entropy="grad")
    return logprobs, entropy


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one-row"])
def test_the_padding_free_forward_is_the_padded_one(attention, one_row):
    """fp32: the logprob and entropy of every real token predicted from a real one, and the
    gradients of a weighted sum of both, as the padded forward (with its padding mask and
    positions) gives them; 0 where padding is predicted, or predicts (a left-padded row)."""
    batch = _left_padded(_batch(LONG_TAIL), row=3)
    real = (batch.attention_mask[:, :-1] != 0) & (batch.attention_mask[:, 1:] != 0)
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(0)) * real
    results = []
    for run in ("padded", "padding-free"):
        model = tiny(attention=attention)
        if run == "padded":
            logprobs, entropy = _padded_stats(model, batch)
        else:
            packed = pack_rows(batch.input_ids, batch.attention_mask, one_row=one_row)
            logprobs, entropy = PaddingFree(one_row=one_row).token_stats(model, packed, temperature=0.7, entropy="grad")
        ((logprobs + entropy) * weights).sum().backward()
        results.append((logprobs, entropy, {n: p.grad for n, p in model.named_parameters()}))
    (want_lp, want_ent, want_grads), (lp, ent, grads) = results
    torch.testing.assert_close(lp[real], want_lp[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[real], want_ent[real], atol=1e-5, rtol=0)
    assert (lp[~real] == 0).all() and (ent[~real] == 0).all()
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("one_row", [True, False], ids=["one-row", "rows"])
def test_logits_are_made_only_where_a_loss_reads_them(one_row):
    """Flash attention's one row (the model's `logits_to_keep`), and rows as wide as the
    longest sequence (the lm_head handed only the kept hidden states, `head_reads`): the
    prompts' positions, which no loss reads, cost no lm_head rows and no log-softmax; the
    logprobs and entropies a loss reads, and their gradients, are those of every position's
    logits, and the prompts' positions are 0, as in a padded micro-batch. (float64: fewer
    positions through the lm_head sum its gradient in another order.)"""
    rows = []
    for k, (prompt, n) in enumerate(LONG_TAIL):
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend([5 + (3 * k + i) % 9 for i in range(n)], [-1.0] * n, 0)
        rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)
    read = batch.loss_mask != 0
    model = tiny(torch.float64)
    widths: list[int] = []
    model.lm_head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    results = []
    for only in (True, False):
        model.zero_grad()
        layout = PaddingFree(one_row=one_row, loss_logits_only=only)
        packed = layout.pack(batch)
        assert packed is not None and (packed.input_ids.shape[0] == 1) is one_row
        logprobs, entropy = layout.token_stats(model, packed, temperature=0.7, entropy="grad")
        ((logprobs + entropy) * batch.loss_mask).sum().backward()
        results.append((logprobs, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert widths == [int(read.sum()), packed.input_ids.shape[1]]  # the loss positions; every fed token
    (lp, ent, grads), (want_lp, want_ent, want_grads) = results
    torch.testing.assert_close(lp[read], want_lp[read], atol=1e-12, rtol=0)
    torch.testing.assert_close(ent[read], want_ent[read], atol=1e-12, rtol=0)
    assert (lp[~read] == 0).all() and (ent[~read] == 0).all()
    assert (want_lp[~read & (batch.attention_mask[:, 1:] != 0) & (batch.attention_mask[:, :-1] != 0)] != 0).all()  # there were prompt logprobs to skip
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-12, rtol=1e-10, msg=name)
    no_loss = dataclasses.replace(batch, loss_mask=torch.zeros_like(batch.loss_mask))
    assert PaddingFree(one_row=one_row, loss_logits_only=True).pack(no_loss).keep is None  # nothing read: every position, as a padded micro-batch


def test_a_model_whose_head_reads_other_than_the_packed_rows_is_told_to_pad():
    """`head_reads` hands the output embedding only the kept positions of the packed rows'
    hidden states: a model that calls it on anything else is refused by name."""

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny()

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.inner.lm_head

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            self.inner.lm_head(torch.zeros(1, 3, 32))  # a second, other call
            return out

    batch = _batch(LONG_TAIL)
    layout = PaddingFree(one_row=False, loss_logits_only=True)
    with pytest.raises(RuntimeError, match=r"Odd's output embedding read hidden states of shape \[1, 3, 32\].*set train\.padding_free=false"):
        layout.token_stats(Odd(), layout.pack(batch), temperature=1.0)


def _engine(padding_free: bool | None, **options) -> TorchTrainEngine:
    return TorchTrainEngine(tiny(torch.float64), lr=1e-2, weight_decay=0.01, padding_free=padding_free, **options)


def _steps(engine: TorchTrainEngine, batch: TokenBatch, *, same_cuts: bool) -> dict[str, torch.Tensor]:
    """A policy step with per-token advantages and given proximal logprobs, and one by
    sequence; with `same_cuts` (both engines cut the rows alike) an entropy bonus and a
    supervised step too. The weights after them. (The loss is computed from float32
    logprobs, `next_token_stats`: the entropy bonus and the supervised loss, summed over
    other cuts, round otherwise at float32's precision, which AdamW makes 1e-7.)"""
    advantages = torch.linspace(-1.0, 1.0, len(batch), dtype=torch.float64)
    per_token = advantages[:, None] * torch.linspace(0.5, 1.5, batch.loss_mask.shape[1], dtype=torch.float64)
    engine.train_step(batch, per_token, loss=PolicyLossConfig(tis_cap=None), proximal_logprobs=batch.behavior_logprobs + 0.05)
    engine.train_step(batch, advantages, loss=PolicyLossConfig(aggregation="seq_mean_token_mean", entropy_coef=0.01 if same_cuts else 0.0), proximal_logprobs=engine.logprobs(batch))
    if same_cuts:
        engine.sft_step(batch)
    return {name: t.detach().clone() for name, t in engine.named_weights()}


@pytest.mark.parametrize("max_tokens", [None, 60], ids=["rows", "token-budget"])
def test_a_padding_free_torch_step_is_the_padded_step(monkeypatch, max_tokens):
    """float64: the same logprobs and the same weights after the steps, whether the
    micro-batches run padded (without a token budget) or padding-free; with a token budget,
    padding-free micro-batches hold at most that many real tokens (more rows than padded
    ones would). Without the shared-prompt packing, which would take the padded engine's
    long-tailed micro-batches."""
    monkeypatch.setattr(torch_train, "_shared_prompts", lambda batch: None)
    batch = _batch(LONG_TAIL, torch.float64)
    padded, free = _engine(False, micro_batch_size=4), _engine(True, micro_batch_size=4, max_tokens_per_micro_batch=max_tokens)
    assert padded.padding_free is None and free.padding_free == PaddingFree(one_row=False, loss_logits_only=True)
    real = batch.attention_mask[:, 1:] != 0
    response = real & (batch.loss_mask.cumsum(1) > 0)  # the padded engine makes no logits before a micro-batch's first loss token
    torch.testing.assert_close(free.logprobs(batch)[response], padded.logprobs(batch)[response], atol=1e-12, rtol=0)
    if max_tokens is not None:
        parts = [rows for rows, _ in free._micro_batches(batch)]
        assert len(parts) > 2 and all(int(real_lengths(batch)[rows].sum()) <= max_tokens for rows in parts if len(rows) > 1)
        budget_padded = _engine(False, micro_batch_size=4, max_tokens_per_micro_batch=max_tokens)
        assert len(list(budget_padded._micro_batches(batch))) > len(parts)  # real tokens fit more rows than padded ones
    want, got = _steps(padded, batch, same_cuts=max_tokens is None), _steps(free, batch, same_cuts=max_tokens is None)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-10, rtol=0, msg=name)


def _grouped(prompt: str, response_lengths: list[int]) -> TokenBatch:
    """One GRPO group: a prompt's samples, with responses of the given lengths."""
    rows = []
    for k, n in enumerate(response_lengths):
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend([5 + (k + i) % 7 for i in range(n)], [-1.0] * n, 0)
        rows.append(t)
    return to_token_batch(rows, pad_id=T.pad_id)


def test_shared_prompts_run_where_they_save_a_fifth_of_the_real_tokens(monkeypatch):
    """A long prompt and short responses: computing the prompt once saves most of the tokens,
    so the torch engine packs by prompt. Long responses to a short prompt: it saves little,
    so they run padding-free; with padding_free=False they still pack by prompt (that saves
    padding). Prompt positions come out 0 either way (no loss reads them)."""
    short = _grouped("12+34+56-78=", [2, 3, 2, 3])
    long = _grouped("1=", [5, 40, 6, 8])
    assert torch_train._shared_prompts(short).beats_padding_free()
    assert torch_train._shared_prompts(long) is not None and not torch_train._shared_prompts(long).beats_padding_free()
    by_prompt: list[int] = []
    packed_logprobs = TorchTrainEngine._packed_logprobs
    monkeypatch.setattr(TorchTrainEngine, "_packed_logprobs", lambda self, *a, **k: by_prompt.append(1) or packed_logprobs(self, *a, **k))
    for batch, engine, packs_by_prompt in ((short, _engine(None), True), (long, _engine(None), False), (long, _engine(False), True)):
        by_prompt.clear()
        logprobs = engine.logprobs(batch)
        real = batch.attention_mask[:, 1:] != 0
        assert bool(by_prompt) is packs_by_prompt
        assert (logprobs[(batch.loss_mask == 0) & real] == 0).all() and (logprobs[batch.loss_mask != 0] != 0).all()


class _NoPositions(torch.nn.Module):
    """A causal LM whose forward takes no position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(T.vocab_size, 8)
        self.head = torch.nn.Linear(8, T.vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        return type("Out", (), {"logits": self.head(self.embed(input_ids).cumsum(1))})()


def test_auto_is_padding_free_where_the_model_can_and_true_is_refused_where_it_cannot():
    assert cannot_pack(tiny()) is None and padding_free_for(tiny(), None) == PaddingFree(one_row=False, loss_logits_only=True)  # it names its lm_head
    assert padding_free_for(tiny(), False) is None
    flash = tiny()
    flash.config._attn_implementation = "flash_attention_2"  # not run: only the layout it would get
    assert padding_free_for(flash, None) == PaddingFree(one_row=True, loss_logits_only=True)  # a transformers model takes logits_to_keep
    assert "position_ids" in cannot_pack(_NoPositions())
    engine = TorchTrainEngine(_NoPositions(), micro_batch_size=2)  # auto: padded, and it trains
    assert engine.padding_free is None
    engine.train_step(_batch(LONG_TAIL[:3]), torch.tensor([1.0, -1.0, 0.5]), loss=PolicyLossConfig())
    with pytest.raises(ValueError, match=r"train\.padding_free=true, but _NoPositions's forward takes no position_ids"):
        TorchTrainEngine(_NoPositions(), padding_free=True)
    odd = tiny()
    odd.config._attn_implementation = "my_kernel"
    with pytest.raises(ValueError, match=r"train\.padding_free=true.*'my_kernel'"):
        TorchTrainEngine(odd, padding_free=True)
    with pytest.raises(ValueError, match=r"train\.padding_free"):  # before it needs a process group
        FSDPTrainEngine(_NoPositions(), padding_free=True)
