"""The ranks other than 0 of a `megatron` train group led by rank 0
(`MegatronTrainEngine(rank0_leads=True)`, what `tidal run` builds on several ranks).

The `fsdp` group's command loop (`tidal.engines.fsdp_lead.follow_engines`, over
`tidal.engines.fsdp_commands`), as for the `deepspeed` engine: rank 0's engine sends a command
before each call that needs the other ranks, and every other rank builds an engine whenever rank
0 builds one and makes that call's collectives, until `fsdp_lead.stop_followers()`.
`tools/ray_run.py` finds this `follow` in the registry's `MULTI_RANK`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tidal.engines.fsdp_lead import follow_engines

if TYPE_CHECKING:
    from tidal.engines.megatron_train import MegatronTrainEngine


def follow(share: Callable[[MegatronTrainEngine], Any] | None = None) -> dict[str, int]:
    """Every rank but 0 of a group led by rank 0: do what rank 0's engines do, until `stop_followers()`.

    Returns what this rank did: engines built, optimizer steps, rows, `exports` (always 0:
    every rank holds the whole model, so rank 0 exports its weights alone) and `critic_steps`.
    The group's critic (`algorithm.advantage=gae`) is by default the `fsdp` backend's
    (`engines.fsdp_critic`: a transformers value model sharded with FSDP2 over these ranks),
    built and called for the commands marked `engine="critic"` (`fsdp_lead.follow_engines`). A follower builds its
    model from `type(model)(model.config)` with random weights; the engine takes rank 0's when it
    starts.

    `share`: seats each engine this builds (`turn()`, `close()`), as in
    `tidal.engines.fsdp_lead.follow`. (A megatron engine has no `model` to park, so the seats of
    `flow.colocate` refuse it: see `tidal.engines.megatron_train`.)

    A command that raises ends this with its error, but for `FloatingPointError` (gradients that
    stayed non-finite raise it on every rank at the same step, nothing stepped).
    """
    from tidal.engines.megatron_train import MegatronTrainEngine  # noqa: PLC0415 - that module sends these commands

    return follow_engines(MegatronTrainEngine, share)
