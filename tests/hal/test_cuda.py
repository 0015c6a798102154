"""The cuda backend. Real-GPU tests carry the `gpu` marker and are skipped without one."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import types
import weakref

import pytest
import torch

from tidal import hal
from tidal.hal import cuda as cuda_backend
from tidal.hal.accelerator import AcceleratorPlatform, Vendor
from tidal.hal.transfer import expected_specs
from tidal.hal.transfer.host import HostReceiver, HostSender
from tidal.hal.transfer.ipc import IpcSender


def test_cuda_not_detected_without_a_cuda_build():
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA")
    assert not cuda_backend.available()
    ok, why = hal.availability()["cuda"]
    assert not ok and "CUDA build of torch" in why


def test_setting_visible_devices_before_init_recounts_the_devices(monkeypatch):
    """torch.cuda counts devices under CUDA_VISIBLE_DEVICES until it initialises (NVML);
    the platform's descriptor follows the new count. A stand-in module, no GPU needed."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    state = {"initialized": False}
    module = types.SimpleNamespace(device_count=lambda: len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")))
    vendor = Vendor(kind="cuda", module=module, comm_env={}, range_start=print, range_end=print, dtype_support=dict, fused_optimizers=True, initialized=lambda: state["initialized"])
    platform = AcceleratorPlatform(vendor)
    assert platform.descriptor.device_count == 4
    platform.set_visible_devices([2, 3])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and platform.descriptor.device_count == platform.device_count() == 2
    state["initialized"] = True
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES must be set before cuda is initialised"):
        platform.set_visible_devices([0])


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
    layer = torch.nn.Linear(8, 8, device=gpu.device())
    with gpu.autocast("fp16"):
        assert layer(torch.randn(2, 8, device=gpu.device())).dtype == torch.float16
    assert layer.weight.dtype == torch.float32


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


IPC_RECEIVER = textwrap.dedent(
    """
    import sys

    import torch

    from tidal.hal import select_platform
    from tidal.hal.transfer.ipc import IpcReceiver

    receiver = IpcReceiver(select_platform("cuda").platform)
    print(receiver.address, flush=True)
    for _ in range(int(sys.argv[2])):
        got = receiver.receive(60)
        devices = sorted({str(t.device) for t in got.tensors.values()})
        torch.save({"devices": devices, "tensors": {n: t.cpu() for n, t in got.tensors.items()}}, f"{sys.argv[1]}/v{got.version}.pt")
    receiver.close()
    """
)


def _device_weights(gpu, seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cpu = {
        "embed.weight": torch.randn(256 * scale, 64, generator=g),
        "norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),  # odd byte count: misaligns what follows
        "mlp.weight": torch.randn(33, 64, generator=g).to(torch.float16),
        "step": torch.tensor([seed], dtype=torch.int64),
    }
    return {n: t.to(gpu.device()) for n, t in cpu.items()}


@pytest.mark.gpu
def test_gpu_ipc_transport_hands_device_weights_to_another_process(gpu, tmp_path):
    """CUDA IPC for real: the receiver (another process) opens the sender's device buffer
    through its handle and ends with device tensors of its own; a larger second version
    makes the sender grow (replace) the buffer."""
    (tmp_path / "receiver.py").write_text(IPC_RECEIVER)
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    child = subprocess.Popen([sys.executable, str(tmp_path / "receiver.py"), str(tmp_path), "2"], stdout=subprocess.PIPE, text=True, env=env)
    sender = IpcSender(gpu)
    try:
        sender.connect(child.stdout.readline().strip())
        sent = {1: _device_weights(gpu, 1), 2: _device_weights(gpu, 2, scale=8)}
        for version, weights in sent.items():
            manifest = sender.send(version, weights.items())  # returns once the receiver copied it out
            assert manifest.version == version
        assert child.wait(timeout=120) == 0
    finally:
        sender.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    for version, weights in sent.items():
        got = torch.load(tmp_path / f"v{version}.pt")
        assert got["devices"] == ["cuda:0"]
        assert set(got["tensors"]) == set(weights)
        for name, t in weights.items():
            assert got["tensors"][name].dtype == t.dtype and torch.equal(got["tensors"][name], t.cpu()), name


@pytest.mark.gpu
def test_gpu_host_transport_stages_device_buckets_through_pinned_memory(gpu):
    weights = _device_weights(gpu, 3, scale=4)
    receiver = HostReceiver(gpu, expected=expected_specs(weights.items()))
    sender = HostSender(gpu, bucket_bytes=16 << 10)  # several buckets: copies overlap sends
    sender.connect(receiver.address)
    got: dict = {}
    try:
        receiving = threading.Thread(target=lambda: got.update(weights=receiver.receive(60)))
        receiving.start()
        manifest = sender.send(7, weights.items())
        receiving.join(60)
    finally:
        sender.close()
        receiver.close()
    assert len(manifest.buckets) >= 3 and got["weights"].version == 7
    for name, t in weights.items():
        assert got["weights"].tensors[name].device == t.device and torch.equal(got["weights"].tensors[name], t), name
