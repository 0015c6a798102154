"""The `fsdp` engine's state: its own sharded checkpoints (model, optimizer, lr schedule
position and version, and the KL reference's shards where the engine holds one) written by
every rank with torch.distributed.checkpoint into one directory and read back by any number
of ranks (`FSDPTrainEngine.save_checkpoint` / `load_checkpoint`); and a sharded module's full,
un-sharded state on rank 0's host in the torch engines' format (`full_state`, `load_full_state`),
what `state_dict()` of the fsdp policy and critic gives and takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from tidal.engines.lr_schedule import load_position
from tidal.engines.train_steps import own_settings

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Gathered on rank 0's host (other ranks get nothing)."""
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
"""Rank 0's full state, broadcast into every rank's shards."""


def save_sharded(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, version: int, reference: torch.nn.Module | None = None) -> None:
    """Write this rank's shards of `model` (and `optimizer`'s state, once it has any), the
    schedule's step, `version` and `reference`'s shards to `directory`; every rank calls it."""
    state: dict[str, Any] = {"version": torch.tensor(version, dtype=torch.int64), "lr_step": torch.tensor(scheduler.last_epoch, dtype=torch.int64)}
    if reference is not None:
        state["reference"] = reference.state_dict()
    if optimizer.state:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    else:
        state["model"] = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, reference: torch.nn.Module | None = None) -> int:
    """Read what `save_sharded` wrote into `model`, `optimizer` (keeping its own settings:
    `own_settings`), `scheduler` and `reference` (in place; a checkpoint without one leaves
    it the weights the engine was built with); returns the saved version."""
    stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    has_optimizer = any(key.startswith("optimizer.") for key in stored)
    state: dict[str, Any] = {"version": torch.tensor(0, dtype=torch.int64), **({"lr_step": torch.tensor(0, dtype=torch.int64)} if "lr_step" in stored else {})}
    if reference is not None and any(key.startswith("reference.") for key in stored):
        state["reference"] = reference.state_dict()  # its own shards: dcp.load reads into them
    if has_optimizer:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    else:
        state["model"] = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=str(directory))
    if has_optimizer:
        with own_settings(optimizer):
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])
        optimizer.state.clear()
    load_position(scheduler, {"last_epoch": int(state.get("lr_step", state["version"]))})  # from before schedules: a step per version
    return int(state["version"])


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, frozen: torch.nn.Module | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """The un-sharded state of `model`, of `optimizer` in torch's own format (parameters by
    their index in the optimizer's order, as a one-process engine saves it) and of `frozen`
    (a module without optimizer, or None) on rank 0's host; other ranks get empty ones. A
    collective: every rank calls it. Copies, not views of live engine state."""
    frozen_state = None if frozen is None else get_model_state_dict(frozen, options=FULL)
    if not optimizer.state:  # nothing to gather; asking would create zero moments
        model_state, optim = get_model_state_dict(model, options=FULL), optimizer.state_dict()
    else:
        full, gathered = get_state_dict(model, optimizer, options=FULL)
        by_name: dict[str, Any] = dict(gathered)
        index = {name: i for i, name in enumerate(param_names(model, optimizer))}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name.get("param_groups", [])]
        model_state, optim = full, {"state": {index[n]: s for n, s in by_name.get("state", {}).items()}, "param_groups": groups}
    live = _live_storage(model, optimizer, frozen)
    copied = lambda state: {k: v.clone() if torch.is_tensor(v) and v.untyped_storage().data_ptr() in live else v for k, v in state.items()}  # noqa: E731
    optim = {**optim, "state": {i: copied(s) for i, s in optim["state"].items()}} if optimizer.state else optim
    return copied(model_state), optim, None if frozen_state is None else copied(frozen_state)


def _live_storage(model: torch.nn.Module, optimizer: torch.optim.Optimizer, frozen: torch.nn.Module | None) -> set[int]:
    """Where the engine's live tensors sit: on CPU a "gathered" or "offloaded" tensor can be the
    live one itself (the optimizer's `step`), which later steps would change under a snapshot."""
    live = [model.state_dict().values(), *(s.values() for s in optimizer.state.values()), *([frozen.state_dict().values()] if frozen is not None else [])]
    return {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for group in live for t in group if torch.is_tensor(t)}


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the optimizer's order (torch's integer ids)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim: dict[str, Any] | None, *, rank: int) -> None:
    """Rank 0's full `model_state` and `optim` (torch's format, `full_state`; None: no
    optimizer state, which clears this optimizer's) into every rank's shards; other ranks
    pass empty ones, but None alike. The optimizer keeps its own settings (`own_settings`).
    A collective: every rank calls it."""
    set_model_state_dict(model, model_state if rank == 0 else {}, options=FROM_RANK0)  # it fills `model_state` with the shards
    if optim is None:
        optimizer.state.clear()
        return
    names = param_names(model, optimizer)
    by_name: Any = {
        "state": {names[int(i)]: s for i, s in optim.get("state", {}).items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optim.get("param_groups", [])],
    }
    with own_settings(optimizer):
        set_optimizer_state_dict(model, optimizer, by_name if rank == 0 else {}, options=FROM_RANK0)
