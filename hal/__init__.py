"""tidal.hal: the device abstraction. Everything NPU-, GPU- or CPU-specific lives here.

Importing this package imports torch but no vendor module (torch_npu) and initialises no
device; the platform is chosen on first use (`current_platform()`) or explicitly
(`init_platform(recipe_device)`), from `TIDAL_DEVICE`, the recipe, or detection.
"""

from tidal.hal.offload import OffloadHandle
from tidal.hal.platform import (
    KINDS,
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

__all__ = [
    "ENV_VAR",
    "KINDS",
    "VALID_SPECS",
    "NoDeviceError",
    "NoopEvent",
    "NoopStream",
    "OffloadHandle",
    "Platform",
    "PlatformDescriptor",
    "PlatformError",
    "PlatformUnavailable",
    "Selection",
    "availability",
    "check_spec",
    "current_platform",
    "describe",
    "detect",
    "init_platform",
    "reset_platform",
    "select_platform",
]
