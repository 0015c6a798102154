"""Starting a run's rollout actors from inside the trainer, and wiring the weights to them.

Rank 0's `train()` is handed a `start_rollouts` (by `tools.ray_run`): it serves the store
over ZeroMQ and starts one `RolloutActor` per rollout instance on its bundle
(`start_rollouts`); once the trainer's engine exists, `StartedRollouts.connect` waits for
the actors, chooses the weight transport for the pair of platforms, builds the wiring and
the `RayRollouts` that feed them, and sends the trainer's weights as the first version.
What `train()` then holds is a `RemoteRollouts`, whose `close()` stops the actors and
records what they did in the run's runtime.json.

What this reads of the recipe comes in as a `RolloutSetup`, and the rollout engine as a
picklable `make_engine` (each actor builds its own, in its own process): this package
knows neither the recipe's shape nor any engine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tidal.flow.files import write_whole
from tidal.flow.protocols import SharesWeights
from tidal.hal.transfer import PlacesWeights

if TYPE_CHECKING:
    from tidal.flow.store import Store

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSetup:
    """What starting and wiring the rollout actors takes from the recipe (`tools.ray_run`
    fills it from `seed`, `fault.*` and `transport.*`)."""

    seed: int
    """The run's seed: each actor's worker seeds every generate call from it (`RolloutWorker.sample_seed`)."""
    max_restarts: int
    """Times Ray restarts a dead rollout actor (`fault.rollout_restarts`)."""
    liveness_s: float
    """Silence after which an actor is reported (`fault.liveness_s`; 0: not watched)."""
    liveness_grace_s: float
    """Further silence after which it is killed as dead (`fault.liveness_grace_s`)."""
    transport: str | None
    """The weight transport to use; None: chosen for each pair of platforms (`hal.transfer.choose_transport`)."""
    bucket_bytes: int
    """Size of one bucket of weights on the wire."""
    overlap: bool
    """Send weights in a thread of their own while the trainer goes on (`transport.overlap`;
    off when an actor time-shares the trainer's devices)."""


class RemoteRollouts:
    """What `train()` gets back from `start_rollouts(...).connect`: the `RolloutGroup`, plus `close()`."""

    def __init__(self, rollouts: Any, server: Any, wiring: Any, actors: list[Any], info_path: str, seats: list[tuple[Any, str]]) -> None:
        self._rollouts, self._server, self._wiring, self._actors = rollouts, server, wiring, actors
        self._info_path = Path(info_path)
        self._seats = seats  # (Turns actor, seat name) of each actor that time-shares a trainer rank's devices
        self.timelines: list[dict[str, Any] | None] = []  # each actor's spans (`Tracer.export`), once closed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rollouts, name)

    def weights_wanted(self) -> Any:  # `ResendsWeights`: declared, for `isinstance` on any Python
        return self._rollouts.weights_wanted()

    def close(self) -> None:
        import ray  # noqa: PLC0415

        self._rollouts.stop()
        info = json.loads(self._info_path.read_text())
        self.timelines = [summary.pop("timeline", None) for summary in self._rollouts.summaries]  # for the run's timeline.json
        info["rollout_summaries"] = self._rollouts.summaries  # filled when the actors returned
        info["rollout_restarts"] = self._rollouts.restarts
        info["versions_replaced"] = self._rollouts.versions_replaced
        write_whole(self._info_path, json.dumps(info, indent=2) + "\n")
        for actor in self._actors:
            ray.kill(actor)
        # their state went with them: a trainer rank's next turn (a follower's, for the final
        # checkpoint and evaluation) must not wait for a seat that will never park
        ray.get([turns.leave.remote(seat) for turns, seat in self._seats])
        self._wiring.close()
        self._server.close()


def start_rollouts(
    store: Store,
    settings: Mapping[str, Any],
    *,
    make_engine: Callable[..., Any],
    setup: RolloutSetup,
    groups: Mapping[str, Any],
    assignments: Sequence[Any],
    spots: Mapping[Any, Any],
    turns: Mapping[int, Any],
    turns_name: str,
    fake: bool,
    info_path: str,
    attempt: int = 0,
    ranks: Sequence[Mapping[str, Any]] | None = None,
) -> StartedRollouts:
    """Runs inside the trainer actor: serve `store` and start the rollout actors, which build
    their engines in their own processes meanwhile; `.connect(trainer)` then wires the weights.

    Args:
        store: the trainer's store, served over ZeroMQ to the actors.
        settings: the actors' worker settings (`RolloutActor`), but `sample_seed` (`setup.seed`).
        make_engine: `make_engine(rank=i)` builds rollout instance i's engine inside its
            actor; picklable (a module-level function or a `functools.partial` of one), as
            Ray ships it there.
        setup: what this reads of the recipe.
        groups / assignments / spots / turns: the placement groups by role, the rollout
            assignments, every actor's bundle (`flow.colocate.spots`) and the `Turns` actor
            of each trainer rank whose bundle hosts a rollout guest.
        turns_name: the `name` those `Turns` actors were started with
            (`flow.colocate.start_turns`): a guest is given its seats' names, not handles.
        fake: the recipe's cluster is fake (each actor selects a fake platform).
        info_path: the run's runtime.json, written here and by `connect`.
        attempt / ranks: the trainer's restart count and its ranks' `TrainerActor.where`.

    A rollout instance that time-shares the trainer's devices goes on the trainer's bundle
    with its seat at that bundle's `Turns` actor, or at the `Turns` of every rank whose
    devices it spans (and is given all their visible devices).

    Each actor's worker seeds every generate call from the run's seed, the version and the
    rows it generates (`RolloutWorker.sample_seed`): with `max_staleness: 0` and one actor, a
    run resumed from a checkpoint, whose actors are new processes, samples what the
    uninterrupted run did (no generator state to save or restore).
    """
    import ray  # noqa: PLC0415

    from tidal.flow.colocate import turns_actor_name  # noqa: PLC0415
    from tidal.flow.ray.placement import actor_options  # noqa: PLC0415
    from tidal.flow.ray.runtime import RolloutActor  # noqa: PLC0415
    from tidal.flow.store.server import StoreServer  # noqa: PLC0415

    one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
    host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
    token = secrets.token_hex(16)  # on loopback too: another user's process on a shared node reaches 127.0.0.1 as well
    server = StoreServer(store, address=f"tcp://{'127.0.0.1' if one_node else '0.0.0.0'}:0", token=token)
    address = server.address.replace("0.0.0.0", host)
    # Ray restarts a dead rollout actor (running __init__ again); a call in flight when it died fails.
    actor_cls = ray.remote(max_concurrency=4, max_restarts=setup.max_restarts, max_task_retries=0)(RolloutActor)  # type: ignore[call-overload]  # ray's stubs lack max_concurrency
    actors = []
    for a in assignments:
        spot = spots[("rollout", a.rank)]
        env = {}
        if spot.turns and not spot.resources and ranks:  # a guest of a multi-device bundle, or of several: the trainers' devices
            env = visible_devices([ranks[r] for r in spot.turns])
        options = actor_options(a, groups[spot.group], spot.bundle, fake=fake, env=env, resources=spot.resources)
        # a borrowed seat hands the groups the trainer's reclaim paused to the other instances
        seat = {"turns": [turns_actor_name(turns_name, r) for r in spot.turns], "seat": f"rollout-{a.rank}", "hand_off": a.mode == "borrowed"} if spot.turns else {}
        engine = functools.partial(make_engine, rank=a.rank)
        actors.append(actor_cls.options(**options).remote(engine, store_address=address, store_token=token, settings={**settings, "sample_seed": setup.seed}, **seat))
    return StartedRollouts(
        setup=setup, server=server, address=address, actors=actors, host=host, token=token, assignments=list(assignments),
        spots=spots, turns=turns, info_path=info_path, attempt=attempt, ranks=list(ranks) if ranks is not None else None,
    )


@dataclasses.dataclass(kw_only=True)
class StartedRollouts:
    """Rollout actors started by `start_rollouts`, and the store server they reach at `address`."""

    setup: RolloutSetup
    server: Any
    address: str
    actors: list[Any]
    host: str
    token: str
    assignments: list[Any]
    spots: Mapping[Any, Any]
    turns: Mapping[int, Any]
    info_path: str
    attempt: int
    ranks: list[Mapping[str, Any]] | None

    def connect(self, trainer: Any) -> RemoteRollouts:
        """Wait for the actors, choose the weight transport, send them the trainer's weights."""
        import ray  # noqa: PLC0415

        from tidal.flow.ray.runtime import RayRollouts  # noqa: PLC0415
        from tidal.flow.ray.wiring import make_wiring  # noqa: PLC0415
        from tidal.hal import current_platform  # noqa: PLC0415
        from tidal.hal.platform import PlatformDescriptor  # noqa: PLC0415
        from tidal.hal.transfer import choose_transport  # noqa: PLC0415

        setup = self.setup
        descriptions = ray.get([a.describe.remote() for a in self.actors])
        me = current_platform().descriptor
        my_node = ray.get_runtime_context().get_node_id()
        kinds = set()
        for a, d in zip(self.assignments, descriptions):
            theirs = PlatformDescriptor.from_dict(d["platform"])
            colocated = self.spots[("rollout", a.rank)].turns == (0,)  # on the sender's devices only: a guest of other ranks' is not
            builds = (torch.__version__, d.get("torch", torch.__version__))
            kinds.add(choose_transport(me, theirs, same_node=d["node"] == my_node, colocated=colocated, override=setup.transport, torch_builds=builds))
        transport = "host" if len(kinds) > 1 else kinds.pop()  # one sender for every receiver
        wiring = make_wiring(transport, current_platform(), host=self.host, token=self.token, bucket_bytes=setup.bucket_bytes)
        trainer_info = {"pid": os.getpid(), "attempt": self.attempt, "ranks": self.ranks or [], "node": my_node}
        seating = [{"rank": a.rank, "mode": a.mode, "bundle": [self.spots[("rollout", a.rank)].group, self.spots[("rollout", a.rank)].bundle], "resources": self.spots[("rollout", a.rank)].resources} for a in self.assignments]
        shared = any(self.spots[("rollout", a.rank)].turns for a in self.assignments)  # time-shares a trainer rank's devices
        overlap = setup.overlap and not shared
        if setup.overlap and shared:
            log.warning("transport.overlap is off: a rollout instance time-shares the trainer's devices, so each weight pass must end inside the trainer's turn")
        info: dict[str, Any] = {"transport": transport, "overlap": overlap, "store": self.address, "trainer": trainer_info, "rollout_actors": descriptions, "rollout_seating": seating, "rollout_restarts": [0] * len(self.actors)}
        rollouts: Any = None

        def write_info(descriptions: list[dict[str, Any]]) -> None:
            info.update(rollout_actors=descriptions, rollout_restarts=list(rollouts.restarts) if rollouts else info["rollout_restarts"])
            write_whole(Path(self.info_path), json.dumps(info, indent=2) + "\n")

        seats = [[(self.turns[r], f"rollout-{a.rank}") for r in self.spots[("rollout", a.rank)].turns] for a in self.assignments]  # each actor's, at each Turns it sits at

        def leave_seats(i: int) -> None:  # actor i died for good: a trainer turn must not wait for its state to park
            ray.get([turns.leave.remote(seat) for turns, seat in seats[i]])

        write_info(descriptions)
        rollouts = RayRollouts(self.actors, wiring, max_restarts=setup.max_restarts, on_change=write_info, on_death=leave_seats, overlap=overlap, liveness_s=setup.liveness_s, grace_s=setup.liveness_grace_s)
        write_info(rollouts.descriptions)  # with Ray's count of restarts while the trainer warmed up
        if overlap and isinstance(wiring.sender, PlacesWeights):
            info["weights_in_place"] = _share_weights(trainer, wiring.sender, rollouts)
            write_info(rollouts.descriptions)
        rollouts.publish(trainer.version, trainer.named_weights())  # the actors start from the trainer's weights (a WeightSource: streamed per bucket)
        rollouts.flush()  # ... and have them before any prompt is admitted
        return RemoteRollouts(rollouts, self.server, wiring, self.actors, self.info_path, [seat for each in seats for seat in each])


def _share_weights(trainer: Any, sender: PlacesWeights, rollouts: Any) -> bool:
    """Keep the trainer's weights in the sender's buffer (`ipc`'s shared one), when its engine
    can (`share_weights`): a publish then copies nothing in the trainer's process (each
    rollout actor copies the version out of the trainer's own weights), and before its
    weights next change the engine waits for every actor to have taken the version
    (`rollouts.flush`; on this path it has, long before: a train step's forward and
    backward passes come first). False when the weights stay where they are."""
    if not isinstance(trainer, SharesWeights):
        return False
    try:
        trainer.share_weights(sender.place, before_change=rollouts.flush)
    except ValueError as e:  # raised before anything moved: each publish copies the weights instead
        log.info("the trainer's weights stay in its own memory (each publish copies them): %s", e)
        return False
    return True


def visible_devices(ranks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The visible-devices variables a guest of these trainer ranks' devices gets: theirs,
    joined in rank order (`ranks`: each rank's `TrainerActor.where`)."""
    out: dict[str, list[str]] = {}
    for rank in ranks:
        for var, value in rank.get("visible_devices", {}).items():
            if value is not None:
                joined = out.setdefault(var, [])
                joined += [v for v in value.split(",") if v and v not in joined]
    return {var: ",".join(values) for var, values in out.items()}
