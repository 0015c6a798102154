"""The fsdp train engine across two real processes (FSDP2, gloo on CPU) when one rank's
gradient is not finite: every rank skips the step together (see `conftest.spawn_ranks` for
how the workers run)."""

from __future__ import annotations

import textwrap

import torch

from tidal.engines.tiny import CharTokenizer

T = CharTokenizer()
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=2)
SHARDS = [[0, 1, 2, 3], [4, 5]]
"""Rows of each rank (`conftest.six_row_batch`): rank 0's rows 0 and 1 have a loss token and an advantage."""

# Ends with `os._exit(0)` once its results are written and the group is destroyed: see the
# comment above WORKER in test_fsdp_train.py.
NONFINITE_WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from tidal.engines.fsdp_train import FSDPTrainEngine
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform
    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)
    batch, good = TokenBatch(*(t[data["shards"][rank]] for t in data["batch"])), data["advantages"][data["shards"][rank]]
    bad = torch.full_like(good, float("nan")) if rank else good  # only rank 1's rows are bad
    e = FSDPTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=0, **data["model"]), max_nonfinite_steps=1, **data["engine"])
    state = lambda: [getattr(t, "to_local", lambda: t)().clone() for t in [*e.model.parameters(), *(v for s in e.optimizer.state.values() for v in s.values())]]
    out = {"metrics": [e.train_step(batch, good, loss=PolicyLossConfig())]}
    before = state()
    out["metrics"].append(e.train_step(batch, bad, loss=PolicyLossConfig()))
    out["unchanged"] = len(before) > 30 and all(torch.equal(a, b) for a, b in zip(before, state(), strict=True))
    try:
        e.train_step(batch, bad, loss=PolicyLossConfig())
    except FloatingPointError as error:
        out["error"] = str(error)
    out["metrics"].append(e.train_step(batch, good, loss=PolicyLossConfig()))
    torch.save({**out, "version": e.version}, work / f"result{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see the comment above WORKER in test_fsdp_train.py
    """
)


def test_a_non_finite_gradient_on_one_rank_is_skipped_by_every_rank_in_step(tmp_path, six_rows, spawn, write_data):
    """NaN advantages on rank 1's rows: both ranks skip (shards, AdamW state kept), raise at the next (max 1), go on."""
    batch, advantages = six_rows
    write_data(tmp_path, batch, advantages, shards=SHARDS, model=MODEL, engine=ENGINE, vocab_size=T.vocab_size)
    spawn(tmp_path, NONFINITE_WORKER)
    for rank in (0, 1):
        run = torch.load(tmp_path / f"result{rank}.pt", weights_only=False)
        assert ([m["nonfinite_grad"] for m in run["metrics"]], run["version"], run["unchanged"], run["error"][:80]) == ([0.0, 1.0, 0.0], 3, True, "the gradient norm was nan at 2 optimizer steps in a row, the last at version 2; "), rank
