"""The commands rank 0 of a led train group sends its followers (`tidal.engines.fsdp_lead`):
a small pickled dict over the default process group, then each follower's share of the
rows (`send_rows`, `receive_rows`, and `gather_rows` for what comes back). Apart from
`fsdp_lead` so that the engines that send them import this, not the module that follows
them (no import circle)."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tidal.engines import remote_code
from tidal.engines.micro_batches import rank_shares

_HOST = torch.device("cpu")


CRITIC = "critic"
"""A command's `engine` when it is for the group's critic (`engines.fsdp_critic`), not its policy engine."""


def send_command(op: str, **args: Any) -> None:
    """Rank 0: tell the followers what to do next (a small pickled dict over the default group)."""
    dist.broadcast_object_list([{"op": op, **args}], src=0, device=_HOST)


def receive_command() -> dict[str, Any]:
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, device=_HOST)
    return box[0]


@dataclasses.dataclass(frozen=True)
class ModelRecipe:
    """What a follower needs to build a model like rank 0's (`build_from_recipe`; the weights
    come from rank 0)."""

    classes: bytes
    """The model's class and config, pickled apart from the command so that `code` is in
    place before they are unpickled."""
    code: dict[str, str]
    """The source files of a `trust_remote_code` model's classes (`remote_code.module_files`;
    empty for any other), which a follower's process may never have loaded."""
    dtype: torch.dtype
    recompute: bool
    """Whether it recomputes activations (`model.gradient_checkpointing`, a module setting
    its config does not carry)."""


def model_recipe(model: torch.nn.Module) -> ModelRecipe:
    """The recipe of `model` for a led group's followers (`build_from_recipe`)."""
    from tidal.engines.models import recomputes_activations  # noqa: PLC0415 - transformers, imported when a group is led

    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"rank0_leads=True needs a transformers-style model with a `config` (the other ranks build type(model)(model.config)); {type(model).__name__} has none")
    classes = pickle.dumps((type(model), config))
    return ModelRecipe(classes, remote_code.module_files(type(model), type(config)), next(model.parameters()).dtype, recomputes_activations(model))


def build_from_recipe(recipe: ModelRecipe) -> torch.nn.Module:
    """A follower's model like rank 0's (`model_recipe`), with random weights (rank 0's
    replace them; this process's RNG is left as it was). A rank that recomputed
    activations while another did not would run other collectives in its backward passes
    (ZeRO-3 gathers the weights of each recomputed layer again): the group would hang."""
    from tidal.engines.models import recompute_activations  # noqa: PLC0415

    remote_code.install(recipe.code)
    cls, config = pickle.loads(recipe.classes)  # rank 0's own objects, as every command is
    with torch.random.fork_rng(devices=[]):  # building draws random weights
        model = cls(config).to(recipe.dtype)
    if recipe.recompute:
        recompute_activations(model)
    return model


def send_rows(op: str, tensors: Sequence[torch.Tensor | None], lengths: torch.Tensor, world_size: int, **args: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Rank 0: send `op` and each follower its share of the rows of `tensors` (the
    `rank_shares` of the rows' token `lengths`: even tokens, not even rows, so no rank
    holds a step's long tail alone). Returns rank 0's rows and every rank's row indexes,
    for `gather_rows`. Followers read theirs with `receive_rows`."""
    shares = [torch.tensor(share, dtype=torch.long) for share in rank_shares(lengths.tolist(), world_size)]
    specs = [None if t is None else (t.dtype, tuple(t.shape[1:])) for t in tensors]
    send_command(op, rows=[len(share) for share in shares], specs=specs, **args)
    for rank in range(1, world_size):
        if len(shares[rank]):
            for t in tensors:
                if t is not None:
                    dist.send(t[shares[rank].to(t.device)].to(_HOST).contiguous(), dst=rank)
    return [None if t is None else t[shares[0].to(t.device)] for t in tensors], shares


def receive_rows(command: dict[str, Any], rank: int) -> list[torch.Tensor | None]:
    """A follower: this rank's share of the rows rank 0 sent with `command` (`send_rows`)."""
    n = command["rows"][rank]
    out: list[torch.Tensor | None] = []
    for spec in command["specs"]:
        if spec is None:
            out.append(None)
            continue
        dtype, shape = spec
        tensor = torch.empty((n, *shape), dtype=dtype)
        if n:
            dist.recv(tensor, src=0)
        out.append(tensor)
    return out


def gather_rows(own: torch.Tensor, shares: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rank 0: its own part (`own`, rows `shares[0]`) and each follower's, received in rank
    order and shaped like `own`'s rows, put back in the batch's order."""
    out = torch.empty((sum(len(share) for share in shares), *own.shape[1:]), dtype=own.dtype)
    out[shares[0]] = own.to(_HOST)
    for rank in range(1, len(shares)):
        if len(shares[rank]):
            part = torch.empty((len(shares[rank]), *own.shape[1:]), dtype=own.dtype)
            dist.recv(part, src=rank)
            out[shares[rank]] = part
    return out
