"""The commands rank 0 of a led train group sends its followers (`tidal.engines.fsdp_lead`):
a small pickled dict over the default process group. Apart from `fsdp_lead` so that the
engines that send them import this, not the module that follows them (no import circle)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_HOST = torch.device("cpu")


def send_command(op: str, **args: Any) -> None:
    """Rank 0: tell the followers what to do next (a small pickled dict over the default group)."""
    dist.broadcast_object_list([{"op": op, **args}], src=0, device=_HOST)


def receive_command() -> dict[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, device=_HOST)
    return box[0]


def model_recipe(model: torch.nn.Module) -> tuple[type, Any, torch.dtype]:
    """What a follower needs to build a model like rank 0's (the weights come from rank 0)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"rank0_leads=True needs a transformers-style model with a `config` (the other ranks build type(model)(model.config)); {type(model).__name__} has none")
    return type(model), config, next(model.parameters()).dtype
