"""LoRA adapters in the fsdp train engine across two real processes (FSDP2, gloo on CPU):
the steps, the merged weights, the KL reference (the base with the adapters off) and the
state equal the torch engine's with the same adapters, SPMD and led by rank 0."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.engines.lora_steps import (
    assert_same_weights,
    assert_state_is_the_torch_engines,
    assert_trains_the_torch_engines_adapters,
    torch_reference,
    write_run_data,
)

pytest.importorskip("peft")

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
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    import rank_worker  # beside this script (conftest.spawn_ranks)

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)
    led = data["led"]

    def engine(seed):
        return FSDPTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=seed, **data["model"]), rank0_leads=led, **data["engine"])

    rows = list(range(6)) if led else data["shards"][rank]
    batch = TokenBatch(*(t[rows] for t in data["batch"]))
    advantages = data["advantages"][rows]

    def run(e, plan):
        return rank_worker.run_plan(e, batch, advantages, plan)

    export = rank_worker.export

    out = {}
    if led and rank != 0:
        follow()
    else:
        e = engine(0)
        out["trained"] = sorted(n for n, p in e.model.named_parameters() if p.requires_grad)
        out["metrics"] = run(e, data["plan"])
        out["weights"] = export(e)
        out["specs"] = e.named_weights().specs()
        out["state"] = e.state_dict()
        other = engine(7)
        other.load_state_dict(data["torch_state"])
        run(other, data["resume"])
        out["from_torch"] = export(other)
        if led:
            stop_followers()
    if rank == 0:
        torch.save(out, work / "result.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see tests/engines/test_fsdp_train.py)
    """
)


@pytest.fixture(scope="module")
def reference(six_rows, run_torch) -> dict:
    return torch_reference(six_rows, run_torch)


@pytest.fixture(scope="module", params=[False, True], ids=["spmd", "led"])
def fsdp_run(request, tmp_path_factory, reference, spawn, write_data) -> dict:
    work = tmp_path_factory.mktemp("fsdp-lora")
    write_run_data(write_data, work, reference, led=request.param)
    spawn(work, WORKER)
    return torch.load(work / "result.pt", weights_only=False)


def test_two_ranks_train_the_torch_engines_adapters(fsdp_run, reference):
    assert_trains_the_torch_engines_adapters(fsdp_run, reference)


def test_the_state_is_the_torch_engines_both_ways(fsdp_run, reference):
    assert_state_is_the_torch_engines(fsdp_run, reference)


@pytest.mark.gpu
def test_one_rank_on_a_real_gpu_trains_the_torch_engines_adapters(tmp_path, reference, spawn, write_data):
    """FSDP2 over NCCL on one real GPU (a group of one holding every row) trains the adapters
    the torch engine trains on CPU, and exports the same merged weights."""
    write_run_data(write_data, tmp_path, reference, led=False, shards=[list(range(6))])
    spawn(tmp_path, WORKER, world=1, device="cuda")
    run = torch.load(tmp_path / "result.pt", weights_only=False, map_location="cpu")
    got = dict(run["weights"])
    for name, expected in reference["weights"]:  # float32 on another device: sums in another order
        torch.testing.assert_close(got[name], expected, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert_same_weights(run["from_torch"], reference["continued"])
