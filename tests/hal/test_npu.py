"""The npu backend against the injected fake torch_npu (see conftest.py), and a broken one."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from tidal import hal
from tidal.hal import npu as npu_backend
from tidal.hal.accelerator import AcceleratorPlatform


def test_detection_prefers_npu_when_torch_npu_is_installed(fake_npu):
    assert hal.detect() == ("npu", "torch_npu is installed")
    sel = hal.select_platform()
    assert sel.spec == "npu" and sel.chosen_by == "detection"
    assert isinstance(sel.platform, AcceleratorPlatform)
    assert isinstance(sel.platform, hal.Platform)


def test_descriptor_reports_npu_identity(fake_npu):
    d = hal.select_platform("npu").platform.descriptor
    assert (d.kind, d.device_type, d.dist_backend, d.ray_resource, d.device_count, d.fake) == (
        "npu", "npu", "hccl", "NPU", 2, False,
    )
    assert d.visible_devices_var == "ASCEND_RT_VISIBLE_DEVICES"


def test_devices(fake_npu):
    p = hal.select_platform("npu").platform
    assert p.device() == torch.device("npu", 0)
    assert p.device(1) == torch.device("npu:1")
    p.set_device("npu:1")
    assert p.current_device() == torch.device("npu", 1)
    p.set_device(torch.device("npu", 0))
    with pytest.raises(TypeError):
        p.set_device(1)
    with pytest.raises(ValueError, match="not a npu device"):
        p.set_device("cpu")
    with pytest.raises(IndexError, match="sees 2 npu devices"):
        p.device(2)
    with pytest.raises(IndexError, match="device index 2 out of range: this process sees 2 npu devices"):
        p.set_device("npu:2")  # was the vendor's error, naming no count
    with pytest.raises(ValueError, match="device 'npu:01' is not a npu device: expected 'npu' or 'npu:<index>'"):
        p.set_device("npu:01")
    assert p.current_device() == torch.device("npu", 0)
    p.synchronize()
    assert "set_device" in fake_npu.calls and "synchronize" in fake_npu.calls


def test_memory_calls_go_to_torch_npu(fake_npu):
    p = hal.select_platform("npu").platform
    fake_npu.allocated, fake_npu.reserved, fake_npu.peak = 111, 222, 333
    assert (p.memory_allocated(), p.memory_reserved(), p.max_memory_allocated()) == (111, 222, 333)
    p.reset_peak_memory_stats()
    assert p.max_memory_allocated() == 111
    p.empty_cache()
    assert p.mem_get_info() == (60 * 2**30, 64 * 2**30)
    assert p.pin_memory is True
    for call in ("memory_allocated", "memory_reserved", "max_memory_allocated", "reset_peak_memory_stats", "empty_cache", "mem_get_info"):
        assert call in fake_npu.calls


def test_rng_covers_every_npu_generator(fake_npu):
    p = hal.select_platform("npu").platform
    p.seed_all(7)
    first = (random.random(), torch.rand(1).item(), fake_npu.draw(0), fake_npu.draw(1))
    p.seed_all(7)
    assert (random.random(), torch.rand(1).item(), fake_npu.draw(0), fake_npu.draw(1)) == first

    state = p.get_rng_state()
    assert len(state["device"]) == 2
    nxt = (fake_npu.draw(0), fake_npu.draw(1))
    p.set_rng_state(state)
    assert (fake_npu.draw(0), fake_npu.draw(1)) == nxt
    p.set_rng_state(state)
    with p.fork_rng():
        fake_npu.draw(0), fake_npu.draw(1), torch.rand(3)
    assert (fake_npu.draw(0), fake_npu.draw(1)) == nxt
    with pytest.raises(ValueError, match="holds 3 device generators but this process sees 2 devices"):
        p.set_rng_state({**state, "device": [*state["device"], state["device"][0]]})  # a 3-NPU run's checkpoint


def test_a_refused_device_rng_state_changes_no_generator(fake_npu):
    """The second NPU's state is refused after the host generators and the first NPU's
    were set: every one goes back, and the error says nothing was changed."""
    p = hal.select_platform("npu").platform
    p.seed_all(1)
    state = p.get_rng_state()
    p.seed_all(2)
    before = p.get_rng_state()
    bad = {**state, "device": [state["device"][0], torch.ByteTensor(3)]}
    with pytest.raises(ValueError, match="RNG state not restored, every generator keeps its state"):
        p.set_rng_state(bad)
    after = p.get_rng_state()
    assert after["python"] == before["python"] and torch.equal(after["torch"], before["torch"])
    assert all(torch.equal(a, b) for a, b in zip(after["device"], before["device"], strict=True))


def test_streams_and_events(fake_npu):
    p = hal.select_platform("npu").platform
    stream, event = p.new_stream(), p.new_event(enable_timing=True)
    assert type(stream).__name__ == "FakeNpuStream" and type(event).__name__ == "FakeNpuEvent"
    assert event.enable_timing
    with p.use_stream(stream) as s:
        assert s is stream
        event.record()
    event.synchronize()
    assert type(p.current_stream()).__name__ == "FakeNpuStream"


def test_dtype_support(fake_npu, monkeypatch):
    p = hal.select_platform("npu").platform
    assert p.dtype_support() == {"bf16": True, "fp16": True, "fp64": False, "fp8": False}
    monkeypatch.setattr(fake_npu, "device_name", "Ascend950PR")
    assert p.dtype_support()["fp8"] is True
    assert p.optimizer_options() == {"fused": False}  # torch's fused kernels are not asked for on NPUs


def test_autocast_is_torch_autocast_on_npu_devices_and_refuses_missing_bf16(fake_npu, monkeypatch):
    p = hal.select_platform("npu").platform
    entered = []

    class Autocast:  # the fake torch_npu registers no "npu" device type with torch
        def __init__(self, device_type, dtype):
            entered.append((device_type, dtype))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch, "autocast", Autocast)
    with p.autocast("bf16"):
        pass
    assert entered == [("npu", torch.bfloat16)]
    monkeypatch.setattr(fake_npu, "is_bf16_supported", lambda: False)  # Ascend 910A
    with pytest.raises(hal.PlatformError, match="this npu platform has no bf16 arithmetic.*use precision fp32"):
        p.autocast("bf16")
    with p.autocast("fp32"):  # asks the device nothing
        pass
    assert entered == [("npu", torch.bfloat16)]


def test_comm_env_defaults_never_override_the_user(fake_npu, monkeypatch):
    p = hal.select_platform("npu").platform
    assert p.comm_env_defaults() == {
        "HCCL_HOST_SOCKET_PORT_RANGE": "auto",
        "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
        "HCCL_CONNECT_TIMEOUT": "1800",
    }
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "600")
    applied = p.apply_comm_env()
    assert "HCCL_CONNECT_TIMEOUT" not in applied
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "600"
    assert os.environ["HCCL_HOST_SOCKET_PORT_RANGE"] == "auto"
    assert p.process_group_backend == "cpu:gloo,npu:hccl"


def test_visible_devices_must_be_set_before_torch_npu_loads(fake_npu):
    p = hal.select_platform("npu").platform
    with pytest.raises(RuntimeError, match="ASCEND_RT_VISIBLE_DEVICES must be set before npu"):
        p.set_visible_devices([0, 1])


def test_profile_range_uses_mstx(fake_npu):
    p = hal.select_platform("npu").platform
    with p.profile_range("train_step"):
        pass
    assert fake_npu.ranges[0] == ("start", "train_step")
    assert fake_npu.ranges[1][0] == "end"


def test_npu_offload_reaches_the_device_module(fake_npu):
    # Tensors cannot live on a fake NPU; the offload path itself is tested on the fake
    # platform (test_offload.py). Here: an empty module offloads and onloads cleanly,
    # and the device cache is emptied after the offload.
    p = hal.select_platform("npu").platform
    handle = p.offload(module=torch.nn.Module())
    assert "empty_cache" in fake_npu.calls
    handle.onload()


def test_broken_torch_npu_is_reported_as_missing_cann(tmp_path, monkeypatch):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        'raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert npu_backend.installed()
    assert hal.detect()[0] == "npu"
    with pytest.raises(hal.PlatformUnavailable) as e:
        hal.select_platform()  # detection found torch_npu: no silent fallback to CPU
    msg = str(e.value)
    assert "libhccl.so" in msg and "CANN" in msg and "set_env.sh" in msg
    assert "platform 'npu' was chosen by detection: torch_npu is installed" in msg and "TIDAL_DEVICE=cpu" in msg  # the way out
    sys.modules.pop("torch_npu", None)


def test_zero_visible_npus_report_and_fail_loudly(install_fake_npu, monkeypatch):
    install_fake_npu(0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    p = hal.select_platform("npu").platform
    assert p.descriptor.device_count == 0
    with pytest.raises(hal.NoDeviceError, match="0 npu devices.*ASCEND_RT_VISIBLE_DEVICES=''"):
        p.device()
    with pytest.raises(hal.NoDeviceError):
        p.memory_allocated()



def test_init_process_group_uses_gloo_for_host_and_hccl_for_npu(fake_npu, monkeypatch):
    seen = {}
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: seen.update(kw))
    p = hal.select_platform("npu").platform
    p.init_process_group(rank=1, world_size=4, init_method="tcp://127.0.0.1:29500", timeout_s=30)
    assert seen["backend"] == "cpu:gloo,npu:hccl"
    assert (seen["rank"], seen["world_size"], seen["init_method"]) == (1, 4, "tcp://127.0.0.1:29500")
    assert seen["timeout"].total_seconds() == 30
    assert os.environ["HCCL_NPU_SOCKET_PORT_RANGE"] == "auto"  # comm defaults applied first


def test_synchronize_on_a_device_this_process_does_not_see_names_the_count(fake_npu):
    """As `set_device`: the vendor's "invalid device ordinal" names no count."""
    p = hal.select_platform("npu").platform
    p.synchronize("npu:1")
    with pytest.raises(IndexError, match="device index 2 out of range: this process sees 2 npu devices"):
        p.synchronize(torch.device("npu", 2))
