"""The ranks other than 0 of a `deepspeed` train group led by rank 0
(`DeepSpeedTrainEngine(rank0_leads=True)`, what `tidal run` builds on several ranks).

The same commands, over the same wire, as an `fsdp` group's (`tidal.engines.fsdp_commands`'s
`send_command` / `receive_command`, and `fsdp_lead.stop_followers`): rank 0's engine sends
one before each call, and every other rank runs `follow()`, which builds an engine whenever
rank 0 builds one and makes the collective calls of each of its calls, until
`stop_followers()`. `tools/ray_run.py` finds this `follow` in the registry's `MULTI_RANK`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tidal.engines.fsdp_lead import follow_engines

if TYPE_CHECKING:
    from tidal.engines.deepspeed_train import DeepSpeedTrainEngine


def follow(share: Callable[[DeepSpeedTrainEngine], Any] | None = None) -> dict[str, int]:
    """Every rank but 0 of a group led by rank 0: do what rank 0's engines do, until `stop_followers()`.

    Returns what this rank did: engines built, optimizer steps, rows, passes over the weights
    (`exports`: the passes that gather, ZeRO-3's; under ZeRO-1 and -2 rank 0 exports alone),
    and its critic's steps (`critic_steps`: the critic rank 0 built, `engines.deepspeed_critic` or
    with `critic.backend=fsdp` `engines.fsdp_critic`, built and called beside the engine).
    A follower builds its model from `type(model)(model.config)` with random weights;
    DeepSpeed broadcasts rank 0's when the engine starts.

    `share`: this rank time-shares its devices; `share(engine)` seats each engine this builds
    and returns a seat (`turn()`, `close()`), and every command runs in `turn()`, as in
    `tidal.engines.fsdp_lead.follow`; the seat parks this rank's state with the engine's own
    `park()` (see `tidal.engines.deepspeed_train`).

    A command that raises ends this with its error, but for `FloatingPointError` (gradients
    that stayed non-finite raise it on every rank at the same step, nothing stepped): rank 0
    then saves a checkpoint, whose collectives need this rank.
    """
    from tidal.engines.deepspeed_train import DeepSpeedTrainEngine  # noqa: PLC0415 - that module sends these commands

    return follow_engines(DeepSpeedTrainEngine, share)
