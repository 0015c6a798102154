"""Offload / onload of a module's parameters, gradients and AdamW state.

Run on the fake platform, which copies for real (the CPU platform has nothing to move);
the same code path runs on GPUs under the `gpu` marker in test_cuda.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tidal import hal


def _trained_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 50))
    model[2].weight = model[0].weight  # tied weights are moved once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.arange(10) % 50
    loss = torch.nn.functional.cross_entropy(model(x), (x + 1) % 50)
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.detach().clone())
        out.append(p.grad.clone())
    for state in opt.state.values():
        out.extend(v.clone() for v in state.values() if isinstance(v, torch.Tensor))
    return out


def test_round_trip_is_bit_exact_and_releases_host_memory():
    platform = hal.select_platform("fake:npu:8").platform
    model, opt = _trained_model()
    before = snapshot(model, opt)
    device_ptrs = {p.data_ptr() for p in model.parameters()}

    handle = platform.offload(module=model, optimizer=opt)
    host = handle.host_tensors()
    num_tensors = len(list(model.parameters())) * 2 + sum(
        isinstance(v, torch.Tensor) for s in opt.state.values() for v in s.values()
    )
    assert len(host) == num_tensors
    assert handle.num_bytes == sum(t.numel() * t.element_size() for t in host)
    # The module and optimizer now point at the host buffers, not the old storage.
    assert {p.data_ptr() for p in model.parameters()}.isdisjoint(device_ptrs)
    assert {p.data_ptr() for p in model.parameters()} <= {t.data_ptr() for t in host}
    alive = [weakref.ref(t) for t in host]
    del host

    handle.onload()
    gc.collect()
    assert not any(r() is not None for r in alive), "host buffers still referenced after onload"
    assert handle.host_tensors() == [] and not handle.offloaded
    after = snapshot(model, opt)
    assert len(after) == len(before)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert model[2].weight is model[0].weight


def test_training_after_round_trip_matches_training_without_one():
    platform = hal.select_platform("fake:cuda:1").platform
    ref_model, ref_opt = _trained_model(seed=3)
    model, opt = _trained_model(seed=3)
    platform.offload(module=model, optimizer=opt).onload()
    step(ref_model, ref_opt)
    step(model, opt)
    for a, b in zip(snapshot(ref_model, ref_opt), snapshot(model, opt)):
        assert torch.equal(a, b)


def test_module_only_and_optimizer_only():
    platform = hal.select_platform("fake:npu:1").platform
    model, opt = _trained_model()
    before = snapshot(model, opt)
    h1 = platform.offload(module=model)
    h2 = platform.offload(optimizer=opt)
    h2.onload()
    h1.onload()
    for a, b in zip(before, snapshot(model, opt)):
        assert torch.equal(a, b)


def test_onload_twice_is_an_error():
    handle = hal.select_platform("fake:npu:1").platform.offload(module=torch.nn.Linear(2, 2))
    handle.onload()
    with pytest.raises(RuntimeError, match="twice"):
        handle.onload()


def test_cpu_platform_moves_nothing():
    model, opt = _trained_model()
    ptrs = [p.data_ptr() for p in model.parameters()]
    handle = hal.select_platform("cpu").platform.offload(module=model, optimizer=opt)
    assert handle.host_tensors() == [] and handle.num_bytes == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    handle.onload()


def test_a_dtensor_moves_its_local_shard_and_stays_a_dtensor(tmp_path):
    """Sharded parameters (FSDP2's DTensors), their gradients and AdamW state: the local shard moves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    platform = hal.select_platform("fake:cuda:1").platform
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
        opt = torch.optim.AdamW([weight], lr=1e-2)
        (weight.full_tensor() ** 2).sum().backward()
        opt.step()
        module = torch.nn.Module()
        module.weight = weight
        tensors = [weight, weight.grad, *(v for v in opt.state[weight].values() if isinstance(v, DTensor))]
        before = [(t._local_tensor, t._local_tensor.clone()) for t in tensors]
        handle = platform.offload(module=module, optimizer=opt)
        assert handle.num_bytes == 4 * (6 * 4) * 4 + 4  # weight, gradient, two moments (float32) and AdamW's step
        for t, (old, _) in zip(tensors, before):
            assert isinstance(t, DTensor) and t._local_tensor is not old  # the shard moved; the DTensor stays
        handle.onload()
        for t, (_, values) in zip(tensors, before):
            assert torch.equal(t._local_tensor, values) and t.shape == (6, 4)
    finally:
        dist.destroy_process_group()


def test_an_onload_that_fails_part_way_leaves_everything_on_the_host_to_try_again(monkeypatch):
    """Device memory can run out part way through an onload (a guest's memory not yet
    returned). The handle was marked onloaded before any copy: a second try was refused
    ("twice") and the state stayed in host buffers no one could bring back."""
    platform = hal.select_platform("fake:cuda:1").platform
    model, opt = _trained_model()
    before = snapshot(model, opt)
    handle = platform.offload(module=model, optimizer=opt)
    host = {t.data_ptr() for t in handle.host_tensors()}
    real_empty, calls = torch.empty, [0]

    def empty_then_out_of_memory(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("out of device memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_then_out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        handle.onload()
    monkeypatch.setattr(torch, "empty", real_empty)
    assert handle.offloaded and {p.data_ptr() for p in model.parameters()} <= host  # nothing half-moved
    handle.onload()
    assert not handle.offloaded and handle.host_tensors() == []
    for a, b in zip(before, snapshot(model, opt), strict=True):
        assert torch.equal(a, b)
