"""`AcceleratorPlatform`: a platform over a vendor's torch device module.

`torch.cuda` and `torch.npu` (registered by torch_npu) share one API for devices, RNG,
streams, events and memory, so one class serves both. What differs between vendors
lives in a `Vendor` record built by `hal/cuda.py` or `hal/npu.py`: how to load the
module, communication env defaults, profiling ranges and dtype support.

Memory calls go to the vendor module, never to `torch.accelerator`: torch_npu's caching
allocator is not registered as a torch.accelerator allocator, so the generic calls would
report nothing on NPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch

from tidal.hal import rng
from tidal.hal.offload import OffloadHandle
from tidal.hal.platform import NoDeviceError, PlatformDescriptor, as_device, autocast, check_visible_ids, describe, join_default_group


@dataclasses.dataclass(frozen=True, kw_only=True)
class Vendor:
    """What one accelerator vendor contributes to `AcceleratorPlatform`."""

    kind: str
    """`cuda` or `npu`."""
    module: ModuleType
    """The loaded torch device module (`torch.cuda` or `torch.npu`)."""
    comm_env: Mapping[str, str]
    """Environment defaults for the collective library; a value the user set wins."""
    range_start: Callable[[str], Any]
    """Open a named profiler range (NVTX / mstx); returns a token for `range_end`."""
    range_end: Callable[[Any], None]
    dtype_support: Callable[[], dict[str, bool]]
    """Support flags keyed `bf16`, `fp16`, `fp64`, `fp8` for the current device."""
    fused_optimizers: bool
    """Whether torch's `fused=True` Adam/AdamW kernels run on this vendor's devices."""
    initialized: Callable[[], bool]
    """True once changing the visible-devices variable can no longer take effect."""
    machine_count: Callable[[], int | None]
    """The machine's devices, whatever the visible-devices variable holds (the ids
    `set_visible_devices` takes index them); None when it cannot be told."""


class AcceleratorPlatform:
    """CUDA or NPU devices as seen by this process."""

    def __init__(self, vendor: Vendor) -> None:
        self._vendor = vendor
        self._mod = vendor.module
        self.descriptor: PlatformDescriptor = describe(vendor.kind, device_count=self._mod.device_count())

    @property
    def kind(self) -> str:
        return self._vendor.kind

    def __repr__(self) -> str:
        return f"AcceleratorPlatform({self.kind}, {self.descriptor.device_count})"

    def _require(self) -> None:
        if self.device_count() == 0:
            var = self.descriptor.visible_devices_var
            raise NoDeviceError(
                f"this process sees 0 {self.kind} devices ({var}={os.environ.get(var, '<unset>') if var else '<none>'!r}) "
                "and cannot compute; check the devices Ray or the launcher assigned to it"
            )

    # Devices -------------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        self._require()
        if index is None:
            return torch.device(self.kind, self._mod.current_device())
        count = self.device_count()
        if not 0 <= index < count:
            raise IndexError(f"device index {index} out of range: this process sees {count} {self.kind} devices")
        return torch.device(self.kind, index)

    def set_device(self, device: torch.device | str) -> None:
        """Make `device` current; an index this process does not see is an IndexError, as
        in `device(i)` (the vendor's "invalid device ordinal" names no count)."""
        self._require()
        device = as_device(device, device_type=self.kind)
        if device.index is not None:
            self.device(device.index)  # checks the index
        self._mod.set_device(device)

    def current_device(self) -> torch.device:
        return self.device()

    def device_count(self) -> int:
        return self._mod.device_count()

    def synchronize(self, device: torch.device | str | None = None) -> None:
        """Wait for `device` (default the current one); an index this process does not see
        is an IndexError, as in `set_device`."""
        self._require()
        if device is not None:
            device = as_device(device, device_type=self.kind)
            if device.index is not None:
                self.device(device.index)  # checks the index
        self._mod.synchronize(device)

    # RNG -----------------------------------------------------------------------------
    def seed_all(self, seed: int) -> None:
        rng.seed_all(seed, self._mod)

    def get_rng_state(self) -> dict[str, Any]:
        return rng.get_state(self._mod)

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        rng.set_state(state, self._mod)

    def fork_rng(self) -> AbstractContextManager[None]:
        return rng.fork(self._mod)

    # Streams and events ----------------------------------------------------------------
    def new_stream(self) -> Any:
        self._require()
        return self._mod.Stream()

    def new_event(self, *, enable_timing: bool = False) -> Any:
        self._require()
        return self._mod.Event(enable_timing=enable_timing)

    def current_stream(self) -> Any:
        self._require()
        return self._mod.current_stream()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        """Make `stream` current inside the block and give it to `as`, as the CPU platform does
        (the vendor's `stream()` context gives None)."""
        with self._mod.stream(stream):
            yield stream

    # Memory --------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        self._require()
        return self._mod.memory_allocated()

    def memory_reserved(self) -> int:
        self._require()
        return self._mod.memory_reserved()

    def max_memory_allocated(self) -> int:
        self._require()
        return self._mod.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        self._require()
        self._mod.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        if self.device_count():
            self._mod.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        self._require()
        free, total = self._mod.mem_get_info()
        return int(free), int(total)

    @property
    def pin_memory(self) -> bool:
        return True

    def offload(
        self, *, module: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> OffloadHandle:
        """Move parameters, gradients and optimizer state to pinned host memory."""
        self._require()
        handle = OffloadHandle(
            module=module,
            optimizer=optimizer,
            new_event=self.new_event,
            pin=True,
            copy=True,
        )
        self.empty_cache()
        return handle

    # Dtypes --------------------------------------------------------------------------
    def dtype_support(self) -> dict[str, bool]:
        self._require()
        return self._vendor.dtype_support()

    def autocast(self, precision: str) -> AbstractContextManager[None]:
        """`torch.autocast` on this vendor's device type ("cuda", or "npu" once torch_npu
        has registered it)."""
        supported = self.dtype_support() if precision != "fp32" else {}
        return autocast(self.kind, precision, supported=supported, kind=self.kind)

    # Optimizers ----------------------------------------------------------------------
    def optimizer_options(self) -> dict[str, Any]:
        """Keyword arguments for torch's Adam/AdamW on this vendor's devices."""
        return {"fused": self._vendor.fused_optimizers}

    # Environment and collectives -------------------------------------------------------
    def set_visible_devices(self, ids: Sequence[int]) -> None:
        """Restrict the devices this process sees to `ids`, the machine's device indexes;
        only possible before the vendor starts.

        Raises:
            ValueError: an id that is not an integer, repeats, or is not one of the
                machine's devices (the vendor would see 0 devices, or stop at that id);
                the variable keeps its value.
        """
        var = self.descriptor.visible_devices_var
        assert var is not None
        if self._vendor.initialized():
            raise RuntimeError(
                f"{var} must be set before {self.kind} is initialised in this process; set it in "
                "the launcher or the Ray actor's runtime_env instead"
            )
        ids = check_visible_ids(ids, count=self._vendor.machine_count(), kind=self.kind)
        before = os.environ.get(var)
        os.environ[var] = ",".join(str(i) for i in ids)
        seen = self._mod.device_count()  # counted again under the variable
        if seen != len(ids):  # an id past a count that could not be told: the vendor stops at it
            if before is None:
                del os.environ[var]
            else:
                os.environ[var] = before
            raise ValueError(f"cannot make devices {ids} visible: {ids[seen : seen + 1]} out of range or repeated ({self.kind} sees {seen} of them)")
        self.descriptor = dataclasses.replace(self.descriptor, device_count=seen)

    def comm_env_defaults(self) -> dict[str, str]:
        return dict(self._vendor.comm_env)

    def apply_comm_env(self) -> dict[str, str]:
        """Set every communication default the user has not set; return what was set."""
        applied = {k: v for k, v in self._vendor.comm_env.items() if k not in os.environ}
        os.environ.update(applied)
        return applied

    @property
    def process_group_backend(self) -> str:
        # Host tensors (metadata, barriers) over gloo, device tensors over nccl / hccl.
        return f"cpu:gloo,{self.kind}:{self.descriptor.dist_backend}"

    def init_process_group(
        self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float | None = None, store: Any = None
    ) -> None:
        self._require()
        self.apply_comm_env()
        join_default_group(self.process_group_backend, rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s, store=store)

    # Profiling -----------------------------------------------------------------------
    @contextlib.contextmanager
    def profile_range(self, name: str) -> Iterator[None]:
        token = self._vendor.range_start(name)
        try:
            yield
        finally:
            self._vendor.range_end(token)
