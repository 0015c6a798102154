"""Versions of the stacks tidal builds on, and why `import torch` may fail. Imports no torch.

Reads package metadata only, so asking for the version of a vendor stack never imports it
(an installed torch_npu without CANN fails on import, and so does `import torch`, which
autoloads it as a device backend).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

PACKAGES = ("torch", "ray", "transformers", "vllm", "torch_npu", "deepspeed", "megatron-core")
VENDOR_PACKAGES = ("torch_npu", "vllm")
"""The packages of PACKAGES that belong to one vendor's stack (shown per node by `tidal doctor --cluster`)."""


def package_versions() -> dict[str, str]:
    """Python, tidal and every package in PACKAGES: its version or "not installed"."""
    versions = {"python": platform.python_version()}
    for name in ("tidal-rl", *PACKAGES):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def explain_torch_import_failure(error: BaseException) -> str:
    """A message for a user whose `import torch` raised `error`, with the likely fix."""
    msg = f"`import torch` fails: {type(error).__name__}: {error}"
    if importlib.util.find_spec("torch_npu") is not None:
        msg += (
            "\ntorch_npu is installed, and torch loads it on import; without the Ascend CANN "
            "toolkit that import fails. Load CANN (source /usr/local/Ascend/ascend-toolkit/set_env.sh), "
            "or set TORCH_DEVICE_BACKEND_AUTOLOAD=0, or uninstall torch_npu on machines without NPUs."
        )
    return msg


def missing_stack(kind: str) -> str | None:
    """What this machine lacks to run devices of `kind` (npu, cuda, cpu), from package
    metadata alone (imports nothing); None when nothing is seen missing. A node that
    advertises NPUs or GPUs to Ray but lacks its vendor's torch fails the first actor placed
    there, after the run has started."""
    if kind == "npu" and importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (the Ascend adapter for torch; with CANN loaded)"
    if kind == "cuda":
        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            return "torch is not installed"
        if version.endswith("+cpu"):
            return f"torch {version} is a CPU-only build (install a CUDA build of torch)"
    return None
