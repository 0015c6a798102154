"""NVIDIA GPUs through `torch.cuda`.

Written against the real torch.cuda API; run for real only under the `gpu` test marker
(CI has no GPU). Pitfalls encoded here:
- Detection never creates a CUDA context: `torch.cuda.device_count()` asks NVML first, so
  a process can still fork or change `CUDA_VISIBLE_DEVICES` afterwards.
- `CUDA_VISIBLE_DEVICES` only takes effect before CUDA is initialised in the process.
- `NCCL_CUMEM_ENABLE=0`: NCCL's cuMem allocations break CUDA-IPC weight sharing with vLLM.
"""

from __future__ import annotations

import os
import warnings

import torch

from tidal.hal.accelerator import AcceleratorPlatform, Vendor
from tidal.hal.platform import PlatformUnavailable

COMM_ENV = {"NCCL_CUMEM_ENABLE": "0"}


def available() -> bool:
    """True if this torch was built with CUDA and NVML / the driver reports a GPU (no context)."""
    return torch.backends.cuda.is_built() and torch.cuda.device_count() > 0


def machine_count() -> int | None:
    """The machine's GPUs, whatever CUDA_VISIBLE_DEVICES holds: NVML's raw count (no CUDA
    context); without NVML, torch's count when the variable is unset, else None."""
    raw = getattr(torch.cuda, "_raw_device_count_nvml", None)  # private torch API: guarded
    count = -1
    if raw is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Can't initialize NVML": answered below
            try:
                count = raw()
            except OSError:  # no libnvidia-ml
                count = -1
    if count >= 0:
        return count
    return torch.cuda.device_count() if "CUDA_VISIBLE_DEVICES" not in os.environ else None


def _dtype_support() -> dict[str, bool]:
    major, minor = torch.cuda.get_device_capability()
    return {
        "bf16": torch.cuda.is_bf16_supported(),
        "fp16": True,
        "fp64": True,
        # fp8 matmuls (torch._scaled_mm) need Ada (sm_89) or Hopper and later.
        "fp8": (major, minor) >= (8, 9),
    }


def load() -> AcceleratorPlatform:
    if not torch.backends.cuda.is_built():
        raise PlatformUnavailable(
            f"platform 'cuda' needs a CUDA build of torch, but torch {torch.__version__} was built "
            "without CUDA; install a CUDA wheel of torch (pip install torch==<version> from the "
            "CUDA index) or pick another platform with TIDAL_DEVICE=cpu"
        )
    mod = torch.cuda
    vendor = Vendor(
        kind="cuda",
        module=mod,
        comm_env=COMM_ENV,
        range_start=lambda name: mod.nvtx.range_push(name),
        range_end=lambda _token: mod.nvtx.range_pop(),
        dtype_support=_dtype_support,
        fused_optimizers=True,  # torch's fused Adam/AdamW CUDA kernels
        initialized=mod.is_initialized,
        machine_count=machine_count,
    )
    return AcceleratorPlatform(vendor)
