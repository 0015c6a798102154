"""The `Platform` contract, its serialisable identity, and the errors it raises.

One `Platform` object per process answers every device question (which device, how much
memory, which collective backend, how to move a module to host memory and back). Code
outside `hal/` talks to the platform and never to `torch.cuda` / `torch.npu` directly.

Implementations: `AcceleratorPlatform` (cuda and npu, over the vendor's torch device
module) and `CpuPlatform` (plain CPU, and the `fake` platforms that compute on CPU but
report an accelerator's identity so placement and mixed-cluster logic run in CI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch

KINDS = ("cuda", "npu", "cpu")
"""Platform kinds tidal knows. `fake` is not a kind: a fake platform reports one of these."""


class PlatformError(RuntimeError):
    """Base class of the errors the HAL raises for the user to act on."""


class PlatformUnavailable(PlatformError):
    """A requested platform cannot be loaded here; the message says what is missing."""


class NoDeviceError(PlatformError):
    """The process was given zero devices of its vendor and was asked to compute."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlatformDescriptor:
    """Identity of a platform, small enough to send to another process or a Ray actor.

    Placement and weight-transport selection look only at descriptors, never at live
    platforms, so a trainer on NPUs can decide how to reach a rollout on GPUs.
    """

    kind: str
    """Vendor kind: `cuda`, `npu` or `cpu` (a fake platform reports the kind it imitates)."""
    device_type: str
    """The torch device type of this kind (`cuda`, `npu`, `cpu`)."""
    dist_backend: str
    """Collective backend for device tensors: `nccl`, `hccl` or `gloo`."""
    ray_resource: str
    """Ray resource name that counts this kind's devices: `GPU`, `NPU` or `CPU`."""
    visible_devices_var: str | None
    """Environment variable that restricts the devices a process sees, if the kind has one."""
    ray_noset_var: str | None
    """Variable that stops Ray from setting `visible_devices_var` for its actors."""
    device_count: int
    """Devices this process sees (after the visible-devices variable is applied)."""
    fake: bool = False
    """True when tensors actually live on CPU (the `fake:<kind>:<n>` platforms)."""

    @property
    def deepspeed_accelerator(self) -> str:
        """DeepSpeed's name for the accelerator whose tensors this platform computes with (what
        `DS_ACCELERATOR` must say before DeepSpeed is imported): the kind's own, `cpu` for a
        fake platform, whose tensors live in host memory."""
        return "cpu" if self.fake else _DEEPSPEED_ACCELERATORS[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlatformDescriptor:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown PlatformDescriptor fields: {unknown}")
        return cls(**data)


# Static identity of each kind. `device_count` is filled in by the live platform.
_IDENTITY: dict[str, dict[str, Any]] = {
    "cuda": dict(
        device_type="cuda",
        dist_backend="nccl",
        ray_resource="GPU",
        visible_devices_var="CUDA_VISIBLE_DEVICES",
        ray_noset_var="RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    ),
    "npu": dict(
        device_type="npu",
        dist_backend="hccl",
        ray_resource="NPU",
        visible_devices_var="ASCEND_RT_VISIBLE_DEVICES",
        ray_noset_var="RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
    ),
    "cpu": dict(
        device_type="cpu",
        dist_backend="gloo",
        ray_resource="CPU",
        visible_devices_var=None,
        ray_noset_var=None,
    ),
}

_DEEPSPEED_ACCELERATORS = {"cuda": "cuda", "npu": "npu", "cpu": "cpu"}
"""Each kind's DeepSpeed accelerator (`deepspeed.accelerator.real_accelerator`'s names)."""


def describe(kind: str, *, device_count: int, fake: bool = False) -> PlatformDescriptor:
    """Return the descriptor of `kind` with `device_count` devices."""
    if kind not in _IDENTITY:
        raise ValueError(f"unknown platform kind {kind!r}; expected one of {list(KINDS)}")
    return PlatformDescriptor(kind=kind, device_count=device_count, fake=fake, **_IDENTITY[kind])


@runtime_checkable
class Platform(Protocol):
    """Everything tidal asks of a device backend.

    Design choices:
    - `device(i)` always returns a `torch.device`; indices are never passed around as ints.
    - A platform that sees zero devices still loads (so a Ray actor can report what it
      was given) but raises `NoDeviceError` from `device()` and anything that computes.
    - Streams and events exist on every platform; on CPU they are no-op objects with the
      same methods, so callers never branch on the platform.
    - Memory figures are bytes. On CPU they come from the process (psutil / procfs), and
      `mem_get_info` from its container's cgroup limit where that is below the host's.
    - `set_rng_state` is all or nothing: a state one generator refuses changes none.
    """

    descriptor: PlatformDescriptor

    @property
    def kind(self) -> str: ...

    # Devices.
    def device(self, index: int | None = None) -> torch.device: ...
    def set_device(self, device: torch.device | str) -> None: ...
    def current_device(self) -> torch.device: ...
    def device_count(self) -> int: ...
    def synchronize(self, device: torch.device | str | None = None) -> None: ...

    # Random number generators.
    def seed_all(self, seed: int) -> None: ...
    def get_rng_state(self) -> dict[str, Any]: ...
    def set_rng_state(self, state: Mapping[str, Any]) -> None: ...
    def fork_rng(self) -> AbstractContextManager[None]: ...

    # Streams and events.
    def new_stream(self) -> Any: ...
    def new_event(self, *, enable_timing: bool = False) -> Any: ...
    def current_stream(self) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Make `stream` current inside the block; `with ... as s` gives `stream` back."""

    # Memory (bytes).
    def memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def max_memory_allocated(self) -> int: ...
    def reset_peak_memory_stats(self) -> None: ...
    def empty_cache(self) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...
    @property
    def pin_memory(self) -> bool: ...

    # Offload of a module (parameters, gradients) and an optimizer's state to host memory.
    def offload(
        self, *, module: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> Any: ...

    # Dtypes.
    def dtype_support(self) -> dict[str, bool]: ...

    def autocast(self, precision: str) -> AbstractContextManager[None]:
        """Mixed precision for the code inside (`torch.autocast` on this platform's
        device type): matmuls in `precision` ("bf16" or "fp16"), the ops torch's
        autocast keeps in fp32 on that device type (losses such as cross-entropy; the
        list differs by device type) in fp32; parameters stay as they are. "fp32": no
        change. Raises `PlatformError` where `dtype_support()` says this platform lacks
        the dtype, and ValueError for another name."""

    # Optimizers.
    def optimizer_options(self) -> dict[str, Any]: ...

    # Environment and collectives.
    def set_visible_devices(self, ids: Sequence[int]) -> None: ...
    def comm_env_defaults(self) -> dict[str, str]: ...
    def apply_comm_env(self) -> dict[str, str]: ...
    @property
    def process_group_backend(self) -> str: ...
    def init_process_group(
        self, *, rank: int, world_size: int, init_method: str | None = None, timeout_s: float | None = None, store: Any = None
    ) -> None:
        """Join the default process group with this platform's backend (`init_method`, default
        `env://`; or a `torch.distributed.Store` the caller made, e.g. one bound to port 0)."""

    # Profiling.
    def profile_range(self, name: str) -> AbstractContextManager[None]: ...


class NoopEvent:
    """CPU stand-in for `torch.cuda.Event`: host work is already ordered, so waits return.

    `elapsed_time` still measures host wall time between two recorded events (in ms), so
    timing code written for accelerators gives real numbers on CPU.
    """

    def __init__(self, *, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: NoopEvent) -> float:
        if not self.enable_timing or not end.enable_timing:
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True")
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._t - self._t) * 1000.0


class NoopStream:
    """CPU stand-in for `torch.cuda.Stream` with the same methods."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: NoopEvent | None = None) -> NoopEvent:
        event = event or NoopEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`Platform.autocast`'s precisions and their compute dtypes."""


def autocast(device_type: str, precision: str, *, supported: Mapping[str, bool], kind: str) -> AbstractContextManager[None]:
    """The body of every `Platform.autocast`, for devices of `device_type` whose
    platform (`kind`) reports `supported` (`Platform.dtype_support()`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return contextlib.nullcontext()
    if not supported.get(precision, False):
        raise PlatformError(f"this {kind} platform has no {precision} arithmetic (dtype_support: {dict(supported)}); use precision fp32")
    return torch.autocast(device_type, dtype=PRECISIONS[precision])


def as_device(device: torch.device | str, *, device_type: str) -> torch.device:
    """Normalise a `torch.device` or `"npu:0"` string, refusing bare ints and other types.

    Raises:
        TypeError: not a `torch.device` or a string.
        ValueError: a string torch does not parse (`"npu:08"`, `" npu:0"`, `"NPU:0"`, or a
            device type torch does not know, such as `npu` where torch_npu is not loaded),
            or a device of another type.
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str)):
        raise TypeError(
            f"expected a torch.device or a string like '{device_type}:0', got {device!r}; "
            "tidal never passes devices as bare ints"
        )
    try:
        device = torch.device(device)
    except RuntimeError as e:  # torch's "Invalid device string" / "Expected one of <every type>"
        raise ValueError(f"device {device!r} is not a {device_type} device: expected '{device_type}' or '{device_type}:<index>' such as '{device_type}:0' (lower case, no spaces or leading zeros)") from e
    if device.type != device_type:
        raise ValueError(f"device {device} is not a {device_type} device")
    return device


