"""The trainer's ranks as Ray actors, and the driver's wait on them.

`TrainerActor` is one rank of the trainer, as `RolloutActor` is one rollout instance: the
actor owns what every trainer rank does whatever it trains (answer the driver's pings, say
where it runs, meet the other ranks in one process group, seat a follower's engines at its
rank's `Turns`), and takes what the rank computes as callables: `lead` (rank 0: the run's
`train()`, in `tools.ray_run`) and `follow` (every other rank: its train backend's
`follow()`, `engines.registry.MULTI_RANK`). Ray ships the callables to the actor's
process, so they are picklable: module-level functions, or `functools.partial`s of them.

`wait_ranks` is the driver's wait for every rank's result: it kills a rank that stopped
answering (`Liveness`), raises a death as Ray's error (a restart), and otherwise reports
rank 0's error first (`first_error`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from tidal.flow.ray.faults import ActorLost, add_note, rank_died, remote_cause
from tidal.flow.ray.liveness import Liveness

GROUP_TIMEOUT_S = 600.0
"""How long a trainer rank's collective waits for the others (a dead rank fails it at once on
CPU; this bounds a rank that hangs)."""
DEATH_NOTICE_S = 15.0
"""After a trainer rank fails, how long the driver waits to hear that another rank died (then
the failure is a restart, not an error)."""


class TrainerActor:
    """Body of a trainer actor: one rank of the trainer.

    Args:
        lead: what rank 0 runs, `lead(ranks=..., turns=...) -> summary`. `ranks` is every
            rank's `where()` (one entry: a single-rank trainer); with several, a process
            group of them is formed around the call, `lead`'s engines lead the others
            (`rank0_leads`), and `lead` must end the followers' `follow` before it returns
            (the end is the followers' protocol, so `lead` sends it: for the `fsdp` and
            `deepspeed` backends, `engines.fsdp_lead.stop_followers()`). `turns` is rank
            0's view of the trainer ranks' `Turns` actors (a `TurnsProxy`, or a `TurnsSpan`
            taking every rank's turn in rank order, parking only rank 0's state), or None
            when no rollout guest time-shares a trainer rank's devices.
        follow: what every other rank runs, `follow(share) -> dict` (a backend's `follow()`):
            until `lead` ends it. `share` is None, or, on a rank whose devices a rollout
            guest time-shares, `share(engine)`, which seats each engine it builds at this
            rank's `Turns` and returns the seat (`turn()`: the turn rank 0 took for this
            rank, `close()`). None: a trainer of one rank.
        follower_threads: torch intra-op threads of a follower (0: torch's default). Rank 0's
            `lead` sets its own, as it sets them per phase; a follower only takes RL steps.

    Both callables are picklable (Ray ships them to this actor's process) and take their
    run's settings bound (`functools.partial`): this class knows no recipe and no engine.
    """

    _group_store: Any = None  # rank 0's rendezvous store, made by `group_address`

    def __init__(self, lead: Callable[..., dict[str, Any]], follow: Callable[..., dict[str, Any]] | None = None, *, follower_threads: int = 0) -> None:
        self.lead, self.follow, self.follower_threads = lead, follow, follower_threads

    def ping(self) -> None:
        """Answers at once, beside `run` (the actor takes two calls at a time): the driver's liveness check."""

    def describe(self) -> dict[str, Any]:
        from tidal.hal import current_platform  # noqa: PLC0415

        return current_platform().descriptor.to_dict()

    def where(self) -> dict[str, Any]:
        """This rank's process, node and platform."""
        import ray  # noqa: PLC0415

        from tidal.hal import current_platform  # noqa: PLC0415

        var = current_platform().descriptor.visible_devices_var
        visible = {var: os.environ.get(var)} if var else {}
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "platform": self.describe(),
            "placement_group": context.get_placement_group_id(),
            "resources": context.get_assigned_resources(),
            "visible_devices": visible,
        }

    def group_address(self) -> str:
        """Rank 0: where the trainer ranks meet to form their process group (this node). The
        rendezvous store is made here, on a port the OS picks, and kept for `run`: a port
        probed free and bound later can be taken by another process in between."""
        import ray  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
        host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        self._group_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        return f"tcp://{host}:{self._group_store.port}"

    def run(self, *, rank: int = 0, ranks: Sequence[Mapping[str, Any]] | None = None, group_address: str | None = None, turns: Mapping[int, Any] | None = None) -> dict[str, Any]:
        """Lead (rank 0) or follow rank 0 (the others), in one process group when there are several ranks.

        Args:
            rank: this rank.
            ranks: every rank's `where()`, in rank order (None: a trainer of one rank).
            group_address: rank 0's `group_address()`, where the ranks meet (several ranks).
            turns: the `Turns` actor of each trainer rank whose devices a rollout guest time-shares.

        Returns:
            Rank 0: what `lead` returned. Another rank: its rank, `where()` and what `follow`
            returned, with `timeshare` (its seats' summary, `Sharing.summary`) when it had a `Turns`.
        """
        from tidal.hal import current_platform  # noqa: PLC0415

        ranks, turns = list(ranks or ()), dict(turns or {})
        world_size = len(ranks) or 1
        if world_size == 1:
            return self._lead(ranks, turns)
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        if rank and self.follower_threads:
            torch.set_num_threads(self.follower_threads)
        store = self._group_store if rank == 0 else None
        current_platform().init_process_group(rank=rank, world_size=world_size, init_method=group_address, timeout_s=GROUP_TIMEOUT_S, store=store)
        try:
            if rank:
                return {"rank": rank, **self.where(), **self._follow(turns.get(rank))}
            return self._lead(ranks, turns)
        finally:
            dist.destroy_process_group()

    def _lead(self, ranks: list[Mapping[str, Any]], turns: dict[int, Any]) -> dict[str, Any]:
        """Rank 0: `lead`, given its view of every rank's `Turns` (it takes every rank's turn,
        in rank order, and parks its own state: `TurnsSpan`)."""
        view = None
        if turns:
            from tidal.flow.colocate import TurnsProxy  # noqa: PLC0415
            from tidal.flow.turns import TurnsSpan  # noqa: PLC0415

            every = [TurnsProxy(turns[r]) for r in sorted(turns)]
            view = every[0] if len(every) == 1 else TurnsSpan(every, parks_on=every[:1])
        return self.lead(ranks=ranks, turns=view)

    def _follow(self, turns: Any) -> dict[str, Any]:
        """A rank other than 0: `follow`; with `turns` (this rank's `Turns` actor) each engine
        it builds is seated there and computes in the turn rank 0 took for it (`Seat.held`),
        and the result says what happened on these devices (`timeshare`, as rank 0's summary does)."""
        if self.follow is None:
            raise ValueError("a trainer of several ranks needs a `follow` for the ranks other than 0")
        if turns is None:
            return self.follow(None)
        seats = _FollowerSeats(turns)
        return {**self.follow(seats), "timeshare": seats.timeshare}


class _FollowerSeats:
    """`share` for a follower's `follow(share)`: each engine it builds gets a seat at this rank's
    `Turns`; its critic shares the policy engine's (`Sharing.critic`), as rank 0's does."""

    def __init__(self, turns: Any) -> None:
        self.turns = turns
        self.timeshare: dict[str, Any] | None = None
        """The last policy engine's seats' summary (RL's: the warm start's engine ran before any guest), its critic's included."""
        self.policy: _FollowerSeat | None = None
        """The seat of the policy engine built last, which a critic joins."""

    def __call__(self, engine: Any) -> _FollowerSeat:
        return _FollowerSeat(self, engine)


class _FollowerSeat:
    """An engine's seat at its rank's `Turns`; closing it drops the seat (and its parked copy).
    A critic's is the policy engine's seat, which it leaves when closed."""

    def __init__(self, seats: _FollowerSeats, engine: Any) -> None:
        from tidal.flow.colocate import Sharing, TurnsProxy  # noqa: PLC0415
        from tidal.flow.protocols import Critic  # noqa: PLC0415
        from tidal.hal import current_platform  # noqa: PLC0415

        self.seats = seats
        self.critic: Any = None
        self.sharing: Sharing
        if isinstance(engine, Critic) and seats.policy is not None:
            self.sharing = seats.policy.sharing
            self.critic = self.sharing.critic(engine)
            seat = self.critic.seat
        else:
            self.sharing = Sharing(TurnsProxy(seats.turns), current_platform())
            seat = (self.sharing.critic(engine) if isinstance(engine, Critic) else self.sharing.train(engine)).seat
            seats.policy = self if not isinstance(engine, Critic) else seats.policy
        self.turn = seat.held  # rank 0 took this rank's turn before it sent the command

    def close(self) -> None:
        if self.critic is not None:  # a seat of the policy engine's: it goes on
            self.sharing.unseat(self.critic)
            return
        self.sharing.close()
        self.seats.timeshare = self.sharing.summary()


def wait_ranks(refs: Sequence[Any], *, watch: Liveness | None = None, tick: Callable[[], None] | None = None) -> list[Any]:
    """Wait for every trainer rank's `run` (`refs`, in rank order); return each rank's result.

    Calls `tick` about once a second (the driver's progress display). A rank silent too long
    for `watch` (its actors: the ranks) is killed, which is a death.

    Raises:
        RayActorError: a rank died (also when another rank's failure was caused by that death).
        RayTaskError: a rank failed and none died: rank 0's error when it failed too (see `first_error`).
    """
    import ray  # noqa: PLC0415

    results: dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, timeout=1.0 if watch is None or not watch.on else min(1.0, watch.every_s))
        for actor in [watch.actors[i] for i in watch.check()] if watch is not None else []:
            ray.kill(actor)  # its call fails: a death, which the caller restarts
        if tick is not None:
            tick()
        for ref in done:
            try:
                results[ref] = ray.get(ref)
            except Exception as e:  # a rank failed: was it because another one died?
                if rank_died(e):
                    raise
                raise first_error(refs, {ref: e}) from None
    return [results[ref] for ref in refs]


def first_error(refs: Sequence[Any], failed: dict[Any, Exception]) -> Exception:
    """After a rank raised (`failed`), wait up to `DEATH_NOTICE_S` for the others (a death is
    raised at once: a restart). Report rank 0's error if it failed (a follower fails with
    "Connection closed by peer" once rank 0 gives up its group, and may be heard first),
    else the first heard; each other rank's error is added as a note."""
    import ray  # noqa: PLC0415

    deadline = time.monotonic() + DEATH_NOTICE_S
    rest = [r for r in refs if r not in failed]
    while rest and time.monotonic() < deadline:
        done, rest = ray.wait(rest, timeout=max(deadline - time.monotonic(), 0.0))
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # another consequence of the same failure, unless it is the death
                if rank_died(e):
                    raise
                failed[ref] = e
    first = failed.get(refs[0], next(iter(failed.values())))
    for rank, ref in enumerate(refs):
        other = failed.get(ref)
        if other is not None and other is not first:
            cause = remote_cause(other)
            add_note(first, f"trainer rank {rank} failed too: {cause}" if isinstance(cause, ActorLost) else f"trainer rank {rank} failed too: {type(cause).__name__}: {cause}")
    return first
