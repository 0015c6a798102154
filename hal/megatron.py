"""What megatron-core needs from the platform before it runs: MindSpeed's adaptor on NPUs, two
small patches where tensors live in host memory (the CPU platform and the fake ones), nothing
on GPUs. Applied by one call, `prepare_megatron(platform)`, before the engine imports
megatron-core's model code (`tidal.engines.megatron_train`); `seed_megatron` then seeds
megatron's device RNG tracker where there is a device, `check_precision` refuses mixed precision
on the host (megatron's linear layers autocast on CUDA only), and `restore_megatron` undoes the
host patches (tests).

**NPU: MindSpeed's adaptor.** `import mindspeed.megatron_adaptor` replaces megatron-core's
CUDA-only pieces (fused kernels, RNG, device queries) with Ascend ones, by patching megatron at
import time: it must be imported before megatron-core is, so `prepare_megatron` refuses a
process where megatron-core came first. Not run here: no NPU, no MindSpeed.

**CPU and fake platforms: two patches** (megatron-core 0.16.1 has no CPU path: it asks CUDA for
its current device, and forks the CUDA generator around attention dropout). Each is applied
once per process (a second call changes nothing), undone by `restore_megatron`, and touches
megatron-core only: torch, other libraries and tidal's other threads see nothing.

1. *The host as megatron's current device, in two of its modules.* Why: the rotary embedding
   (`megatron/core/models/common/embeddings/rotary_pos_embedding.py`,
   `RotaryEmbedding.get_emb`) moves its `inv_freq` to `torch.cuda.current_device()` at the
   first forward, and local attention (`megatron/core/transformer/dot_product_attention.py`,
   `DotProductAttention.forward`) takes its score buffer from
   `megatron/core/utils.py`'s `GlobalMemoryBuffer.get_tensor`, which allocates it there too;
   on a CPU build of torch that call raises ("Torch not compiled with CUDA enabled"), and on a
   GPU machine it would put those tensors on the GPU beside host weights. How: the global name
   `torch` of those two modules becomes a stand-in that is torch in everything but
   `torch.cuda.current_device()`, which answers "cpu" (`_HostTorch`). Every other
   `current_device()` of megatron-core 0.16.1 is on a path this engine does not take
   (inference KV caches, CUDA graphs, sequence and tensor parallelism, fused kernels). Remove
   it when megatron-core allocates on its inputs' device, or when tidal stops running
   megatron-core on CPU.
2. *Megatron's own no-op RNG tracker.* Why: attention runs its dropout inside
   `get_cuda_rng_tracker().fork()` (`megatron/core/tensor_parallel/random.py`,
   `CudaRNGStatesTracker.fork`), which saves and restores the CUDA generator's state and
   raises unless `model_parallel_cuda_manual_seed` (itself `torch.cuda.manual_seed`) added
   one. How: megatron's tracker whose `fork()` forks nothing, the one it uses for inference
   (`initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)`), so dropout, where
   a model has any, draws from torch's CPU generator as the other engines' does. Not a
   monkey patch: a setting of megatron's global tracker (`restore_megatron` sets the default
   one again). Remove it with the first.

**GPU: nothing.** megatron-core runs as NVIDIA ships it (local layer spec; Transformer Engine
where installed is not used yet). Not run here: no GPU.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

from tidal.hal.platform import Platform, PlatformError

ADAPTOR = "mindspeed.megatron_adaptor"
"""MindSpeed's module that adapts megatron-core to Ascend NPUs when it is imported."""
HOST_DEVICE_MODULES = ("megatron.core.models.common.embeddings.rotary_pos_embedding", "megatron.core.utils")
"""The megatron-core modules whose `torch.cuda.current_device()` names the host (the first patch)."""

_patched: dict[str, Any] = {}
"""Module name -> the `torch` it had before the first patch: the patched modules, to undo."""


class _HostCuda(types.ModuleType):
    """`torch.cuda` as the patched modules see it: torch's, but the current device is the host."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _HostTorch(types.ModuleType):
    """`torch` as the patched modules see it: torch in everything but `cuda.current_device()`."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _HostCuda("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_HOST_TORCH = _HostTorch()


def computes_on_host(platform: Platform) -> bool:
    """The platform's tensors live in host memory: the CPU platform, and every fake one."""
    return platform.descriptor.fake or platform.descriptor.kind == "cpu"


def prepare_megatron(platform: Platform) -> None:
    """Make megatron-core runnable on `platform`'s devices; call it before megatron-core's model
    code is imported (the module docstring says what each kind gets).

    Raises:
        RuntimeError: on an NPU, MindSpeed is not installed, or megatron-core was imported in
            this process before MindSpeed's adaptor (whose patches would then miss it).
    """
    if computes_on_host(platform):
        _patch_for_host()
    elif platform.descriptor.kind == "npu":
        _import_adaptor()


def check_precision(platform: Platform, precision: str) -> None:
    """Raises PlatformError where megatron-core cannot train in `precision` on `platform`'s devices:
    mixed precision on the host. Its linear layers are autograd functions declared for CUDA's
    autocast (`megatron/core/tensor_parallel/layers.py`,
    `LinearWithGradAccumulationAndAsyncCommunication`, under `custom_fwd(device_type="cuda")`):
    the host's autocast casts their forward matmuls, but their backward runs without it and
    multiplies bf16 gradients with fp32 weights, which torch refuses."""
    if precision != "fp32" and computes_on_host(platform):
        where = f"a fake {platform.descriptor.kind} platform (host tensors)" if platform.descriptor.fake else "the cpu platform"
        raise PlatformError(f"precision={precision}: megatron-core's linear layers take mixed precision on accelerators only (their backward is declared for CUDA's autocast); on {where} use fp32")


def seed_megatron(platform: Platform, seed: int) -> None:
    """Seed megatron's RNG tracker for dropout on `platform`'s devices, after
    `parallel_state.initialize_model_parallel`: megatron's own seeding on an accelerator (its
    tracker forks the device generator; MindSpeed's on an NPU), nothing on the host (the
    no-op tracker `prepare_megatron` set draws from torch's CPU generator)."""
    if computes_on_host(platform):
        return
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def restore_megatron() -> None:
    """Undo `prepare_megatron`'s host patches (the modules' own `torch`, megatron's default RNG
    tracker); nothing where none were applied. MindSpeed's adaptor cannot be undone."""
    if not _patched:
        return
    for name, original in _patched.items():
        module: Any = sys.modules[name]
        module.torch = original
    _patched.clear()
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random.initialize_rng_tracker(force_reset=True)


def _patch_for_host() -> None:
    if _patched:
        return
    for name in HOST_DEVICE_MODULES:
        module: Any = importlib.import_module(name)
        _patched[name] = module.torch
        module.torch = _HOST_TORCH
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _import_adaptor() -> None:
    if ADAPTOR in sys.modules:
        return
    if "megatron.core" in sys.modules:
        raise RuntimeError(
            f"megatron-core was imported in this process before MindSpeed's adaptor ({ADAPTOR}), whose patches must come first: "
            "build the megatron train engine before anything imports megatron"
        )
    try:
        importlib.import_module(ADAPTOR)
    except ImportError as e:
        raise RuntimeError(f"train.backend=megatron on Ascend NPUs needs MindSpeed (the `mindspeed` package, matching megatron-core 0.16), which failed to import: {e}") from None
