"""How the `fsdp` train engine gets its process group and shards its model
(`FSDPTrainEngine.__init__`): the group hal sets up, or one from torchrun's variables, and
FSDP2's `fully_shard` on every decoder layer and the root, reducing gradients by a plain sum;
and the local calls on its sharded modules (`reshard`, `reset_sharded_params`)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from tidal.hal import Platform

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def ensure_process_group(platform: Platform) -> None:
    """Use the initialised default process group, or initialise it through hal from torchrun's variables."""
    if not dist.is_available():
        raise RuntimeError("the fsdp train engine needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            "the fsdp train engine needs an initialised torch.distributed process group: call "
            "platform.init_process_group(rank=..., world_size=...) (tidal.hal) before building it, "
            f"or launch with torchrun; no process group is initialised and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set"
        )
    platform.init_process_group(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def rank_device(platform: Platform) -> torch.device:
    """This rank's device (its `LOCAL_RANK` where the platform shows it several), made current."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = platform.device(local_rank if platform.device_count() > 1 else 0)
    platform.set_device(device)
    return device


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: the model's `_no_split_modules` classes (HF decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """`fully_shard` every decoder layer of `model`, then the root, over `mesh`; gradients are
    reduced by a plain sum (the engine's loss weights already divide by the global batch)."""
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a plain sum
            module.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1.0), which gloo lacks


def _fsdp_modules(modules: tuple[torch.nn.Module | None, ...]) -> list[FSDPModule]:
    return [m for module in modules if module is not None for m in module.modules() if isinstance(m, FSDPModule)]


def reshard(*modules: torch.nn.Module | None) -> None:
    """Reshard every FSDP module of `modules` (local: no collective). After a forward without
    backward a root keeps its gathered parameters; every rank reshards at the same point, so
    their next all-gathers match, and what a park moves is only this rank's shards."""
    for module in _fsdp_modules(modules):
        module.reshard()


def reset_sharded_params(*modules: torch.nn.Module | None) -> None:
    """After an offload moved each parameter's local shard (to host memory or back): point
    FSDP's flat shard buffers of `modules`, which its all-gathers read, at the moved shards.
    The same call `FSDPModule._apply` (`module.to(...)`) makes after moving parameters."""
    for module in _fsdp_modules(modules):
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group per state
            groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
        for group in groups:
            for param in group.fsdp_params:
                param.reset_sharded_param()
