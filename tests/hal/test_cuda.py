"""The cuda backend. Real-GPU tests carry the `gpu` marker and are skipped without one."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tidal import hal
from tidal.hal import cuda as cuda_backend


def test_cuda_not_detected_without_a_cuda_build():
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA")
    assert not cuda_backend.available()
    ok, why = hal.availability()["cuda"]
    assert not ok and "CUDA build of torch" in why


@pytest.fixture
def gpu():
    return hal.select_platform("cuda").platform


@pytest.mark.gpu
def test_gpu_identity_and_devices(gpu):
    d = gpu.descriptor
    assert (d.kind, d.dist_backend, d.ray_resource) == ("cuda", "nccl", "GPU")
    assert d.device_count == torch.cuda.device_count() > 0
    assert gpu.device() == torch.device("cuda", torch.cuda.current_device())
    gpu.set_device("cuda:0")
    assert gpu.current_device() == torch.device("cuda", 0)
    assert gpu.process_group_backend == "cpu:gloo,cuda:nccl"
    assert gpu.comm_env_defaults() == {"NCCL_CUMEM_ENABLE": "0"}
    flags = gpu.dtype_support()
    assert flags["fp16"] and flags["fp64"] and isinstance(flags["fp8"], bool)


@pytest.mark.gpu
def test_gpu_memory_streams_rng_profile(gpu):
    gpu.reset_peak_memory_stats()
    before = gpu.memory_allocated()
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=gpu.device())
    assert gpu.memory_allocated() >= before + 64 * 2**20
    assert gpu.max_memory_allocated() >= 64 * 2**20
    assert gpu.memory_reserved() >= gpu.memory_allocated()
    free, total = gpu.mem_get_info()
    assert 0 < free < total
    del x
    gpu.empty_cache()

    stream = gpu.new_stream()
    start, end = gpu.new_event(enable_timing=True), gpu.new_event(enable_timing=True)
    with gpu.use_stream(stream):
        start.record()
        torch.ones(1024, 1024, device=gpu.device()).sum()
        end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0

    gpu.seed_all(5)
    a = torch.rand(4, device=gpu.device())
    state = gpu.get_rng_state()
    b = torch.rand(4, device=gpu.device())
    gpu.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=gpu.device()), b)
    with gpu.fork_rng():
        torch.rand(4, device=gpu.device())
    assert not torch.equal(a, b)
    with gpu.profile_range("test-range"):
        gpu.synchronize()


@pytest.mark.gpu
def test_gpu_offload_round_trip_pinned(gpu):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).to(gpu.device())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device=gpu.device())).sum().backward()
    opt.step()
    before = [t.clone() for t in (model.weight, model.weight.grad, *opt.state[model.weight].values())]
    used = gpu.memory_allocated()
    handle = gpu.offload(module=model, optimizer=opt)
    assert all(t.is_pinned() for t in handle.host_tensors())
    assert gpu.memory_allocated() < used
    refs = [weakref.ref(t) for t in handle.host_tensors()]
    handle.onload()
    gc.collect()
    assert all(r() is None for r in refs)
    after = [model.weight, model.weight.grad, *opt.state[model.weight].values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert model.weight.device.type == "cuda"
