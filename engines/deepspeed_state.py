"""The `deepspeed` train engine's weights and state, whole, whatever the ZeRO stage: exported
one parameter at a time (`weight_specs`, `weight_pass`), and saved and loaded in
`TorchTrainEngine.state_dict`'s format (`full_state`, `load_full_state`).

Where things live: under ZeRO-1 and -2 every rank holds the whole model (its parameters are
views into DeepSpeed's flat buffers, updated in place after each step), and each rank holds
the fp32 master copy and AdamW moments of one slice of each flat buffer. Under ZeRO-3 the
parameters are sliced too: a partitioned parameter is an empty tensor with `ds_shape`, its
slice in `ds_tensor`, gathered by `deepspeed.zero.GatheredParameters` (parameters under the
persistence threshold stay whole on every rank, and have a slice besides). DeepSpeed's
`safe_get_full_optimizer_state` / `safe_set_full_optimizer_state` reach a parameter's moments
through the slices at any stage (getting is a collective; setting is local, from the whole
tensor). Every function here whose docstring says "collective" is one: every rank calls it,
in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from tidal.hal.transfer import TensorSpec

_HOST = torch.device("cpu")


def _partitioned(tensor: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (sliced over the ranks, or kept whole under the persistence threshold)."""
    return hasattr(tensor, "ds_id")


