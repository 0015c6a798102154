"""Move a module's parameters, gradients and an optimizer's state to host memory and back.

Colocated layouts time-share devices between rollout and training: while the rollout
engine runs, the trainer's weights, gradients and AdamW moments wait in (pinned) host
memory. `offload` copies every tensor to a host buffer, waits for the copies with an
event (never reading a host buffer an asynchronous copy may still be writing), and
points the module and optimizer at the host buffers so the device memory is freed.
`OffloadHandle.onload` copies each back to the device it came from (AdamW keeps its
`step` counters on CPU) and drops the host buffers, so the host memory
is released as soon as the onload returns. Values and dtypes come back exactly; each
tensor comes back contiguous, and two tensors that shared one storage (views of one
buffer, not one tied `Parameter`, which stays one) come back as two.

A DTensor (a sharded parameter, its gradient, the optimizer state of one) moves its
local shard, the only part on this process's device; the DTensor object stays, pointing
at the moved shard. A wrapper that keeps its own references to the shards (FSDP2's flat
shard buffers) must be pointed at them again after each move (the fsdp train engine's
`after_offload_move`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_Setter = Callable[[torch.Tensor], None]


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - absent from torch builds without distributed
    except ImportError:
        return None
    return DTensor


def _slot(tensor: torch.Tensor, plain: torch.Tensor, set_tensor: _Setter) -> tuple[torch.Tensor, _Setter]:
    """A DTensor's local shard (it keeps its metadata and points at the moved shard), else
    `plain` (the tensor's own storage) with `set_tensor`."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor._local_tensor, _setting(tensor, "_local_tensor")  # type: ignore[attr-defined]  # DTensor's own field
    return plain, set_tensor


def _setting(owner: Any, name: str) -> _Setter:
    """A function that sets `owner.name` to the tensor it is given."""

    def set_tensor(t: torch.Tensor) -> None:
        setattr(owner, name, t)

    return set_tensor


def _storing(state: dict[Any, Any], key: Any) -> _Setter:
    """A function that stores the tensor it is given at `state[key]`."""

    def set_tensor(t: torch.Tensor) -> None:
        state[key] = t

    return set_tensor


def _slots(module: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[tuple[torch.Tensor, _Setter]]:
    """Every tensor to move, each with a function that points its owner at a new tensor."""
    slots: list[tuple[torch.Tensor, _Setter]] = []
    if module is not None:
        for p in module.parameters():
            slots.append(_slot(p, p.data, _setting(p, "data")))  # a DTensor's `.data` is an alias: its shard moves
            if p.grad is not None:
                slots.append(_slot(p.grad, p.grad, _setting(p, "grad")))
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    slots.append(_slot(value, value, _storing(state, key)))
    return slots


class OffloadHandle:
    """What `Platform.offload` returns; call `onload()` once to move everything back."""

    def __init__(
        self,
        *,
        module: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        new_event: Callable[[], Any],
        pin: bool,
        copy: bool,
    ) -> None:
        self._module, self._optimizer = module, optimizer
        self._new_event = new_event
        self._live = True
        self._host: list[torch.Tensor] = []
        self._devices: list[torch.device] = []  # Where each tensor goes back to.
        self.num_bytes = 0
        if not copy:
            return  # The device is host memory already; there is nothing to move.
        slots = _slots(module, optimizer)
        for tensor, _ in slots:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            host.copy_(tensor, non_blocking=pin)
            self._host.append(host)
            self._devices.append(tensor.device)
            self.num_bytes += host.numel() * host.element_size()
        self._wait()
        for (_, set_tensor), host in zip(slots, self._host):
            set_tensor(host)

    @property
    def offloaded(self) -> bool:
        return self._live

    def host_tensors(self) -> list[torch.Tensor]:
        """The host buffers now holding the data (empty once onloaded)."""
        return list(self._host)

    def onload(self) -> None:
        """Copy everything back to the device and release the host buffers.

        One that raises (device memory ran out part way) has pointed nothing at a device
        copy yet: everything stays in the host buffers, and `onload()` may be called again."""
        if not self._live:
            raise RuntimeError("onload() called twice for the same offload")
        if not self._host:
            self._live = False
            return
        slots = _slots(self._module, self._optimizer)
        assert len(slots) == len(self._host), "module or optimizer changed while offloaded"
        moved = []
        for host, device in zip(self._host, self._devices):
            # An explicit allocation, not `.to()`: on a fake platform the device is the
            # CPU and `.to()` would keep the host buffer alive as the "device" tensor.
            tensor = torch.empty(host.shape, dtype=host.dtype, device=device)
            tensor.copy_(host, non_blocking=True)
            moved.append(tensor)
        self._wait()
        for (_, set_tensor), tensor in zip(slots, moved):
            set_tensor(tensor)
        self._live = False
        self._host.clear()
        self._devices.clear()

    def _wait(self) -> None:
        event = self._new_event()
        event.record()
        event.synchronize()
