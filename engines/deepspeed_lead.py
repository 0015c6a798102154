"""The ranks other than 0 of a `deepspeed` train group led by rank 0
(`DeepSpeedTrainEngine(rank0_leads=True)`, what `tidal run` builds on several ranks).

The same commands, over the same wire, as an `fsdp` group's (`tidal.engines.fsdp_commands`'s
`send_command` / `receive_command`, and `fsdp_lead.stop_followers`): rank 0's engine sends
one before each call, and every other rank runs `follow()`, which builds an engine whenever
rank 0 builds one and makes the collective calls of each of its calls, until
`stop_followers()`. `tools/ray_run.py` finds this `follow` in the registry's `MULTI_RANK`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tidal.engines.fsdp_commands import receive_command

if TYPE_CHECKING:
    from tidal.engines.deepspeed_train import DeepSpeedTrainEngine


def follow(share: Callable[[DeepSpeedTrainEngine], Any] | None = None) -> dict[str, int]:
    """Every rank but 0 of a group led by rank 0: do what rank 0's engines do, until `stop_followers()`.

    Returns what this rank did: engines built, optimizer steps, rows, passes over the weights
    (`exports`: the passes that gather, ZeRO-3's; under ZeRO-1 and -2 rank 0 exports alone).
    A follower builds its model from `type(model)(model.config)` with random weights;
    DeepSpeed broadcasts rank 0's when the engine starts.

    `share`: this rank time-shares its devices; `share(engine)` seats each engine this builds
    and returns a seat (`turn()`, `close()`), and every command runs in `turn()`, as in
    `tidal.engines.fsdp_lead.follow`. (A deepspeed engine has no `model` to park, so the
    seats of `flow.colocate` refuse it: see `tidal.engines.deepspeed_train`.)

    A command that raises ends this with its error, but for `FloatingPointError` (gradients
    that stayed non-finite raise it on every rank at the same step, nothing stepped): rank 0
    then saves a checkpoint, whose collectives need this rank.
    """
    from tidal.engines.deepspeed_train import DeepSpeedTrainEngine  # noqa: PLC0415 - that module sends these commands

    if not dist.is_initialized() or dist.get_rank() == 0:
        raise RuntimeError("follow() runs on the ranks other than 0 of an initialised process group")
    engine: DeepSpeedTrainEngine | None = None
    seat: Any = None
    done = {"engines": 0, "steps": 0, "rows": 0, "exports": 0}
    try:
        while True:
            command = receive_command()
            if command["op"] == "stop":
                return done
            if command["op"] == "init":
                if seat is not None:
                    seat.close()
                engine = seat = None  # the previous engine goes before the next one is built
                cls, config, dtype = command["model"]
                with torch.random.fork_rng(devices=[]):  # building draws random weights; DeepSpeed broadcasts rank 0's
                    model = cls(config).to(dtype)
                engine = DeepSpeedTrainEngine(model, rank0_leads=True, **command["options"])
                seat = share(engine) if share is not None else None
                done["engines"] += 1
                continue
            if engine is None:
                raise RuntimeError(f"rank 0 sent {command['op']!r} before building an engine")
            with seat.turn() if seat is not None else contextlib.nullcontext():
                try:
                    engine.follow_command(command)
                except FloatingPointError:  # every rank raised it at this step, nothing stepped: rank 0's
                    continue  # checkpoint of that state still needs this rank's collectives
            done["steps"] += command["op"] in ("train_step", "sft_step")
            done["exports"] += command["op"] == "named_weights"
            done["rows"] += command["rows"][engine.rank] if command["op"] in ("train_step", "sft_step") else 0
    finally:
        if seat is not None:
            seat.close()