def _whole_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor (a ZeRO-3 parameter's `ds_shape`, which DeepSpeed sets on it)."""
    return tuple(cast(Any, tensor).ds_shape) if _partitioned(tensor) else tuple(tensor.shape)


def weight_specs(module: torch.nn.Module) -> list[TensorSpec]:
    """Each weight's whole name, shape and dtype, under the un-sharded model's `state_dict`
    names (tied ones included), without gathering anything (local)."""
    specs = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        shape = _whole_shape(tensor)
        specs.append(TensorSpec.of(name, torch.empty(shape, dtype=tensor.dtype, device="meta")))
    return specs


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` whole: a ZeRO-3 parameter gathered and copied (its gathered memory is
    DeepSpeed's to reuse once the gather ends), a collective; any other tensor as it is."""
    if not _partitioned(tensor):
        return tensor.detach()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters  # noqa: PLC0415 - imported by the engine before this runs

    with GatheredParameters([tensor], modifier_rank=None):
        return tensor.detach().clone()


def weight_pass(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight, whole (`whole`), under its `state_dict` name, one at a time: under ZeRO-3
    each parameter gathered when it is reached, a collective; under ZeRO-1 and -2 the tensors
    themselves (no copy), and a pass is local."""
    for name, tensor in module.state_dict(keep_vars=True).items():
        yield name, whole(tensor)


def whole_weights(module: torch.nn.Module, *, rank: int) -> dict[str, torch.Tensor]:
    """Every weight, whole and on the host, under its `state_dict` name (`weight_pass`): a
    collective under ZeRO-3; rank 0 gets the tensors, the others an empty dict."""
    if rank == 0:
        return {name: tensor.to(_HOST, copy=True) for name, tensor in weight_pass(module)}
    for _ in weight_pass(module):  # its collectives
        pass
    return {}


def load_whole_weights(module: torch.nn.Module, *, rank: int, weights: dict[str, torch.Tensor]) -> None:
    """Set every weight from rank 0's whole `weights` (`state_dict` names; the other ranks'
    are not read): a ZeRO-3 parameter gathered, written by rank 0 and partitioned again,
    any other tensor broadcast. A collective."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters  # noqa: PLC0415

    named = {**dict(module.named_parameters()), **{n: b for n, b in module.named_buffers() if n in module.state_dict()}}  # tied names once
    with torch.no_grad():
        for name, tensor in named.items():
            if _partitioned(tensor):
                with GatheredParameters([tensor], modifier_rank=0):  # rank 0 writes, the others get it on exit
                    if rank == 0:
                        tensor.data.copy_(weights[name])
            else:
                if rank == 0:
                    tensor.data.copy_(weights[name])
                dist.broadcast(tensor.data, src=0)


def move_zero3_params(module: torch.nn.Module, device: torch.device, *, frozen_only: bool = False) -> None:
    """Move a ZeRO-3 module's parameters to `device` in place (`.data`): each one's slice
    (`ds_tensor`), and the whole tensor of those kept whole (under the persistence
    threshold). For a module with no optimizer (the ZeRO-3 reference), whose slices are
    tensors of their own rather than views of a flat buffer, or with `frozen_only` for the
    parameters no optimizer steps (a LoRA base: DeepSpeed's flat buffers hold the trained
    ones only, and `offload_states` moves only those); local. Under ZeRO-1 and -2 a frozen
    parameter is a plain tensor, moved the same way."""
    for param in module.parameters():
        if frozen_only and param.requires_grad:
            continue
        if hasattr(param, "ds_tensor"):
            param.ds_tensor.data = param.ds_tensor.data.to(device)
        if param.numel():  # kept whole (an empty tensor where partitioned)
            param.data = param.data.to(device)


def trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters AdamW steps (all but a LoRA base's), in `module.parameters()` order:
    the optimizer state's indexes, as the torch engine's AdamW numbers them."""
    return [p for p in module.parameters() if p.requires_grad]


def full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's weights and AdamW's state, whole and on the host, in the torch engine's
    format: the optimizer's parameters are indexed in `trained(module)` order, each with
    its `step` and moments (a step count DeepSpeed keeps once per flat buffer, the same for
    every parameter). A collective; rank 0 gets the tensors, the others empty dicts.

    `optimizer` is the torch optimizer DeepSpeed steps (over this rank's flat slices).
    """
    from deepspeed.utils import safe_get_full_optimizer_state  # noqa: PLC0415

    model = whole_weights(module, rank=rank)
    params = trained(module)
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(params)))} for group in optimizer.param_groups[:1]]
    flat: dict[str, Any] = next((s for s in optimizer.state.values() if "step" in s), {})  # (ZeRO-3 makes empty entries at the start)
    step = flat.get("step")
    if step is None or float(step) == 0:  # no step taken: nothing to gather (the torch engine's state has none either)
        return model, {"state": {}, "param_groups": groups if rank == 0 else []}
    keys = [key for key, value in flat.items() if torch.is_tensor(value) and value.dim() > 0]  # AdamW's moments
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, param in enumerate(params):
        shape = _whole_shape(param)
        moments = {key: safe_get_full_optimizer_state(param, key).reshape(shape) for key in keys}
        if rank == 0:
            state[index] = {"step": step.to(_HOST, torch.float32, copy=True), **{key: value.to(_HOST, copy=True) for key, value in moments.items()}}
    return model, {"state": state if rank == 0 else {}, "param_groups": groups if rank == 0 else []}


def load_full_state(module: torch.nn.Module, zero_optimizer: Any, *, rank: int, model: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> None:
    """Set the weights (and AdamW's moments and step count, when `optimizer` is given and has
    state) from rank 0's whole tensors, in the torch engine's format; the other ranks pass
    empty ones. A collective. The weights are written where the model computes with them
    (broadcast, or gathered and written by rank 0 under ZeRO-3), and the fp32 master slices
    copied from them (`refresh_fp32_params`: fp32 to fp32, exact). The optimizer keeps its own
    settings; an `optimizer` without state (no step taken) sets a fresh AdamW's: step 0 and
    zero moments, which the next step treats as none.

    `zero_optimizer` is DeepSpeed's ZeRO optimizer; its `optimizer` the torch one it steps.
    """
    from deepspeed.utils import safe_set_full_optimizer_state  # noqa: PLC0415

    load_whole_weights(module, rank=rank, weights=model)
    zero_optimizer.refresh_fp32_params()
    inner = zero_optimizer.optimizer
    if optimizer is None:
        return
    has_state = _broadcast_object(bool(optimizer.get("state")) if rank == 0 else None)
    if not has_state:  # a fresh AdamW's: step 0 and zero moments, in place (ZeRO-1 and -2 keep views of them)
        for flat in inner.state.values():
            for value in flat.values():
                if torch.is_tensor(value):
                    value.zero_()
        return
    saved = optimizer["state"] if rank == 0 else {}
    first = saved[min(saved)] if rank == 0 else {}
    step, keys = _broadcast_object((float(first["step"]), sorted(k for k in first if k != "step")) if rank == 0 else None)
    _ensure_state(zero_optimizer, keys)
    for flat in inner.state.values():
        if "step" in flat:
            flat["step"].fill_(step)
    for index, param in enumerate(trained(module)):
        shape = _whole_shape(param)
        for key in keys:
            value = saved[index][key].to(param.device, torch.float32).contiguous() if rank == 0 else torch.empty(shape, dtype=torch.float32, device=param.device)
            dist.broadcast(value, src=0)
            safe_set_full_optimizer_state(param, value, key)


def _ensure_state(zero_optimizer: Any, keys: list[str]) -> None:
    """Give each flat fp32 slice AdamW's state where no step made it yet: zero moments and a
    step count of 0, made as torch's AdamW makes them (a float32 `step` on the slice's device
    where the group is fused or capturable, else on the host). ZeRO-1 and -2 reach a
    parameter's moments through views DeepSpeed makes after the first step
    (`lazy_init_hp_params_optimizer_state`): made here, as that step would."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state  # noqa: PLC0415

    inner = zero_optimizer.optimizer
    stage12 = hasattr(zero_optimizer, "single_partition_of_fp32_groups")
    flats = zero_optimizer.single_partition_of_fp32_groups if stage12 else zero_optimizer.fp32_partitioned_groups_flat
    group = inner.param_groups[0]  # the engine makes one
    on_device = bool(group.get("fused") or group.get("capturable"))
    made = False
    for flat in flats:
        state = inner.state[flat]
        if {"step", *keys} <= state.keys():
            continue
        state["step"] = torch.zeros((), dtype=torch.float32, device=flat.device if on_device else _HOST)
        for key in keys:
            state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        made = True
    if made and stage12:
        for i, flat in enumerate(flats):
            lazy_init_hp_params_optimizer_state(zero_optimizer.bit16_groups[i], flat, inner.state)


def relink_optimizer_views(zero_optimizer: Any) -> None:
    """After `reload_states()`: ZeRO-1 and -2 reach each parameter's AdamW moments through
    views (`lazy_init_hp_params_optimizer_state`) that `reload_states` drops when it links
    the fp32 slices again, and does not make again (DeepSpeed 0.19.8 keeps its "linked" flag
    set), so the next `safe_get_full_optimizer_state` (a checkpoint) fails. Made here, over
    the state AdamW holds now; nothing to do under ZeRO-3 or before the first step."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state  # noqa: PLC0415

    if not hasattr(zero_optimizer, "single_partition_of_fp32_groups"):
        return
    inner = zero_optimizer.optimizer
    for i, flat in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        if inner.state.get(flat):
            lazy_init_hp_params_optimizer_state(zero_optimizer.bit16_groups[i], flat, inner.state)


def move_zero3_optimizer(zero_optimizer: Any, device: torch.device) -> None:
    """Move ZeRO-3's fp32 master slices and AdamW's state to `device` in place (`.data`, so
    every reference DeepSpeed and AdamW hold follows): what `offload_states()` /
    `reload_states()` do only for DeepSpeed's FusedAdam. AdamW's `step` counts stay where
    AdamW keeps them (a scalar each)."""
    for flat in zero_optimizer.fp32_partitioned_groups_flat:
        flat.data = flat.data.to(device)
    for state in zero_optimizer.optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                value.data = value.data.to(device)


def offload_zero3_lp_params(zero_optimizer: Any, device: torch.device) -> None:
    """ZeRO-3's `offload_states` step for the 16-bit parameter slices (`lp_params`), over the
    parameters its flat buffer holds. DeepSpeed 0.19.8 maps `module.parameters()` onto the
    buffer there, which fails when some parameters are frozen (a LoRA base, partitioned apart
    from the buffer: "start + length exceeds dimension size"); its `reload_states` maps the
    right ones (`_get_parameter_partitions`), so it brings these back as it would its own.
    Remove once DeepSpeed's offload maps the same list (checked by
    tests/engines/test_deepspeed_lora.py's parking). Local."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum  # noqa: PLC0415
    from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer  # noqa: PLC0415

    zero_optimizer.empty_partition_cache()
    moved = zero_optimizer.lp_param_buffer.to(device)
    zero_optimizer.lp_param_buffer.data = moved
    for tensor, offset, numel in get_mapping_to_flat_buffer(zero_optimizer._get_parameter_partitions()):
        tensor.data = moved.narrow(0, offset, numel)
    zero_optimizer.fp16_partitioned_groups_flat.clear()
    zero_optimizer.offloaded_states.add(OffloadStateTypeEnum.lp_params)


def offload_engine(engine: Any, zero_optimizer: Any, *, zero_stage: int, frozen: bool = False) -> None:
    """Move a DeepSpeed engine's state on this rank (its weights, gradients and AdamW's state,
    in DeepSpeed's flat buffers) to host memory, with `DeepSpeedEngine.offload_states()`. Under
    ZeRO-3 DeepSpeed moves the fp32 master slices and AdamW's state only for its own FusedAdam,
    so those are moved here (`move_zero3_optimizer`), and with `frozen` parameters (a LoRA
    base) its own move of the weights fails, so they are moved here too. Local, no collective."""
    if zero_stage < 3:
        engine.offload_states()
        return
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum  # noqa: PLC0415

    if frozen:  # DeepSpeed's own lp_params step fails with frozen parameters
        offload_zero3_lp_params(zero_optimizer, _HOST)
    engine.offload_states(include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer])
    move_zero3_optimizer(zero_optimizer, _HOST)


def reload_engine(engine: Any, zero_optimizer: Any, *, zero_stage: int, device: torch.device) -> None:
    """Bring back what `offload_engine` moved: `DeepSpeedEngine.reload_states()` (and under
    ZeRO-3 the master slices and AdamW's state), then the views ZeRO-1 and -2 give checkpoints
    of AdamW's state (`relink_optimizer_views`). Local, no collective."""
    engine.reload_states()
    if zero_stage == 3:
        move_zero3_optimizer(zero_optimizer, device)
    relink_optimizer_views(zero_optimizer)


def _broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank (a small pickled object over the default group)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, device=_HOST)
    return box[0]
