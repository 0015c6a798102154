"""tidal.hal: the device abstraction. Everything NPU-, GPU- or CPU-specific lives here.

Importing this package imports nothing: names are loaded from their submodules on first
use, so the torch-free parts (`tidal.hal.versions`) work even where `import torch`
fails. No vendor module (torch_npu) is imported and no device is initialised until a
platform is chosen: on first use (`current_platform()`) or explicitly
(`init_platform(recipe_device)`), from `TIDAL_DEVICE`, the recipe, or detection.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "tidal.hal.offload": ("OffloadHandle",),
    "tidal.hal.platform": (
        "KINDS",
        "NoDeviceError",
        "NoopEvent",
        "NoopStream",
        "PRECISIONS",
        "Platform",
        "PlatformDescriptor",
        "PlatformError",
        "PlatformUnavailable",
        "describe",
    ),
    "tidal.hal.select": (
        "ENV_VAR",
        "VALID_SPECS",
        "Selection",
        "availability",
        "check_spec",
        "current_platform",
        "detect",
        "init_platform",
        "reset_platform",
        "select_platform",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.hal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from tidal.hal.offload import OffloadHandle
    from tidal.hal.platform import (
        KINDS,
        PRECISIONS,
        NoDeviceError,
        NoopEvent,
        NoopStream,
        Platform,
        PlatformDescriptor,
        PlatformError,
        PlatformUnavailable,
        describe,
    )
    from tidal.hal.select import (
        ENV_VAR,
        VALID_SPECS,
        Selection,
        availability,
        check_spec,
        current_platform,
        detect,
        init_platform,
        reset_platform,
        select_platform,
    )
