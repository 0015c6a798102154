"""Colocated, hybrid and multiplexed layouts at run time: engines seated at one `Turns`.

`flow.timeshare` has the pieces (`Turns`, `Seat`, the shared engines, `Offloader`); this
module puts them where a plan says roles share devices, under both runtimes:

- `Sharing` seats engines at one `Turns`, each parking through `Offloader` (the hal
  platform's offload: weights, gradients, optimizer state and a train engine's frozen
  `reference` policy to host memory while the other seat computes), and reports what
  happened (hand-offs, parks, bytes parked).
  `runtime: local` gives its trainer and rollout engines one in-process `Turns`.
- Under `runtime: ray`, `spots(plan)` says where every actor goes: an instance with
  devices of its own on its role's bundle; a rollout instance that time-shares a
  trainer's devices (`colocated`, or `borrowed` from a lender) on that trainer's bundle,
  each seat asking for a fraction of the bundle's device (a bundle of several devices:
  the trainer asks for them all, its guests for none of them, and get its visible
  devices, so guests on different devices of one such bundle are refused). One `Turns`
  per shared bundle runs as a threaded actor (`start_turns`), and each process reaches
  it through a `TurnsProxy`, so `Seat` works unchanged.
- Any rank of a multi-rank (fsdp) trainer may host guests, and a guest may span the
  devices of several ranks (a tensor-parallel instance over two ranks' devices): every
  rank's bundle then gets a `Turns`. A spanning guest sits on its first rank's bundle,
  asks Ray for no device (it gets the union of its ranks' visible devices) and takes all
  its ranks' turns at once (`TurnsSpan`). Rank 0 takes every rank's turn in its engine's
  calls before it sends the command all ranks run, and the other ranks compute in the
  turn it took for them (`Seat.held`, in `follow()`), parking their own shards when a
  guest asks. Turns are always taken in rank order, so no deadlock. Run on CPU with gloo
  and fake devices only (tests/tools/test_colocate_run.py: two fsdp ranks with a guest
  each, and with one guest spanning both).

A colocated instance's generation pauses at the next chunk boundary when the trainer asks
for its turn, and resumes from the same trajectories with its next turn. A borrowed
(multiplexed) instance's generation pauses the same way but continues elsewhere: its
worker runs in hand-off mode (`RolloutActor(hand_off=True)`, set for assignments whose
mode is `borrowed`), writes each paused group back into the store's `prompts` as a
resumable row (acking the rows it took in the same put) and takes new rows only once its
seat's turn is back, so the instances with devices of their own continue those groups
meanwhile (`flow.rollout`). Every token keeps the version that produced it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tidal.flow.placement import RAY_RESOURCES, Assignment, PlacementError, Plan
from tidal.flow.protocols import HoldsModel, HoldsOptimizer, HoldsReference, MovesAfterOffload, ParksItself
from tidal.flow.timeshare import Offloader, Seat, SharedCritic, SharedRewardModel, SharedRolloutEngine, SharedTrainEngine
from tidal.flow.turns import Turns

TURNS_CONCURRENCY = 64
"""Calls a `Turns` actor serves at once: each seat may block in `acquire` and in `wait_park`."""
SHARE_UNIT = 1e-4
"""Ray's resource precision: fractions of a device are rounded down to it."""


