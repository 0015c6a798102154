"""A park or an onload that fails part way: the seat keeps a state it can compute with (or
fails loudly), never a half-moved one it computes on."""

from __future__ import annotations

import pytest
import torch

from tidal.flow.timeshare import Offloader, Seat
from tidal.flow.turns import Turns
from tidal.hal import select_platform


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def seated(platform, model: torch.nn.Module, optimizer: torch.optim.Optimizer, moved=None) -> tuple[Offloader, Turns, Seat, Seat]:
    """A `Turns` with the trainer's seat (parking `model` and `optimizer` through an
    `Offloader`, `moved` its hook) and a guest's that parks nothing."""
    offloader = Offloader(platform, model, optimizer, moved=moved)
    turns = Turns()
    return offloader, turns, Seat(turns, "train", park=offloader.park, unpark=offloader.unpark), Seat(turns, "rollout", park=lambda: None, unpark=lambda: None)


def values(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [v.clone() for s in optimizer.state.values() for v in s.values()]


class ShardedLike:
    """What FSDP2 does that `after_offload_move` is for: it keeps its own references to the
    shards (`shards`), pointed at the parameters' current storage by `moved()`, which can fail."""

    def __init__(self, model: torch.nn.Module, *, failures: int) -> None:
        self.model, self.failures = model, failures
        self.shards = [p.data for p in model.parameters()]

    def moved(self) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("FSDP's shard buffers could not be pointed at the moved shards")
        self.shards = [p.data for p in self.model.parameters()]

    def consistent(self) -> bool:
        return [s.data_ptr() for s in self.shards] == [p.data_ptr() for p in self.model.parameters()]


def test_a_park_whose_hook_fails_leaves_the_trainer_computing_on_its_own_state():
    """The offload had moved every tensor to host buffers when `after_offload_move` raised:
    the seat was not marked parked, so its next turn computed on the host copies (on an
    accelerator: a device mismatch, or FSDP gathering from shards the optimizer no longer
    updates), and the next park offloaded those again, dropping the first handle."""
    platform = select_platform("fake:cuda:1").platform
    model, optimizer = trained()
    before = values(model, optimizer)
    sharded = ShardedLike(model, failures=1)
    offloader, turns, train, guest = seated(platform, model, optimizer, sharded.moved)
    try:
        with train.turn():
            pass
        with pytest.raises(RuntimeError, match=r"'train' failed to move its state off the devices \(RuntimeError: FSDP's shard buffers"):
            turns.acquire("rollout", timeout=30)
        with train.turn():  # its state is back where it computes, and FSDP's references agree
            assert offloader._handle is None and sharded.consistent()
            assert all(torch.equal(x, y) for x, y in zip(before, values(model, optimizer), strict=True))
        with guest.turn():  # the next park succeeds
            assert train.num_parks == 1 and offloader._handle is not None and sharded.consistent()
        with train.turn():
            assert offloader._handle is None and sharded.consistent()
            assert all(torch.equal(x, y) for x, y in zip(before, values(model, optimizer), strict=True))
    finally:
        train.close(), guest.close()


def test_an_onload_that_fails_is_tried_again_at_the_next_turn(monkeypatch):
    """Device memory ran out while the trainer's state came back: its step failed, and every
    later turn failed too (the handle was dropped before the onload: `None.onload()`)."""
    platform = select_platform("fake:cuda:1").platform
    model, optimizer = trained()
    before = values(model, optimizer)
    offloader, turns, train, guest = seated(platform, model, optimizer)
    real_empty = torch.empty

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of device memory")

    try:
        with train.turn():
            pass
        with guest.turn():
            assert train.num_parks == 1
        monkeypatch.setattr(torch, "empty", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError), train.turn():
            pass
        monkeypatch.setattr(torch, "empty", real_empty)
        assert turns.state()["holder"] is None  # the turn was given back
        with train.turn():
            assert offloader._handle is None
            assert all(torch.equal(x, y) for x, y in zip(before, values(model, optimizer), strict=True))
    finally:
        train.close(), guest.close()


def test_an_onload_whose_hook_fails_points_fsdp_at_the_shards_at_the_next_turn():
    """The onload brought the shards back but `after_offload_move` raised: the next turn
    must point FSDP at them (not compute with its references on the host copies)."""
    platform = select_platform("fake:cuda:1").platform
    model, optimizer = trained()
    sharded = ShardedLike(model, failures=0)
    offloader, turns, train, guest = seated(platform, model, optimizer, sharded.moved)
    try:
        with train.turn():
            pass
        with guest.turn():
            assert train.num_parks == 1
        sharded.failures = 1
        with pytest.raises(RuntimeError, match="shard buffers"), train.turn():
            pass
        # its shards are on the devices again: a guest must not be told they are parked
        with pytest.raises(RuntimeError, match=r"'train' failed to move its state off the devices \(its last onload failed: RuntimeError: FSDP's"):
            turns.acquire("rollout", timeout=30)
        with train.turn():
            assert offloader._handle is None and sharded.consistent()
        with guest.turn():
            assert train.num_parks == 2
    finally:
        train.close(), guest.close()


def test_a_sharded_trainer_whose_park_hook_failed_part_way_trains_as_one_never_parked(tmp_path, monkeypatch):
    """The real FSDP2 hook failing after it had pointed some parameters' flat shard buffers
    at the host copies: the next turn brings everything back and points FSDP at every shard,
    so the steps equal those of an engine that never parked."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from tidal.engines.fsdp_train import FSDPTrainEngine
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.trajectory import TokenBatch

    platform = select_platform("fake:cuda:1").platform
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        engines = [FSDPTrainEngine(build_tiny_qwen2(20, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=0), platform=platform) for _ in range(2)]
        shared, plain = engines
        torch.manual_seed(1)
        ids = torch.randint(3, 20, (4, 12))
        batch = TokenBatch(ids, torch.ones_like(ids), torch.ones(4, 11), torch.zeros(4, 11), torch.zeros(4, 11, dtype=torch.long))
        offloader = Offloader(platform, shared.model, shared.optimizer, moved=shared.after_offload_move)
        turns = Turns()
        train = Seat(turns, "train", park=offloader.park, unpark=offloader.unpark)
        guest = Seat(turns, "rollout", park=lambda: None, unpark=lambda: None)
        real_reset, calls = FSDPParam.reset_sharded_param, [0]

        def reset_then_fail(self):
            calls[0] += 1
            if calls[0] == 3:  # two parameters pointed at their host copies, the rest not
                raise RuntimeError("reset_sharded_param failed")
            return real_reset(self)

        try:
            for engine in engines:
                engine.sft_step(batch)
            with train.turn():
                pass
            monkeypatch.setattr(FSDPParam, "reset_sharded_param", reset_then_fail)
            with pytest.raises(RuntimeError, match="reset_sharded_param failed"):
                turns.acquire("rollout", timeout=30)
            monkeypatch.setattr(FSDPParam, "reset_sharded_param", real_reset)
            with train.turn():  # two steps: the second's forward reads what the first stepped
                shared.sft_step(batch)
                shared.sft_step(batch)
                got = shared.logprobs(batch)
            for _ in range(2):
                plain.sft_step(batch)
            assert torch.equal(got, plain.logprobs(batch))
            with guest.turn():  # a park and an onload that work, for good measure
                pass
            with train.turn():
                shared.sft_step(batch)
                got = shared.logprobs(batch)
            plain.sft_step(batch)
            assert torch.equal(got, plain.logprobs(batch))
        finally:
            train.close(), guest.close()
    finally:
        dist.destroy_process_group()
