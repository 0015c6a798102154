"""LoRA adapters in the deepspeed train engine across two real processes (DeepSpeed's CPU
accelerator, gloo): the steps, the merged weights, the KL reference (the base with the
adapters off), parking and the state equal the torch engine's with the same adapters, under
ZeRO-1 and -2 (every rank holds the base whole, the adapters in DeepSpeed's flat buffers)
and ZeRO-3 (the base partitioned too), SPMD and led by rank 0."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.engines.lora_steps import (
    assert_same_weights,
    assert_state_is_the_torch_engines,
    assert_trains_the_torch_engines_adapters,
    model,
    torch_reference,
    write_run_data,
)

pytest.importorskip("deepspeed")
pytest.importorskip("peft")

WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from tidal.engines.deepspeed_lead import follow
    from tidal.engines.deepspeed_train import DeepSpeedTrainEngine
    from tidal.engines.fsdp_lead import stop_followers
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    import rank_worker  # beside this script (conftest.spawn_ranks)

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)
    led, stage = data["led"], data["stage"]

    def engine(seed):
        return DeepSpeedTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=seed, **data["model"]), rank0_leads=led, zero_stage=stage, **data["engine"])

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
        out["trained"] = sorted(n for n, p in e.module.named_parameters() if p.requires_grad)
        out["metrics"] = run(e, data["plan"])
        out["moments"] = sum(s["exp_avg"].numel() for s in e.optimizer.state.values() if "exp_avg" in s)
        out["weights"] = export(e)
        out["specs"] = e.named_weights().specs()
        out["state"] = e.state_dict()
        e.park()
        e.unpark()
        out["parked_state"] = e.state_dict()
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


@pytest.fixture(scope="module", params=[(2, False), (3, False), (1, True), (2, True), (3, True)], ids=["zero2-spmd", "zero3-spmd", "zero1-led", "zero2-led", "zero3-led"])
def ds_run(request, tmp_path_factory, reference, spawn, write_data) -> dict:
    stage, led = request.param
    work = tmp_path_factory.mktemp("deepspeed-lora")
    write_run_data(write_data, work, reference, led=led, stage=stage)
    spawn(work, WORKER)
    return torch.load(work / "result.pt", weights_only=False)


def test_two_ranks_train_the_torch_engines_adapters(ds_run, reference):
    assert_trains_the_torch_engines_adapters(ds_run, reference)
    adapters = sum(t.numel() for t in reference["state"]["lora"]["adapters"].values())
    assert 0 < ds_run["moments"] <= adapters + 2  # AdamW's moments (of this rank's flat slices, padded to the ranks) are the adapters' only
    assert [(s.shape, s.dtype) for s in ds_run["specs"]] == [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in model(0).state_dict().values()]


def test_the_state_is_the_torch_engines_both_ways_and_parking_keeps_it(ds_run, reference):
    assert_state_is_the_torch_engines(ds_run, reference)
    state, want = ds_run["state"], reference["state"]
    for index, moments in state["optimizer"]["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(value, want["optimizer"]["state"][index][key], rtol=1e-4, atol=1e-6, msg=f"{index} {key}")
    parked = ds_run["parked_state"]
    for part in ("base", "adapters"):
        assert all(torch.equal(parked["lora"][part][n], t) for n, t in state["lora"][part].items()), part


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_on_a_real_gpu_trains_the_torch_engines_adapters_and_parks(tmp_path, reference, spawn, write_data, stage):
    """DeepSpeed over NCCL on one real GPU (a group of one holding every row) trains the adapters
    the torch engine trains on CPU, and its state survives a park to host memory and back
    (where ZeRO-3's `offload_zero3_lp_params` really moves the flat buffer)."""
    write_run_data(write_data, tmp_path, reference, led=False, stage=stage, shards=[list(range(6))])
    spawn(tmp_path, WORKER, world=1, device="cuda")
    run = torch.load(tmp_path / "result.pt", weights_only=False, map_location="cpu")
    got = dict(run["weights"])
    for name, expected in reference["weights"]:  # float32 on another device: sums in another order
        torch.testing.assert_close(got[name], expected, atol=1e-4, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    for part in ("base", "adapters"):
        assert all(torch.equal(run["parked_state"]["lora"][part][n], t) for n, t in run["state"]["lora"][part].items()), part
    assert_same_weights(run["from_torch"], reference["continued"])