class Sharing:
    """Engines of this process seated at one `turns` (a `Turns` or a `TurnsProxy`)."""

    def __init__(self, turns: Any, platform: Any) -> None:
        self.turns, self.platform = turns, platform
        self._seats: list[tuple[str, Seat, Offloader | None]] = []  # (what it parks, its seat, its offloader: None for an engine that parks itself)
        self._parkings: dict[int, _Parking] = {}  # id(seat) -> what it moves
        self._alongside: dict[int, tuple[tuple[str, Seat, Offloader | None], _Moves]] = {}  # id(SharedCritic) -> its entry and moves, of one in another engine's seat

    def _offloader(self, engine: Any, name: str, *, optimizer: bool) -> Offloader:
        """Parks `engine`'s `model`, its frozen `reference` policy where it holds one (a train
        engine built for a KL term: a whole model's weights), and its `optimizer`'s state."""
        model = engine.model if isinstance(engine, HoldsModel) else None
        if model is None:
            raise ValueError(f"{type(engine).__name__} has no `model` to park; it cannot time-share devices (seat {name!r})")
        reference = engine.reference if isinstance(engine, HoldsReference) else None
        parked = torch.nn.ModuleList([model, reference]) if isinstance(reference, torch.nn.Module) else model  # holds both, changes neither
        parked_optimizer = engine.optimizer if optimizer and isinstance(engine, HoldsOptimizer) else None
        moved = engine.after_offload_move if isinstance(engine, MovesAfterOffload) else None  # a sharded engine's hook
        return Offloader(self.platform, parked, parked_optimizer, moved=moved)

    def _moves(self, engine: Any, name: str, *, optimizer: bool) -> tuple[_Moves, Offloader | None]:
        """How `engine`'s state parks and comes back: its own `park` / `unpark` where it
        `ParksItself` (its memory is its own, not a module's), else through an `Offloader`."""
        if isinstance(engine, ParksItself):
            return (engine.park, engine.unpark), None
        offloader = self._offloader(engine, name, optimizer=optimizer)
        return (offloader.park, offloader.unpark), offloader

    def _seat(self, engine: Any, name: str, *, optimizer: bool) -> Seat:
        """Seat `engine` at a seat of its own (`_moves`)."""
        moves, offloader = self._moves(engine, name, optimizer=optimizer)
        parking = _Parking([moves])
        seat = Seat(self.turns, name, park=parking.park, unpark=parking.unpark)
        self._seats.append((name, seat, offloader))
        self._parkings[id(seat)] = parking
        return seat

    def train(self, engine: Any, name: str = "train") -> SharedTrainEngine:
        return SharedTrainEngine(engine, self._seat(engine, name, optimizer=True))

    def critic(self, critic: Any, name: str = "critic") -> SharedCritic:
        """A critic (`algorithm.advantage=gae`) seated here too, its model and AdamW state parked
        as the trainer's are. Where this process seats a train engine (its seat "train"), the
        critic shares that seat: both states move together, and the workflow's critic calls
        inside the trainer's turn (a multi-rank engine holds it from its step through its
        weight pass) go on in it instead of waiting for a turn of their own. Else it gets a
        seat of its own."""
        train = next((seat for label, seat, _ in self._seats if label == "train"), None)
        if train is None:
            return SharedCritic(critic, self._seat(critic, name, optimizer=True))
        moves, offloader = self._moves(critic, name, optimizer=True)
        entry = (name, train, offloader)
        self._parkings[id(train)].moves.append(moves)
        self._seats.append(entry)
        shared = SharedCritic(critic, train)
        self._alongside[id(shared)] = (entry, moves)
        return shared

    def unseat(self, shared: SharedCritic) -> None:
        """Stop parking the critic of `shared`, one that shares another engine's seat (it is being replaced)."""
        joined = self._alongside.pop(id(shared), None)
        if joined is not None:
            entry, moves = joined
            self._seats.remove(entry)
            self._parkings[id(shared.seat)].moves.remove(moves)

    def reward_model(self, model: Any, name: str = "reward_model") -> SharedRewardModel:
        """A reward model (`reward_model.path`) seated here too: its weights are parked between its scorings."""
        return SharedRewardModel(model, self._seat(model, name, optimizer=False))

    def rollout(self, engine: Any, name: str = "rollout") -> SharedRolloutEngine:
        return SharedRolloutEngine(engine, self._seat(engine, name, optimizer=False))

    def summary(self) -> dict[str, Any]:
        """Hand-offs on these devices so far, and what each of this process's seats parked
        (a critic that shares the trainer's seat is listed apart: its seat's parks, its bytes)."""
        seats = {label: {"parks": s.num_parks, "parked_bytes": o.num_bytes if o is not None else 0} for label, s, o in self._seats}  # an engine that parks itself counts its own
        state = self.turns.state()
        spans = {"arbiters": len(state["arbiters"])} if "arbiters" in state else {}  # a `TurnsSpan`: handoffs summed over them
        return {"handoffs": state["handoffs"], "seats": seats, **spans}

    def close(self) -> None:
        for seat in {id(s): s for _, s, _ in self._seats}.values():
            seat.close()


