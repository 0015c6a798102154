"""Random-number state shared by every platform: Python, NumPy, torch CPU and the device.

A checkpoint that restores this state continues a run with the same random stream, which
is what makes `max_staleness: 0` runs reproducible and resumes exact.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import torch


def seed_all(seed: int, device_module: ModuleType | None = None) -> None:
    """Seed Python, NumPy, torch CPU and, if given, every device of `device_module`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device_module is not None:
        device_module.manual_seed_all(seed)


def get_state(device_module: ModuleType | None = None) -> dict[str, Any]:
    """Snapshot every generator; `device` holds one state per visible device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": [],
    }
    if device_module is not None:
        state["device"] = list(device_module.get_rng_state_all())
    return state


def set_state(state: Mapping[str, Any], device_module: ModuleType | None = None) -> None:
    """Restore a snapshot taken by `get_state` on a platform of the same kind, all or
    nothing: the generators are set one after another, so a state a later one refuses (a
    torch state of another size, a device state from another kind of device) would leave
    the earlier ones set, and a run restored half from a checkpoint would follow neither
    its own random stream nor the checkpoint's. Every generator is put back first.

    Raises:
        ValueError: what was refused (every generator keeps its state).
    """
    missing = {"python", "numpy", "torch", "device"} - set(state)
    if missing:
        raise ValueError(f"RNG state is missing {sorted(missing)}")
    # Checked before anything is set: a refused state leaves every generator as it was.
    if device_module is None and state["device"]:
        raise ValueError("RNG state holds device generators but this platform has none")
    if device_module is not None and len(state["device"]) > device_module.device_count():
        raise ValueError(f"RNG state holds {len(state['device'])} device generators but this process sees {device_module.device_count()} devices")
    saved = get_state(device_module)
    try:
        _set(state, device_module)
    except Exception as e:  # whatever a generator raised, every one goes back
        _set(saved, device_module)
        raise ValueError(f"RNG state not restored, every generator keeps its state: {type(e).__name__}: {e}") from e


def _set(state: Mapping[str, Any], device_module: ModuleType | None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device_module is not None:
        device_module.set_rng_state_all(state["device"])


@contextmanager
def fork(device_module: ModuleType | None = None) -> Iterator[None]:
    """Run a block with all generators restored to their current state afterwards."""
    saved = get_state(device_module)
    try:
        yield
    finally:
        set_state(saved, device_module)
