"""Commands of an `fsdp` train group led by rank 0 (`FSDPTrainEngine(rank0_leads=True)`).

Only rank 0 is called by the program (the workflow); each of its engine's calls first
broadcasts a small command (`send_command`), and every other rank runs `follow()`:
receive a command, make the same collective calls, repeat, until `stop_followers()`.
See `tidal.engines.fsdp_train` for what each command does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from tidal.engines.fsdp_commands import CRITIC, build_from_recipe, receive_command, send_command
from tidal.engines.fsdp_commands import model_recipe as model_recipe  # re-exported: the engines that lead import it from here

if TYPE_CHECKING:
    from tidal.engines.fsdp_train import FSDPTrainEngine

def follow(share: Callable[[FSDPTrainEngine], Any] | None = None) -> dict[str, int]:
    """Every rank but 0 of a group led by rank 0: do what rank 0's engines do, until `stop_followers()`.

    Builds an engine whenever rank 0 builds one (its critic too: `follow_engines`) and
    makes the collective calls of each of its method calls. Returns what this rank did: engines built, optimizer steps, rows,
    passes over the weights (`exports`: one per pass rank 0 started, complete or not), and
    its critic's optimizer steps (`critic_steps`, where the backend holds a critic).

    `share`: this rank time-shares its devices (a colocated rollout guest on them).
    `share(engine)` seats each engine this builds and returns its seat (`turn()`, a
    context manager, and `close()`, called when the engine goes); every command runs in
    `turn()`, entered once the command arrived. Under the Ray runtime rank 0 has taken
    every rank's turn before it sends (`flow.timeshare.TurnsSpan`), so `turn()` is the
    seat's `held()`: onload this rank's parked shards, and park only once it is done.

    A command that raises ends this with its error, but for `FloatingPointError`: gradients
    that stay non-finite raise it at the same step on every rank (the decision is taken on
    the all-reduced norm: `train_steps.NonfiniteGuard`) with nothing stepped, and rank 0
    then saves a checkpoint of that state, whose collectives need this rank, before it
    gives up the group (which ends this).
    """
    from tidal.engines.fsdp_train import FSDPTrainEngine  # noqa: PLC0415 - that module sends these commands

    return follow_engines(FSDPTrainEngine, share)


def follow_engines(engine_cls: Any, share: Callable[[Any], Any] | None = None) -> dict[str, int]:
    """`follow()` for a led group whose engines are `engine_cls` (built as
    `engine_cls(model, rank0_leads=True, **options)`, each command run by its
    `follow_command`): the loop every multi-rank backend's followers share. The group's critic
    (`algorithm.advantage=gae`) is built, seated by `share` and called likewise for the
    commands marked `engine=CRITIC`, beside the policy engine: of the class rank 0 built, which
    its init command names (`cls`, one of `engines.registry.CRITIC`'s)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        raise RuntimeError("follow() runs on the ranks other than 0 of an initialised process group")
    built: dict[str, Any] = {}  # "policy" and CRITIC -> the engine
    seats: dict[str, Any] = {}  # and its seat
    done = {"engines": 0, "steps": 0, "rows": 0, "exports": 0, "critic_steps": 0}
    try:
        while True:
            command = receive_command()
            if command["op"] == "stop":
                return done
            role = command.get("engine", "policy")
            if command["op"] == "init":
                if seats.get(role) is not None:
                    seats.pop(role).close()
                built.pop(role, None)
                engine = None  # the previous engine's shards go before the next one's arrive
                cls = _critic_class(command) if role == CRITIC else engine_cls
                built[role] = engine = cls(build_from_recipe(command["model"]), rank0_leads=True, **command["options"])
                seats[role] = share(engine) if share is not None else None
                done["engines"] += role != CRITIC
                continue
            engine = built.get(role)
            if engine is None:
                raise RuntimeError(f"rank 0 sent {command['op']!r} to its {role} before building one")
            with seats[role].turn() if seats[role] is not None else contextlib.nullcontext():
                try:
                    engine.follow_command(command)
                except FloatingPointError:  # every rank raised it at this step, nothing stepped: rank 0's
                    continue  # checkpoint of that state (`tools.train`) still needs this rank's collectives
            if role == CRITIC:
                done["critic_steps"] += command["op"] == "train_step"
                continue
            done["steps"] += command["op"] in ("train_step", "sft_step")
            done["exports"] += command["op"] == "named_weights"
            done["rows"] += command["rows"][engine.rank] if command["op"] in ("train_step", "sft_step") else 0
    finally:
        for seat in seats.values():
            if seat is not None:
                seat.close()


def _critic_class(command: dict[str, Any]) -> Any:
    """The critic class an init command names (`cls`: a `engines.registry.CRITIC` entry)."""
    from tidal.engines.registry import CRITIC, imported  # noqa: PLC0415 - the registry imports nothing of the engines' until asked

    if command.get("cls") not in CRITIC.values():
        raise RuntimeError(f"rank 0 built a critic of a class the followers do not know: {command.get('cls')!r} (known: {', '.join(sorted(set(CRITIC.values())))})")
    return imported(command["cls"])


def stop_followers() -> None:
    """Rank 0 of a led group: end every other rank's `follow()` (does nothing in a group of one)."""
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        send_command("stop")