def check_visible_ids(ids: Sequence[Any], *, count: int | None, kind: str) -> list[int]:
    """`ids` for a visible-devices variable, checked: integers (the machine's indexes, as
    the variable holds them), none repeated, none negative, each below the machine's
    `count` of `kind` devices (not checked when None: the machine's count cannot be told).

    Raises:
        ValueError: naming the ids at fault.
    """
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):  # a string would be taken character by character
        raise ValueError(f"cannot make devices {ids!r} visible: expected a list of device ids (integers, the machine's indexes), such as [0, 1]")
    ids = list(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"cannot make devices {ids} visible: device ids are integers (the machine's indexes)")
    bad = sorted({i for i in ids if i < 0 or (count is not None and i >= count)} | {i for i in ids if ids.count(i) > 1})
    if bad:
        has = f"the machine has {count} {kind} devices" if count is not None else f"the machine's count of {kind} devices cannot be told"
        raise ValueError(f"cannot make devices {ids} visible: {bad} out of range or repeated ({has})")
    return ids


def join_default_group(backend: str, *, rank: int, world_size: int, init_method: str | None, timeout_s: float | None, store: Any) -> None:
    """`torch.distributed.init_process_group` by `init_method` (default `env://`) or through
    `store`, a store the caller made (rank 0's, bound to a port the OS picked). The store is
    keyed as torch keys the store it makes from an address (prefix `default_pg`), so ranks
    joining by address and a rank joining through the store meet."""
    timeout = timedelta(seconds=timeout_s) if timeout_s else None
    if store is not None:
        if timeout is not None:
            store.set_timeout(timeout)
        store = torch.distributed.PrefixStore("default_pg", store)
    torch.distributed.init_process_group(
        backend=backend, init_method=None if store is not None else init_method or "env://", store=store, rank=rank, world_size=world_size, timeout=timeout
    )
