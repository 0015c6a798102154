"""The fsdp engine's padding-free micro-batches across two real processes (FSDP2, gloo on
CPU), with a token budget that cuts the ranks' rows into different numbers of
micro-batches of different lengths: SPMD, and led by rank 0. Both equal one
single-process torch engine running the same rows padded, in float64.

The steps are policy steps: their loss and gradient are the same function of the weights
however the rows are cut, to float64 rounding. (A supervised step or an entropy bonus
sums float32 logprobs, `next_token_stats`, whose rounding depends on the cuts:
test_train_padding_free.py checks those with the cuts alike.)
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from tidal.engines import torch_train
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch

T = CharTokenizer()
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64)
BUDGET = 64
"""Real tokens per micro-batch at most."""
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=8, max_tokens_per_micro_batch=BUDGET, padding_free=True)
RESPONSES = [("1+2=", 40), ("13-4=", 36), ("7=", 31), ("2-9=", 2), ("3+3=", 3), ("8=", 1), ("9-1=", 25), ("5=", 4), ("4+4=", 20), ("6-2=", 5)]
"""Prompts and response lengths: rows of 4 to 45 tokens."""
SHARDS = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9]]
"""SPMD: rank 0 has the three longest rows (one micro-batch each), rank 1 seven shorter ones
(two micro-batches, of 4 to 29 tokens a row)."""

WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from tidal.engines.fsdp_lead import follow, stop_followers
    from tidal.engines.fsdp_train import FSDPTrainEngine
    from tidal.engines.micro_batches import real_lengths
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)
    full, advantages = TokenBatch(*data["batch"]), data["advantages"]

    def engine(**options):
        return FSDPTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=0, **data["model"]).double(), **data["engine"], **options)

    def run(e, batch, adv):
        first = e.logprobs(batch)
        metrics = [e.train_step(batch, adv, loss=PolicyLossConfig(tis_cap=None), proximal_logprobs=batch.behavior_logprobs + 0.05)]
        metrics.append(e.train_step(batch, adv[:, 0], loss=PolicyLossConfig(aggregation="seq_mean_token_mean"), proximal_logprobs=e.logprobs(batch)))
        return first, metrics

    rows = data["shards"][rank]
    batch, adv = full.select(rows), advantages[rows]
    e = engine()
    parts = [(s.stop - s.start, int(real_lengths(batch)[s].sum())) for s in e._micro_batches(batch)]
    logprobs, metrics = run(e, batch, adv)
    weights = [(name, tensor.clone()) for name, tensor in e.named_weights()]
    torch.save({"parts": parts, "logprobs": logprobs, "metrics": metrics, "weights": weights}, work / f"spmd{rank}.pt")
    if rank:
        follow()
    else:
        led = engine(rank0_leads=True)
        logprobs, metrics = run(led, full, advantages)
        weights = [(name, tensor.clone()) for name, tensor in led.named_weights()]
        stop_followers()
        torch.save({"logprobs": logprobs, "metrics": metrics, "weights": weights}, work / "led.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: see the comment above test_fsdp_train.WORKER
    """
)


def _batch() -> tuple[TokenBatch, torch.Tensor]:
    """The rows, and per-token advantages (a row's own value on each position); row 5's are 0 (skipped)."""
    rows = []
    for k, (prompt, n) in enumerate(RESPONSES):
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend([5 + (3 * k + i) % 9 for i in range(n)], [-1.0 - 0.05 * i for i in range(n)], 0)
        rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)
    per_row = torch.linspace(-1.0, 1.0, len(rows), dtype=torch.float64)
    per_row[5] = 0.0
    batch = dataclasses.replace(batch, behavior_logprobs=batch.behavior_logprobs.double())
    return batch, per_row[:, None].expand(-1, batch.loss_mask.shape[1]).clone()


def _reference(batch: TokenBatch, advantages: torch.Tensor) -> dict:
    """One torch engine, every row in one padded micro-batch (no shared-prompt packing): the
    logprobs before the steps and the weights after them."""
    engine = TorchTrainEngine(build_tiny_qwen2(T.vocab_size, seed=0, **MODEL).double(), lr=ENGINE["lr"], weight_decay=ENGINE["weight_decay"], micro_batch_size=64, padding_free=False)
    logprobs = engine.logprobs(batch)
    engine.train_step(batch, advantages, loss=PolicyLossConfig(tis_cap=None), proximal_logprobs=batch.behavior_logprobs + 0.05)
    engine.train_step(batch, advantages[:, 0], loss=PolicyLossConfig(aggregation="seq_mean_token_mean"), proximal_logprobs=engine.logprobs(batch))
    return {"logprobs": logprobs, "weights": {name: t.clone() for name, t in engine.named_weights()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, spawn, write_data) -> dict:
    work = tmp_path_factory.mktemp("padding-free")
    batch, advantages = _batch()
    write_data(work, batch, advantages, shards=SHARDS, model=MODEL, engine=ENGINE, vocab_size=T.vocab_size)
    spawn(work, WORKER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_train, "_shared_prompts", lambda batch: None)
        reference = _reference(batch, advantages)
    load = lambda name: torch.load(work / name, weights_only=False)
    return {"batch": batch, "reference": reference, "spmd": [load(f"spmd{rank}.pt") for rank in range(2)], "led": load("led.pt")}


def _assert_same_weights(got: list, want: dict) -> None:
    got = dict(got)
    assert got.keys() == want.keys()
    for name, expected in want.items():
        torch.testing.assert_close(got[name], expected, atol=1e-10, rtol=0, msg=name)


def test_the_ranks_cut_their_rows_by_real_tokens_into_different_micro_batches(runs):
    parts = [run["parts"] for run in runs["spmd"]]
    assert [len(p) for p in parts] == [3, 2], parts
    assert [rows for rows, _ in parts[0]] == [1, 1, 1]  # 45 + 42 and 42 + 34 real tokens > 64: one row each
    assert all(tokens <= BUDGET for rows, tokens in parts[1]) and sum(rows for rows, _ in parts[1]) == 7


def test_two_padding_free_ranks_equal_one_padded_torch_engine(runs):
    """SPMD with each rank's rows: logprobs where a response token is predicted (the padded
    engine makes no logits before a micro-batch's first loss token), then the weights after two steps."""
    batch, reference = runs["batch"], runs["reference"]
    real = batch.attention_mask[:, 1:] != 0
    response = real & (batch.loss_mask.cumsum(1) > 0)
    for rank, rows in enumerate(SHARDS):
        got = runs["spmd"][rank]["logprobs"]
        torch.testing.assert_close(got[response[rows]], reference["logprobs"][rows][response[rows]], atol=1e-12, rtol=0)
        assert (got[~real[rows]] == 0).all()
    for rank in range(2):
        _assert_same_weights(runs["spmd"][rank]["weights"], reference["weights"])
    assert runs["spmd"][0]["metrics"] == runs["spmd"][1]["metrics"]  # the whole batch's, on every rank
    assert runs["spmd"][0]["metrics"][0]["skipped_rows"] == 1.0


def test_a_padding_free_group_led_by_rank0_equals_one_padded_torch_engine(runs):
    """Rank 0 alone is called with every row (the followers build the padding-free engine too)."""
    batch, reference = runs["batch"], runs["reference"]
    response = (batch.attention_mask[:, 1:] != 0) & (batch.loss_mask.cumsum(1) > 0)
    torch.testing.assert_close(runs["led"]["logprobs"][response], reference["logprobs"][response], atol=1e-12, rtol=0)
    _assert_same_weights(runs["led"]["weights"], reference["weights"])
