"""Micro-batches sized by a token budget (`train.max_tokens_per_micro_batch`): how rows are
packed, and that a step cut by the budget is the step of one big batch, in the torch and
fsdp engines (the fsdp one in a group of this process alone)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tidal.engines.fsdp_train import FSDPTrainEngine
from tidal.engines.micro_batches import pack, rank_shares, row_lengths
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.hal import current_platform

T = CharTokenizer()
RESPONSES = [("1+2=", 2), ("13-4=", 9), ("7=", 1), ("2-9=", 5), ("3+3=", 12), ("8=", 3)]
"""Prompts and their response lengths: rows of 7 to 17 positions."""


def _model() -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=0).double()


def _batch():
    rows = []
    for k, (prompt, n) in enumerate(RESPONSES):
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend([5 + (k + i) % 7 for i in range(n)], [-1.0 - 0.1 * i for i in range(n)], 0)
        rows.append(t)
    return to_token_batch(rows, pad_id=T.pad_id)


def test_rows_are_packed_greedily_within_rows_and_padded_tokens():
    assert pack([2, 3, 3, 5, 9, 20], max_rows=64, max_tokens=10) == [slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 6)]  # 3x3=9; 4x5=20 > 10; 2x9 > 10; 20 alone
    assert pack([2, 3, 3, 5, 9, 20], max_rows=2, max_tokens=None) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert pack([4, 4, 4, 4], max_rows=3, max_tokens=100) == [slice(0, 3), slice(3, 4)]  # the row bound still holds
    assert pack([], max_rows=2, max_tokens=8) == []
    assert pack([2, 3, 3, 5, 9, 20], max_rows=64, max_tokens=10, padded=False) == [slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 6)]  # 2+3+3=8; 5+9 > 10
    assert pack([1, 1, 1, 1, 6], max_rows=64, max_tokens=10, padded=False) == [slice(0, 5)]  # 10 real tokens; padded, 5 x 6
    assert pack([1, 1, 1, 1, 6], max_rows=64, max_tokens=10) == [slice(0, 4), slice(4, 5)]


def _step(engine, per_token: bool) -> dict[str, torch.Tensor]:
    batch = _batch()
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, 0.5], dtype=torch.float64)
    if per_token:
        advantages = advantages[:, None] * torch.linspace(0.5, 1.5, batch.loss_mask.shape[1], dtype=torch.float64)
    proximal = batch.behavior_logprobs.double() + 0.05  # given, and cut with each micro-batch
    engine.train_step(batch, advantages, loss=PolicyLossConfig(tis_cap=None), proximal_logprobs=proximal)
    return {name: t.detach().clone() for name, t in engine.named_weights()}


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sequence", "per-token"])
def test_a_token_budget_gives_the_torch_engine_the_step_of_one_batch(per_token):
    """Padded micro-batches (padding-free ones: test_train_padding_free.py)."""
    whole = _step(TorchTrainEngine(_model(), lr=1e-2, micro_batch_size=64, padding_free=False), per_token)
    engine = TorchTrainEngine(_model(), lr=1e-2, micro_batch_size=64, max_tokens_per_micro_batch=30, padding_free=False)
    parts = [len(rows) * part.input_ids.shape[1] for rows, part in engine._micro_batches(_batch())]
    assert len(parts) > 2 and max(parts) <= 30, parts
    cut = _step(engine, per_token)
    for name in whole:
        assert torch.allclose(whole[name], cut[name], atol=1e-10), name


def test_a_token_budget_below_two_is_refused():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        TorchTrainEngine(_model(), max_tokens_per_micro_batch=1)


@pytest.fixture
def group(tmp_path):
    """A process group of this process alone."""
    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sequence", "per-token"])
def test_a_token_budget_gives_the_fsdp_engine_the_step_of_one_batch(group, per_token):
    """Padded micro-batches (padding-free ones: test_fsdp_padding_free.py)."""
    whole_engine = FSDPTrainEngine(_model(), lr=1e-2, micro_batch_size=64, padding_free=False)
    whole, whole_logprobs = _step(whole_engine, per_token), whole_engine.logprobs(_batch())
    engine = FSDPTrainEngine(_model(), lr=1e-2, micro_batch_size=64, max_tokens_per_micro_batch=30, padding_free=False)
    batch = _batch()
    lengths = row_lengths(batch)
    slices = engine._micro_batches(batch)
    assert len(slices) > 2 and max(len(range(*s.indices(len(batch)))) * int(lengths[s].max()) for s in slices) <= 30
    cut = _step(engine, per_token)
    for name in whole:
        assert torch.allclose(whole[name], cut[name], atol=1e-10), name
    mask = (batch.attention_mask[:, 1:] != 0) & (batch.loss_mask.cumsum(1) > 0)  # where a row predicts a response token
    assert mask.any() and torch.allclose(engine.logprobs(batch)[mask], whole_logprobs[mask], atol=1e-10)


# The ranks' shares of a step -------------------------------------------------------------
def _busiest(lengths, shares):
    return max(sum(lengths[i] for i in share) for share in shares)


def test_rank_shares_give_every_row_once_in_batch_order_and_counts_within_one():
    lengths = [5, 300, 7, 9, 40, 41, 2, 1000, 3, 8, 8]
    for ranks in (1, 2, 3, 4, 11, 16):
        shares = rank_shares(lengths, ranks)
        assert len(shares) == ranks
        assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
        assert all(share == sorted(share) for share in shares)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert rank_shares([], 3) == [[], [], []]
    assert rank_shares([4, 1, 3, 2], 2) == [[0, 1], [2, 3]]  # 4 first to rank 0, 3 to rank 1, 2 to rank 1 (3 < 4), 1 to rank 0: 5 and 5
    with pytest.raises(ValueError, match="ranks"):
        rank_shares([1], 0)


def test_rank_shares_even_out_a_long_tail_that_contiguous_shares_leave_on_a_few_ranks():
    """8,192 lognormal lengths (sigma ~1, capped at 28k), grouped 16 to a prompt as a GRPO step's are."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.exp(torch.randn(512, 1, generator=gen) * 0.85 + 6.3)
    lengths = (prompt * torch.exp(torch.randn(512, 16, generator=gen) * 0.45)).clamp(1, 28_672).long().flatten().tolist()
    mean = sum(lengths) / 64
    contiguous = [list(range(len(lengths) * r // 64, len(lengths) * (r + 1) // 64)) for r in range(64)]
    assert _busiest(lengths, contiguous) > 1.3 * mean  # the step waits on its busiest rank
    assert _busiest(lengths, rank_shares(lengths, 64)) < 1.02 * mean
