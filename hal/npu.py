"""Huawei Ascend NPUs through torch_npu (`torch.npu`).

Written against the real torch_npu API (torch.npu device / RNG / stream / memory calls,
`torch_npu.npu.mstx` profiling ranges); tested here with a faithful fake `torch_npu`
injected by the tests, never with the real package: without the CANN toolkit an
installed torch_npu makes `import torch` itself fail (torch autoloads it as a device
backend), so it is never installed on machines without NPUs.

Pitfalls encoded here:
- torch_npu is imported only inside `load()`, when the npu platform is chosen; detection
  uses `importlib.util.find_spec`, which does not import it.
- `ASCEND_RT_VISIBLE_DEVICES` must be set before torch_npu is imported.
- Memory calls go to `torch.npu`: torch_npu's allocator is not a torch.accelerator one.
- HCCL picks fixed ports by default, which collide when several jobs share a node:
  port ranges are set to `auto`; HCCL's 120 s connect timeout is too short for large jobs.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import torch

from tidal.hal.accelerator import AcceleratorPlatform, Vendor
from tidal.hal.platform import PlatformUnavailable

COMM_ENV = {
    "HCCL_HOST_SOCKET_PORT_RANGE": "auto",
    "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
    "HCCL_CONNECT_TIMEOUT": "1800",
}

CANN_HINT = (
    "install the Ascend CANN toolkit and load its environment "
    "(source /usr/local/Ascend/ascend-toolkit/set_env.sh) before starting tidal"
)

# Device names of Ascend chips whose cube units run fp8 matmuls.
_FP8_CHIPS = ("Ascend950",)


def installed() -> bool:
    """True if torch_npu can be found; does not import it."""
    return importlib.util.find_spec("torch_npu") is not None


def _dtype_support() -> dict[str, bool]:
    npu: Any = torch.npu  # type: ignore[attr-defined]  # torch_npu adds it
    name = npu.get_device_name()
    return {
        "bf16": npu.is_bf16_supported(),
        "fp16": True,
        # Ascend cube units have no fp64 path; many fp64 ops fall back or are missing.
        "fp64": False,
        "fp8": name.startswith(_FP8_CHIPS),
    }


def load() -> AcceleratorPlatform:
    if not installed():
        raise PlatformUnavailable(
            "platform 'npu' needs torch_npu, which is not installed: install tidal-rl[npu] "
            f"(torch_npu matching torch {torch.__version__.split('+')[0]}) and {CANN_HINT}"
        )
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as e:  # any failure here means CANN is not usable
        raise PlatformUnavailable(
            f"torch_npu is installed but failed to import ({type(e).__name__}: {e}); the CANN "
            f"toolkit is missing or not loaded: {CANN_HINT}"
        ) from e
    mod = getattr(torch, "npu", None)
    if mod is None:
        raise PlatformUnavailable(f"torch_npu {getattr(torch_npu, '__version__', '?')} imported but did not register torch.npu")
    mstx = torch_npu.npu.mstx
    vendor = Vendor(
        kind="npu",
        module=mod,
        comm_env=COMM_ENV,
        range_start=lambda name: mstx.range_start(name, None),
        range_end=mstx.range_end,
        dtype_support=_dtype_support,
        # torch_npu brings its own fused optimizers (torch_npu.optim); whether torch's
        # `fused=True` kernels run on an NPU is not verified here, so they are not asked for
        fused_optimizers=False,
        initialized=lambda: "torch_npu" in sys.modules,
        machine_count=lambda: None,  # never asked: this load imported torch_npu, after which the variable is fixed
    )
    return AcceleratorPlatform(vendor)
