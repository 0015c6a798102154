"""The `fsdp` engine's own sharded checkpoints: model, optimizer, lr schedule position and
version (and the KL reference's shards, where the engine holds one) written by
every rank with torch.distributed.checkpoint into one directory, and read back by any number
of ranks (`FSDPTrainEngine.save_checkpoint` / `load_checkpoint`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

from tidal.engines.lr_schedule import load_position
from tidal.engines.train_steps import own_settings


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
