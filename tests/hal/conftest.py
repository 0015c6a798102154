"""A faithful fake of torch_npu, injected into `sys.modules` and `torch.npu` for HAL tests.

It mirrors what the real package does on import: it renames torch's PrivateUse1 backend
to `npu` (so `torch.device("npu:0")` parses), exposes the `torch.npu` device module
(`torch_npu.npu` is the same object) with the torch.cuda-shaped API the HAL calls, and
`torch_npu.npu.mstx` profiling ranges. Generators are real `torch.Generator`s, one per
device, so RNG state round-trips are checked for real. Every call is recorded, so tests
can assert that memory queries went to `torch.npu` (not to `torch.accelerator`).
"""

from __future__ import annotations

import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable, Iterator

import pytest
import torch


class FakeNpuEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded, "synchronize() on an event that was never recorded"

    def query(self) -> bool:
        return self.recorded

    def wait(self, stream=None) -> None:
        return None

    def elapsed_time(self, end: FakeNpuEvent) -> float:
        return 0.0


class FakeNpuStream:
    def __init__(self, device=None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        event = event or FakeNpuEvent()
        event.record(self)
        return event


class FakeNpu(types.ModuleType):
    """The `torch.npu` module of a machine with `num_devices` Ascend chips."""

    Stream = FakeNpuStream
    Event = FakeNpuEvent

    def __init__(self, num_devices: int, device_name: str = "Ascend910B3") -> None:
        super().__init__("torch_npu.npu")
        self.num_devices = num_devices
        self.device_name = device_name
        self.calls: list[str] = []
        self._current = 0
        self._generators = [torch.Generator() for _ in range(num_devices)]
        self.allocated = 1000
        self.reserved = 4000
        self.peak = 3000
        self.ranges: list[tuple[str, object]] = []
        self.mstx = self._make_mstx()
        self._initialized = False

    def _make_mstx(self):
        fake = self

        class mstx:  # noqa: N801 - the real class is lower case too
            _next = 0

            @staticmethod
            def range_start(message: str = "None", stream=None, domain: str = "default") -> int:
                mstx._next += 1
                fake.ranges.append(("start", message))
                return mstx._next

            @staticmethod
            def range_end(range_id: int, domain: str = "default") -> int:
                fake.ranges.append(("end", range_id))
                return 0

        return mstx

    def _log(self, name: str) -> None:
        self.calls.append(name)

    # Devices.
    def device_count(self) -> int:
        return self.num_devices

    def current_device(self) -> int:
        self._log("current_device")
        return self._current

    def set_device(self, device) -> None:
        self._log("set_device")
        device = torch.device(device)
        assert device.type == "npu", device
        if device.index is None or device.index >= self.num_devices:
            raise RuntimeError(f"Invalid device ID {device.index}")
        self._current = device.index
        self._initialized = True

    def synchronize(self, device=None) -> None:
        self._log("synchronize")

    def is_available(self) -> bool:
        return self.num_devices > 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def is_initialized(self) -> bool:
        return self._initialized

    def get_device_name(self, device=None) -> str:
        return self.device_name

    def is_bf16_supported(self) -> bool:
        return True

    # RNG.
    def manual_seed_all(self, seed: int) -> None:
        for g in self._generators:
            g.manual_seed(seed)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [g.get_state() for g in self._generators]

    def set_rng_state_all(self, states) -> None:
        assert len(states) == self.num_devices
        for g, s in zip(self._generators, states):
            g.set_state(s)

    def draw(self, device: int = 0) -> float:
        """Test helper: one number from a device generator."""
        return torch.rand(1, generator=self._generators[device]).item()

    # Streams.
    def current_stream(self, device=None) -> FakeNpuStream:
        return FakeNpuStream(device)

    def stream(self, stream):
        import contextlib

        return contextlib.nullcontext(stream)

    # Memory.
    def memory_allocated(self, device=None) -> int:
        self._log("memory_allocated")
        return self.allocated

    def memory_reserved(self, device=None) -> int:
        self._log("memory_reserved")
        return self.reserved

    def max_memory_allocated(self, device=None) -> int:
        self._log("max_memory_allocated")
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self._log("reset_peak_memory_stats")
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self._log("empty_cache")

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self._log("mem_get_info")
        return 60 * 2**30, 64 * 2**30


def install_fake_torch_npu(monkeypatch: pytest.MonkeyPatch, num_devices: int, **kwargs) -> FakeNpu:
    npu = FakeNpu(num_devices, **kwargs)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    torch_npu.__version__ = "2.13.0.fake"
    torch_npu.npu = npu
    torch.utils.rename_privateuse1_backend("npu")  # What torch_npu does on import.
    if not hasattr(torch, "npu"):
        # The rename cannot be undone, and torch's accelerator probe then looks up
        # `torch.npu`: leave an inert one (no devices) for the rest of the session.
        torch.npu = FakeNpu(0)
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", npu)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu


@pytest.fixture
def install_fake_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeNpu]]:
    """Install a fake torch_npu with a chosen number of NPUs for one test."""
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "TIDAL_DEVICE", *FAKE_COMM_VARS):
        monkeypatch.delenv(var, raising=False)
    yield lambda num_devices, **kwargs: install_fake_torch_npu(monkeypatch, num_devices, **kwargs)


@pytest.fixture
def fake_npu(install_fake_npu: Callable[..., FakeNpu]) -> FakeNpu:
    """torch_npu with 2 NPUs, for the duration of one test."""
    return install_fake_npu(2)


FAKE_COMM_VARS = ("HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE", "HCCL_CONNECT_TIMEOUT")


@pytest.fixture
def receive_in_thread() -> Callable[..., tuple[threading.Thread, dict]]:
    """`receive_in_thread(receive, *args)`: call `receive(*args)` in a daemon thread; returns
    the thread and a dict that gets "weights" (the result) or "error" (what it raised)."""

    def start(receive: Callable[..., object], *args: object) -> tuple[threading.Thread, dict]:
        out: dict = {}

        def run() -> None:
            try:
                out["weights"] = receive(*args)
            except Exception as e:  # handed to the test
                out["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, out

    return start
