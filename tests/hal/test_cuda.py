"""The cuda backend. Real-GPU tests carry the `gpu` marker and are skipped without one."""

from __future__ import annotations

import gc
import os
import re
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
    vendor = Vendor(kind="cuda", module=module, comm_env={}, range_start=print, range_end=print, dtype_support=dict, fused_optimizers=True, initialized=lambda: state["initialized"], machine_count=lambda: 4)
    platform = AcceleratorPlatform(vendor)
    assert platform.descriptor.device_count == 4
    platform.set_visible_devices([2, 3])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and platform.descriptor.device_count == platform.device_count() == 2
    state["initialized"] = True
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES must be set before cuda is initialised"):
        platform.set_visible_devices([0])


def _cuda_like(count: int) -> types.SimpleNamespace:
    """A `torch.cuda` stand-in whose count follows CUDA_VISIBLE_DEVICES as the CUDA runtime
    reads it: ids up to the first one that is not a device, and none at all when an id
    repeats (the silent 0 or shorter count that validation must prevent)."""

    def device_count() -> int:
        ids = [int(i) for i in os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count)))).split(",") if i]
        if len(set(ids)) < len(ids):
            return 0
        valid = next((n for n, i in enumerate(ids) if not 0 <= i < count), len(ids))
        return valid

    return types.SimpleNamespace(device_count=device_count)


@pytest.mark.parametrize("machine_count", [4, None], ids=["machine-count-known", "machine-count-unknown"])
def test_visible_device_ids_are_checked_as_on_the_fake_platform(monkeypatch, machine_count):
    """Repeated or out-of-range ids are refused, naming them, and the variable is left as
    it was. The machine's count comes from the vendor (NVML, whatever the variable holds);
    where it cannot be told, the recount under the new variable catches what CUDA drops."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    vendor = Vendor(kind="cuda", module=_cuda_like(4), comm_env={}, range_start=print, range_end=print, dtype_support=dict, fused_optimizers=True, initialized=lambda: False, machine_count=lambda: machine_count)
    platform = AcceleratorPlatform(vendor)
    assert platform.device_count() == 2
    for bad, named in (([1, 1], r"\[1\]"), ([0, 4], r"\[4\]"), ([5, 0, 1], r"\[5\]"), ([-1], r"\[-1\]")):
        with pytest.raises(ValueError, match=rf"cannot make devices {re.escape(str(bad))} visible: {named} out of range or repeated"):
            platform.set_visible_devices(bad)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1" and platform.descriptor.device_count == 2
    with pytest.raises(ValueError, match="device ids are integers"):
        platform.set_visible_devices(["GPU-3b2f1c6e"])
    with pytest.raises(ValueError, match="device ids are integers"):
        platform.set_visible_devices([True])
    platform.set_visible_devices([3, 2])  # the machine's ids: beyond the two the variable held before
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,2" and platform.descriptor.device_count == 2


def test_use_stream_hands_its_stream_to_the_with_block_as_on_cpu():
    """`with platform.use_stream(s) as t` gives `t is s` on every platform. torch.cuda.stream's
    context (`StreamContext`, which torch_npu copies) returns None from `__enter__`, while the
    CPU platform's gives the stream: code written on CPU would get None on a GPU. The real
    `torch.cuda.stream` here (with no GPU it sets nothing, as for a stream of None)."""
    vendor = Vendor(kind="cuda", module=torch.cuda, comm_env={}, range_start=print, range_end=print, dtype_support=dict, fused_optimizers=True, initialized=lambda: False, machine_count=lambda: None)
    platform = AcceleratorPlatform(vendor)
    stream = types.SimpleNamespace(device=torch.device("cuda", 0))
    with platform.use_stream(stream) as entered:
        assert entered is stream
    with pytest.raises(KeyError, match="inside"), platform.use_stream(stream):
        raise KeyError("inside")  # errors pass through


def test_cuda_counts_the_machines_gpus_whatever_the_variable_holds(monkeypatch):
    """NVML's raw count, not torch.cuda.device_count() (which follows CUDA_VISIBLE_DEVICES);
    None where NVML cannot answer and the variable is set."""
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert cuda_backend.machine_count() == 8
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: -1)
    assert cuda_backend.machine_count() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert cuda_backend.machine_count() == 3


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
def test_gpu_refused_rng_state_changes_no_generator(gpu):
    """A CUDA generator state of the wrong size is refused after the host generators were
    set: they go back, and so does the device's."""
    gpu.seed_all(1)
    state = gpu.get_rng_state()
    gpu.seed_all(2)
    before = gpu.get_rng_state()
    with pytest.raises(ValueError, match="RNG state not restored, every generator keeps its state"):
        gpu.set_rng_state({**state, "device": [torch.ByteTensor(3)]})
    after = gpu.get_rng_state()
    assert after["python"] == before["python"] and torch.equal(after["torch"], before["torch"])
    assert all(torch.equal(a, b) for a, b in zip(after["device"], before["device"], strict=True))
    with pytest.raises(IndexError, match="out of range"):
        gpu.set_device(f"cuda:{gpu.device_count()}")


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


BUCKETS_OF_ONE = 2 << 10
"""A bucket size that puts each of `_device_weights`' four tensors in a bucket of its own: at
16 KiB (as until 2026-11-28) the last three (4,246 bytes) shared one, and the test's
"at least 3 buckets" failed on an H200 (issue 40). `test_device_weights_fill_one_bucket_each`
checks it on CPU."""


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
    stderr = tmp_path / "receiver.stderr"  # on an H200 the receiver never answered, and why was lost (issue 40)
    with stderr.open("w") as err:
        child = subprocess.Popen([sys.executable, str(tmp_path / "receiver.py"), str(tmp_path), "2"], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    sender = IpcSender(gpu)
    try:
        sender.connect(child.stdout.readline().strip())
        sent = {1: _device_weights(gpu, 1), 2: _device_weights(gpu, 2, scale=8)}
        for version, weights in sent.items():
            try:
                manifest = sender.send(version, weights.items())  # returns once the receiver copied it out
            except Exception as e:
                raise AssertionError(f"version {version} not taken; the receiver's stderr:\n{stderr.read_text()[-4000:]}") from e
            assert manifest.version == version
        assert child.wait(timeout=120) == 0, stderr.read_text()[-4000:]
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
    sender = HostSender(gpu, bucket_bytes=BUCKETS_OF_ONE)  # several buckets: copies overlap sends
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
    assert manifest.buckets == ((0,), (1,), (2,), (3,)) and got["weights"].version == 7
    for name, t in weights.items():
        assert got["weights"].tensors[name].device == t.device and torch.equal(got["weights"].tensors[name], t), name


def test_device_weights_fill_one_bucket_each():
    """What the GPU host-transport test relies on, checked where no GPU is needed."""
    from tidal.hal.cpu import CpuPlatform
    from tidal.hal.transfer import plan_manifest

    specs = expected_specs(_device_weights(CpuPlatform(), 3, scale=4).items())
    assert plan_manifest(7, list(specs.values()), bucket_bytes=BUCKETS_OF_ONE).buckets == ((0,), (1,), (2,), (3,))
    assert plan_manifest(7, list(specs.values()), bucket_bytes=16 << 10).buckets == ((0,), (1, 2, 3))  # what the H200 run saw
