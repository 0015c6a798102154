"""The CPU platform, and the `fake:<kind>:<n>` platforms built on it.

A fake platform computes on CPU tensors and uses gloo, but its descriptor reports the
kind and device count it imitates (`fake:npu:8` says: 8 NPUs, dist backend hccl, Ray
resource NPU). Placement, transport selection and mixed NPU+GPU logic read only the
descriptor, so they run in CI exactly as they would on the real cluster. Unlike the
plain CPU platform, a fake one really copies on `offload`/`onload`, so the offload path
is exercised without an accelerator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import psutil
import torch

from tidal.hal import hostmem, rng
from tidal.hal.offload import OffloadHandle
from tidal.hal.platform import NoDeviceError, NoopEvent, NoopStream, PlatformDescriptor, as_device, autocast, check_visible_ids, describe, join_default_group

_CPU = torch.device("cpu")
log = logging.getLogger(__name__)


class CpuPlatform:
    """Host-only platform. Memory figures are this process's resident set size."""

    def __init__(self, descriptor: PlatformDescriptor | None = None) -> None:
        self.descriptor = descriptor or describe("cpu", device_count=1)
        self._machine_count = self.descriptor.device_count  # what a visible-devices variable picks from
        self._peak_sampled = 0
        """The largest resident set seen by a memory call since the last reset."""
        self._hwm_at_reset: int | None = None
        """`VmHWM` when the last reset could not clear it; None when it could (or none ran)."""
        self._reset_refused = False
        """Whether a refused reset was logged (once per platform)."""

    @property
    def kind(self) -> str:
        return self.descriptor.kind

    def __repr__(self) -> str:
        d = self.descriptor
        return f"FakePlatform({d.kind}, {d.device_count})" if d.fake else "CpuPlatform()"

    def _require(self) -> None:
        """A fake platform given zero devices refuses what the accelerator platform refuses
        then: computing, streams, memory figures, dtypes, collectives."""
        if self.descriptor.device_count == 0:
            raise NoDeviceError(
                f"this process was given 0 {self.kind} devices (fake platform, TIDAL_DEVICE={os.environ.get('TIDAL_DEVICE', '<unset>')!r}) "
                f"and cannot compute; give it at least one with TIDAL_DEVICE=fake:{self.kind}:<n>"
            )

    # Devices -------------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        self._require()
        count = self.descriptor.device_count
        if index is not None and not 0 <= index < count:
            raise IndexError(f"device index {index} out of range: this process sees {count} {self.kind} devices")
        return _CPU

    def set_device(self, device: torch.device | str) -> None:
        as_device(device, device_type="cpu")

    def current_device(self) -> torch.device:
        return self.device()

    def device_count(self) -> int:
        return self.descriptor.device_count

    def synchronize(self, device: torch.device | str | None = None) -> None:
        self._require()
        if device is not None:
            as_device(device, device_type="cpu")  # refused as the accelerator platform refuses it

    # RNG -----------------------------------------------------------------------------
    def seed_all(self, seed: int) -> None:
        rng.seed_all(seed)

    def get_rng_state(self) -> dict[str, Any]:
        return rng.get_state()

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        rng.set_state(state)

    def fork_rng(self) -> AbstractContextManager[None]:
        return rng.fork()

    # Streams and events ----------------------------------------------------------------
    def new_stream(self) -> NoopStream:
        self._require()
        return NoopStream()

    def new_event(self, *, enable_timing: bool = False) -> NoopEvent:
        self._require()
        return NoopEvent(enable_timing=enable_timing)

    def current_stream(self) -> NoopStream:
        self._require()
        return NoopStream()

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    # Memory --------------------------------------------------------------------------
    def memory_allocated(self) -> int:
        self._require()
        return psutil.Process().memory_info().rss

    def memory_reserved(self) -> int:
        self._require()
        return psutil.Process().memory_info().rss

    def max_memory_allocated(self) -> int:
        """Peak resident set size since start or the last `reset_peak_memory_stats`.

        The kernel's high-water mark (`VmHWM`) where it counts from that point. Where the
        reset could not clear it, `VmHWM` still says the peak exactly once it rises past
        its value at the reset; until then the peak is the largest resident set sampled
        at the reset and at each memory call since (a lower bound). Without procfs, the
        sampled value always.
        """
        self._require()
        self._peak_sampled = max(self._peak_sampled, self.memory_allocated())
        hwm = hostmem.peak_rss()
        if hwm is not None and (self._hwm_at_reset is None or hwm > self._hwm_at_reset):
            return hwm
        return self._peak_sampled

    def reset_peak_memory_stats(self) -> None:
        """Start the peak over from the current resident set (see `max_memory_allocated`
        for where the kernel refuses the reset: it is then logged once)."""
        self._require()
        self._peak_sampled = self.memory_allocated()
        if hostmem.reset_peak_rss():
            self._hwm_at_reset = None
            return
        self._hwm_at_reset = hostmem.peak_rss()
        if not self._reset_refused:
            self._reset_refused = True
            log.info("writing %s was refused: the resident-set peak since a reset is sampled until it passes the kernel's peak (%s bytes)", hostmem.PROC_SELF / "clear_refs", self._hwm_at_reset)

    def empty_cache(self) -> None:
        return None

    def mem_get_info(self) -> tuple[int, int]:
        """`(free, total)` bytes of host memory this process may use: the host's, or its
        cgroup's memory limit when that is lower (a container's; see `hostmem`)."""
        self._require()
        vm = psutil.virtual_memory()
        free, total = vm.available, vm.total
        cgroup = hostmem.cgroup_memory()
        if cgroup is not None:
            free, total = min(free, cgroup[0]), min(total, cgroup[1])
        return min(free, total), total

    @property
    def pin_memory(self) -> bool:
        return False

    def offload(
        self, *, module: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> OffloadHandle:
        """On the real CPU platform this moves nothing; a fake platform copies for real."""
        self._require()
        return OffloadHandle(
            module=module,
            optimizer=optimizer,
            new_event=self.new_event,
            pin=False,
            copy=self.descriptor.fake,
        )

    # Dtypes --------------------------------------------------------------------------
    def dtype_support(self) -> dict[str, bool]:
        self._require()
        # float8 tensors exist on CPU but have no arithmetic kernels.
        return {"bf16": True, "fp16": True, "fp64": True, "fp8": False}

    def autocast(self, precision: str) -> AbstractContextManager[None]:
        """`torch.autocast("cpu")` (a fake platform computes on CPU too). On a CPU with AMX
        (Sapphire Rapids and later), bf16 matmuls run 2-7x faster than fp32 ones."""
        supported = self.dtype_support() if precision != "fp32" else {}  # fp32 changes nothing: no device needed, as on an accelerator
        return autocast("cpu", precision, supported=supported, kind=self.kind)

    # Optimizers ----------------------------------------------------------------------
    def optimizer_options(self) -> dict[str, Any]:
        """Keyword arguments for torch's Adam/AdamW here: torch's fused CPU kernel (one
        call per step instead of a dozen per parameter; docs/benchmarks.md has the times)."""
        return {"fused": True}

    # Environment and collectives -------------------------------------------------------
    def set_visible_devices(self, ids: Sequence[int]) -> None:
        var = self.descriptor.visible_devices_var
        if var is None:
            raise ValueError("the cpu platform has no visible-devices variable")
        ids = check_visible_ids(ids, count=self._machine_count, kind=self.kind)  # the machine's ids, as a vendor's variable holds them
        os.environ[var] = ",".join(str(i) for i in ids)
        self.descriptor = dataclasses.replace(self.descriptor, device_count=len(ids))  # as a vendor's count follows the variable

    def comm_env_defaults(self) -> dict[str, str]:
        return {}

    def apply_comm_env(self) -> dict[str, str]:
        return {}

    @property
    def process_group_backend(self) -> str:
        return "gloo"

    def init_process_group(
        self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float | None = None, store: Any = None
    ) -> None:
        self._require()
        join_default_group(self.process_group_backend, rank=rank, world_size=world_size, init_method=init_method, timeout_s=timeout_s, store=store)

    # Profiling -----------------------------------------------------------------------
    def profile_range(self, name: str) -> AbstractContextManager[None]:
        return contextlib.nullcontext()


MAX_FAKE_DEVICES = 1024
"""The most devices a fake platform reports. It stands for one machine's (16 on the
largest NPU and GPU servers); a count with digits too many would reach a planner that
lists every device."""


def fake_platform(kind: str, num_devices: int) -> CpuPlatform:
    """A platform that computes on CPU but reports `num_devices` devices of `kind`."""
    if not 0 <= num_devices <= MAX_FAKE_DEVICES:
        raise ValueError(f"a fake platform needs 0 <= num_devices <= {MAX_FAKE_DEVICES}, got {num_devices:,}")
    return CpuPlatform(describe(kind, device_count=num_devices, fake=True))

