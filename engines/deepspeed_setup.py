"""How the `deepspeed` train engine starts DeepSpeed (`DeepSpeedTrainEngine.__init__`): imported
for the accelerator hal's platform computes on, over the process group hal set up (or one
from torchrun's variables), with the ZeRO configuration the engine asks for.

Two upstream patches, applied by `import_deepspeed` (their only caller):

- **No shared-memory all-reduce op on the CPU accelerator.** Why: when DeepSpeed starts its
  communication backend it JIT-compiles a C++ extension (`deepspeed_shm_comm`, through
  ninja and the host compiler) on the CPU accelerator: a compile on each machine's first
  run, so on every fresh CI machine. Only `inference_all_reduce` (DeepSpeed's
  tensor-parallel inference layers) uses it; ZeRO training never does. How: the op is
  marked incompatible in `deepspeed.ops.__compatible_ops__`, the dict DeepSpeed fills once
  per process and consults before building an op (edits to it persist, as its comment
  says), so `comm.torch.build_shm_op()` returns None. Upstream: no switch exists
  (`DS_BUILD_SHM_COMM` only picks what a pre-built install compiles); setting
  `TORCH_EXTENSIONS_DIR` to a cached folder would keep the build instead. Remove it when
  DeepSpeed gains a switch, or when tidal runs DeepSpeed inference on CPU.
- **Two of torch's deprecation warnings ignored.** Why: ZeRO's collectives call
  `torch.distributed.all_gather_into_tensor` and `reduce_scatter_tensor`, which torch 2.13
  deprecates with a `FutureWarning` that Python's once-per-place filter does not hold back
  here: a rank's log fills with them. How: a `warnings` filter for those two messages only. Upstream: DeepSpeed 0.19.8 still calls them. Remove it when
  DeepSpeed calls `all_gather_single` / `reduce_scatter_single`.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tidal.engines.fsdp_setup import TORCHRUN_VARS
from tidal.hal import Platform
from tidal.hal.select import DEEPSPEED_VAR as ACCELERATOR_VAR  # hal sets it when it selects the platform

_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
"""The start of the two warnings the second patch ignores."""
ZERO_STAGES = (1, 2, 3)
"""What `zero_stage` may be: 1 shards the optimizer state, 2 also the gradients, 3 also the weights."""


def import_deepspeed(platform: Platform) -> ModuleType:
    """`deepspeed`, its accelerator the one hal's platform computes on (`DS_ACCELERATOR`, set
    here before the first import), with the module's two patches applied.

    Raises:
        RuntimeError: DeepSpeed is not installed, or it picked another accelerator already
            (`DS_ACCELERATOR` set to another one, or DeepSpeed used before in this process).
    """
    wanted = platform.descriptor.deepspeed_accelerator
    given = os.environ.get(ACCELERATOR_VAR)
    if given and given != wanted:
        raise RuntimeError(f"{ACCELERATOR_VAR}={given}, but this process computes on the {platform.kind} platform{' (fake: host tensors)' if platform.descriptor.fake else ''}, whose DeepSpeed accelerator is {wanted!r}: unset {ACCELERATOR_VAR}")
    os.environ[ACCELERATOR_VAR] = wanted
    try:
        import deepspeed  # noqa: PLC0415 - an optional extra, imported when the engine is built
        from deepspeed.accelerator import get_accelerator  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError(f"train.backend=deepspeed needs DeepSpeed: pip install 'tidal-rl[deepspeed]' ({e})") from None
    picked = get_accelerator().device_name()
    if picked != wanted:
        raise RuntimeError(f"DeepSpeed runs on its {picked!r} accelerator in this process (picked before tidal set {ACCELERATOR_VAR}); this platform needs {wanted!r}")
    if wanted == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the first patch: see the module docstring
    warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVES, category=FutureWarning)  # the second
    return deepspeed


def ensure_process_group(platform: Platform) -> None:
    """Use the initialised default process group, or initialise it through hal from torchrun's
    variables; DeepSpeed wraps that group and starts none of its own."""
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            "the deepspeed train engine needs an initialised torch.distributed process group: call "
            "platform.init_process_group(rank=..., world_size=...) (tidal.hal) before building it, "
            f"or launch with torchrun; no process group is initialised and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set"
        )
    platform.init_process_group(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def local_device_index(platform: Platform) -> int:
    """The index of this rank's device among those the process sees: `LOCAL_RANK` where the
    process sees several (torchrun on one machine), else 0 (a Ray actor sees its own). DeepSpeed
    asserts that `LOCAL_RANK` is set; it is set to 0 where no launcher set it."""
    local_rank = int(os.environ.setdefault("LOCAL_RANK", "0"))
    return local_rank if platform.device_count() > 1 else 0


def deepspeed_config(*, zero_stage: int, grad_clip: float, model: torch.nn.Module) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO `zero_stage` engine over fp32 weights, gradients and
    optimizer state (mixed precision is the engine's autocast, not DeepSpeed's bf16 mode).

    tidal cuts each step into micro-batches itself and weighs their losses: DeepSpeed's
    batch sizes are bookkeeping (one row, no accumulation count), and with
    `managed_gradient_accumulation: false` each `backward()` accumulates and each `step()` is
    the accumulation boundary, however many micro-batches came before it. Gradients are
    clipped by DeepSpeed to `grad_clip`. Where the model has a `config.hidden_size`, the
    buckets and ZeRO-3's persistence threshold are Hugging Face Accelerate's `auto` values
    (parameters under 10 x hidden elements stay whole on every rank: biases and norms).

    Raises:
        ValueError: `zero_stage` is not 1, 2 or 3.
    """
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {', '.join(map(str, ZERO_STAGES))} (ZeRO: 1 shards the optimizer state, 2 also the gradients, 3 also the weights), got {zero_stage!r}")
    zero: dict[str, Any] = {"stage": zero_stage}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int) and hidden > 0:
        zero["reduce_bucket_size"] = hidden * hidden
        if zero_stage == 3:
            zero.update(stage3_prefetch_bucket_size=int(0.9 * hidden * hidden), stage3_param_persistence_threshold=10 * hidden)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, with the platform's options
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