_Moves = tuple[Callable[[], None], Callable[[], None]]
"""How one engine's state parks and comes back: (park, unpark)."""


class _Parking:
    """What one seat moves: the states of the engines in it (a trainer's and its critic's),
    parked and brought back together. After a park that raised part-way, `unpark` brings back
    what each moved (nothing, for those that moved nothing)."""

    def __init__(self, moves: list[_Moves]) -> None:
        self.moves = moves

    def park(self) -> None:
        for park, _ in self.moves:
            park()

    def unpark(self) -> None:
        for _, unpark in self.moves:
            unpark()


class TurnsProxy:
    """A `Turns` actor's methods as plain blocking calls (what `Seat` expects)."""

    _METHODS = frozenset({"join", "acquire", "release", "wanted", "announce", "retract", "wait_park", "leave", "begin_park", "park_failed", "parked", "state"})

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Any:
        if name not in TurnsProxy._METHODS:
            raise AttributeError(name)
        import ray  # noqa: PLC0415

        method = getattr(self.handle, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


# Ray placement of shared devices ----------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Spot:
    """Where one role instance's actor goes under Ray."""

    group: str
    """The role whose placement group holds the bundle."""
    bundle: int
    """The bundle's index in that group."""
    resources: dict[str, float]
    """What the actor asks of the bundle."""
    turns: tuple[int, ...] = ()
    """The trainer ranks whose devices (and `Turns`) it time-shares, in rank order; a
    trainer rank's own when any guest shares a trainer's devices; empty: it computes alone."""


def spots(plan: Plan) -> dict[tuple[str, int], Spot]:
    """Every assignment's spot, keyed by (role, rank).

    A guest sits on the bundle of the (first) trainer rank whose devices it uses; when it
    uses devices of several ranks it takes all their turns (see the module docstring).

    Raises:
        PlacementError: a shared layout this runtime cannot run: a guest that is not a
            rollout instance on the trainer's devices, or guests on different devices of
            one trainer instance of several (`_one_part_each`).
    """
    own: dict[str, list[Assignment]] = {}
    for a in plan.assignments:
        if a.mode == "own":
            own.setdefault(a.role, []).append(a)
    trainers = own.get("train", [])
    guests: dict[int, list[Assignment]] = {}  # by the first host rank
    hosts_of: dict[int, tuple[int, ...]] = {}  # rollout rank -> the trainer ranks whose devices it uses
    for a in plan.assignments:
        if a.mode == "own":
            continue
        if a.role != "rollout":
            raise PlacementError(f"role {a.role!r} ({a.mode}) cannot time-share devices under runtime=ray: only rollout instances time-share the trainer's")
        hosts = tuple(i for i, t in enumerate(trainers) if t.node == a.node and set(a.devices) & set(t.devices))
        if not hosts or not set(a.devices) <= {d for i in hosts for d in trainers[i].devices}:
            raise PlacementError(f"rollout instance {a.rank} ({a.mode}) uses devices {list(a.devices)} on {a.node} that no trainer instance holds")
        hosts_of[a.rank] = hosts
        guests.setdefault(hosts[0], []).append(a)
    for index, host in enumerate(trainers):
        _one_part_each(host, index, [a for a in plan.assignments if a.mode != "own" and index in hosts_of[a.rank]])
    out: dict[tuple[str, int], Spot] = {}
    for role, assignments in own.items():
        for i, a in enumerate(assignments):
            out[(role, a.rank)] = Spot(group=role, bundle=i, resources={RAY_RESOURCES[a.kind]: float(len(a.devices))}, turns=(i,) if role == "train" and guests else ())
    for index, seated in guests.items():
        host = trainers[index]
        resource, num_devices = RAY_RESOURCES[host.kind], len(host.devices)
        alone = [a for a in seated if hosts_of[a.rank] == (index,)]
        if num_devices == 1 and alone:  # Ray lets fractions of one device share it
            each = round(int(1.0 / (len(alone) + 1) / SHARE_UNIT) * SHARE_UNIT, 4)
            out[("train", host.rank)] = dataclasses.replace(out[("train", host.rank)], resources={resource: round(1.0 - each * len(alone), 4)})
        for a in seated:
            # fractions above 1 are not allowed, and one actor sits in one bundle: a guest of a
            # multi-device bundle, or of several, asks for no device and gets the trainers' visible devices
            shares = {resource: each} if num_devices == 1 and a in alone else {}
            out[(a.role, a.rank)] = Spot(group="train", bundle=index, resources=shares, turns=hosts_of[a.rank])
    return out


def _one_part_each(host: Assignment, index: int, seated: list[Assignment]) -> None:
    """Refuse guests on different devices of one trainer instance of several: each would get
    all its devices (Ray shares only fractions of one) and build on the first, and they would
    wait for each other at the bundle's one `Turns`."""
    parts: dict[tuple[int, ...], Assignment] = {}
    for a in seated:
        parts.setdefault(tuple(sorted(set(a.devices) & set(host.devices))), a)
    if len(host.devices) > 1 and len(parts) > 1:
        (mine, first), (theirs, second) = list(parts.items())[:2]
        raise PlacementError(
            f"rollout instances {first.rank} and {second.rank} use different devices ({list(mine)} and {list(theirs)}) of trainer instance {index}'s "
            f"{len(host.devices)} on {host.node}: under runtime=ray a guest of a trainer instance of several devices is given all of them, so these "
            f"would build on one device and take turns with each other; set placement.rollout.devices_each={len(host.devices)} (one rollout instance "
            "over the trainer's devices), or placement.train.devices_each=1 (a trainer rank per device, more placement.train.count, train.backend=fsdp)"
        )


def start_turns(placements: Mapping[tuple[str, int], Spot], groups: Mapping[str, Any], *, name: str) -> dict[int, Any]:
    """One `Turns` actor per trainer bundle of a trainer with guests (`Spot.turns`), on that
    bundle's node (it asks for no resources); keyed by trainer rank.

    Each is a named actor, `turns_actor_name(name, rank)` (`name`: unique to this run's
    attempt), so a rollout actor looks its seats up by name instead of taking the handles
    as constructor arguments: Ray refuses to promise a restartable actor (`max_restarts`
    > 0) its constructor's handles and says so in an error line (ray-project/ray#53727).
    """
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

    actor_cls = ray.remote(num_cpus=0, max_concurrency=TURNS_CONCURRENCY, max_restarts=0)(Turns)  # type: ignore[call-overload]  # ray's stubs lack max_concurrency
    out = {}
    for (role, _), spot in placements.items():
        if role == "train" and spot.turns:
            strategy = PlacementGroupSchedulingStrategy(placement_group=groups["train"], placement_group_bundle_index=spot.bundle)
            rank = spot.turns[0]
            out[rank] = actor_cls.options(scheduling_strategy=strategy, name=turns_actor_name(name, rank)).remote()
    return out


def turns_actor_name(name: str, rank: int) -> str:
    """The Ray name of trainer rank `rank`'s `Turns` actor among those `start_turns(name=name)` started."""
    return f"{name}-rank{rank}"


def find_turns(names: Sequence[str]) -> list[Any]:
    """The `Turns` actors named `names` (`turns_actor_name`), looked up in this Ray job."""
    import ray  # noqa: PLC0415

    return [ray.get_actor(n) for n in names]
