"""Roles that take turns on the same devices (the colocated and multiplexed layouts).

When rollout is colocated with training, both engines live on the same devices but only
one may compute at a time, and the one waiting keeps its state in host memory so the
other has the device memory. Three pieces:

- `Turns`: the arbiter for one set of shared devices. A seat `acquire`s a turn (first
  come, first served), computes, `release`s it. Which seat's state is *resident* on the
  devices is tracked too: a seat that acquires while another seat's state is resident
  waits until that seat has parked it (and fails, naming it, if that park failed).
  Plain blocking methods, so the same class serves threads of one process (`runtime:
  local`) and, as a threaded Ray actor, several processes (`runtime: ray`).
- `Seat`: one role instance's side. `with seat.turn():` acquires, onloads this seat's
  state if it was parked, and releases at the end *without* parking: parking happens
  only when another seat needs the devices, on the seat's own parking thread (in its
  own process, under its own lock, so never in the middle of its computation).
- `SharedTrainEngine` / `SharedRolloutEngine`: engines whose calls take a turn each.
  The rollout side also pauses its generation at the next chunk boundary when another
  seat is waiting (partial rollout), so a trainer never waits for a whole generation;
  its `reclaimed` tells the worker the pause was for the devices, not for its own
  `should_pause`. The worker then resumes the paused trajectories with its next turn,
  or, in hand-off mode, hands them to another rollout instance and `wait_turn`s.

The workflow does not know any of this: the runtime wraps the engines when the plan
says two roles share devices.

Every wait and reading of time goes through a `clock` (`flow.clock`; the real one by
default), so `tidal simulate` can run these pieces on its virtual clock. A seat's lock is
held while it computes, which on a virtual clock is a simulated wait: it is therefore a
`ClockMutex` (a lock made of the clock's condition), not a `threading.Lock`.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.clock import REAL, Clock
from tidal.flow.protocols import Collective, HoldsModel, Refill
from tidal.flow.trajectory import TokenBatch, Trajectory
from tidal.hal.transfer import LazyWeights

log = logging.getLogger(__name__)

PARK_POLL_S = 10.0
"""The longest a parking thread's `wait_park` blocks before it checks again (a backstop: `leave` wakes it)."""


class ClockMutex:
    """A lock whose waiting goes through `clock`: what a lock held across a computation must
    be on a virtual clock, where a thread blocked on a plain lock would stop simulated time
    (on the real clock it acts as a `threading.Lock`). Not re-entrant."""

    def __init__(self, clock: Clock = REAL) -> None:
        self._cond = clock.condition(threading.Lock())
        self._held = False

    def __enter__(self) -> ClockMutex:
        with self._cond:
            self._cond.wait_for(lambda: not self._held)
            self._held = True
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


class Turns:
    """Who computes on one set of shared devices now, and whose state is on them."""

    def __init__(self, *, clock: Clock = REAL) -> None:
        self._clock = clock
        self._cond = clock.condition()
        self._queue: collections.deque[tuple[str, int]] = collections.deque()  # (seat, its join count) per waiting acquire
        self._joins: collections.Counter[str] = collections.Counter()
        self._holder: str | None = None
        self._resident: str | None = None
        self._park_wanted: set[str] = set()
        self._park_errors: dict[str, str] = {}  # seat -> why its last park failed (until it computes or parks again)
        self._joined: set[str] = set()  # seats joined and not left since
        self._left: set[str] = set()
        self.handoffs = 0
        """Times the devices passed from one seat's state to another's."""

    def join(self, seat: str) -> None:
        """Register `seat`. A seat joining again without having left is a restarted process
        (a Ray actor killed and restarted): its old claims are dropped, and an `acquire` its
        old process left waiting fails instead of taking the turn. A first join, or one after
        `leave`, drops nothing: claims under that name then are another process's (rank 0 of
        a multi-rank trainer takes each rank's turn under the name that rank's seat joins
        with, possibly before that rank has built and seated its engine)."""
        with self._cond:
            if seat in self._joined:
                self._forget(seat)  # its state died with the old process
            self._joined.add(seat)
            self._left.discard(seat)

    def acquire(self, seat: str, timeout: float | None = None) -> bool:
        """Wait for `seat`'s turn; True when its state must be onloaded (it was parked)."""
        deadline = None if timeout is None else self._clock.now() + timeout
        with self._cond:
            if self._holder == seat:
                raise RuntimeError(f"seat {seat!r} asked for a turn while holding one (turns do not nest)")
            claim = (seat, self._joins[seat])
            self._queue.append(claim)
            try:
                while True:
                    if self._joins[seat] != claim[1]:  # under Ray: a call whose caller died and was restarted
                        raise RuntimeError(f"seat {seat!r} joined again while this acquire waited (its process was restarted); dropped")
                    if self._holder is None and self._queue[0] == claim:
                        if self._resident in (None, seat):
                            break
                        if self._resident in self._park_errors:
                            raise RuntimeError(
                                f"seat {seat!r} cannot have the devices: seat {self._resident!r} failed to move its state off the devices "
                                f"({self._park_errors[self._resident]}); see that seat's log, and free host memory or give the roles devices of their own"
                            )
                        self._park_wanted.add(self._resident)  # the resident seat's parking thread wakes
                        self._cond.notify_all()
                    left = None if deadline is None else deadline - self._clock.now()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"seat {seat!r} waited {timeout:.1f}s for its turn: held by {self._holder!r}, "
                            f"state of {self._resident!r} on the devices, queue {[s for s, _ in self._queue]}"
                        )
                    self._cond.wait(left)
            finally:
                if claim in self._queue:  # gone already if the seat joined again
                    self._queue.remove(claim)
                    self._cond.notify_all()  # a claim behind it may be first now
            self._holder = seat
            self._park_wanted.discard(seat)  # it computes now; nobody waits for its state to leave
            self._park_errors.pop(seat, None)  # its next park is tried again
            onload = self._resident != seat
            if onload:
                self.handoffs += 1
            self._resident = seat
            return onload

    def release(self, seat: str) -> None:
        with self._cond:
            if self._holder != seat:
                raise RuntimeError(f"seat {seat!r} released a turn held by {self._holder!r}")
            self._holder = None
            self._cond.notify_all()

    def wanted(self, seat: str) -> bool:
        """True when another seat is waiting for the devices."""
        with self._cond:
            return any(other != seat for other, _ in self._queue)

    def wait_park(self, seat: str, timeout: float) -> bool:
        """Block until another seat needs `seat`'s state off the devices (True), `seat` leaves or `timeout` passes."""
        with self._cond:
            return self._cond.wait_for(lambda: seat in self._park_wanted or seat in self._left, timeout) and seat not in self._left

    def leave(self, seat: str) -> None:
        """`seat` is closing (or its process is gone): its parking thread stops waiting, and its
        state no longer stands in the next seat's way (it goes with its engine). A turn it
        still holds is released (a process killed inside its turn never releases it), and an
        `acquire` it left waiting fails."""
        with self._cond:
            self._joined.discard(seat)
            self._left.add(seat)
            self._forget(seat)

    def _forget(self, seat: str) -> None:
        """Drop every claim of `seat`'s process (the lock held): the turn and the devices it
        held, its park request, and its waiting `acquire`s, which fail (its join count moves on)."""
        if self._holder == seat:
            self._holder = None
        if self._resident == seat:
            self._resident = None
        self._park_wanted.discard(seat)
        self._park_errors.pop(seat, None)
        self._joins[seat] += 1
        self._queue = collections.deque(claim for claim in self._queue if claim[0] != seat)
        self._cond.notify_all()

    def begin_park(self, seat: str) -> bool:
        """True when `seat` should park now: still asked to, and not holding a turn."""
        with self._cond:
            return seat in self._park_wanted and self._holder != seat

    def park_failed(self, seat: str, error: str) -> None:
        """`seat` could not park (`error` says why): the seats waiting for its state to leave
        the devices fail, naming it, instead of waiting for ever; it parks again only when asked
        after its next turn."""
        with self._cond:
            self._park_wanted.discard(seat)
            self._park_errors[seat] = error
            self._cond.notify_all()

    def parked(self, seat: str) -> None:
        """`seat`'s state is in host memory now; the devices are free for the next seat."""
        with self._cond:
            self._park_wanted.discard(seat)
            self._park_errors.pop(seat, None)
            if self._resident == seat and self._holder != seat:
                self._resident = None
            self._cond.notify_all()

    def state(self) -> dict[str, Any]:
        with self._cond:
            return {"holder": self._holder, "resident": self._resident, "queue": [s for s, _ in self._queue], "handoffs": self.handoffs}


class TurnsSpan:
    """Several `Turns` taken as one, for a seat whose work needs devices of several arbiters.

    Two users under `runtime: ray`, both with one arbiter per trainer rank:

    - a rollout instance spanning the devices of several trainer ranks (tensor-parallel
      over two ranks' devices, say): its one state sits on all of them, so a park request
      from any of its arbiters parks it and the park is reported to all (`parks_on`: all);
    - rank 0 of a multi-rank trainer, which takes *every* rank's turn before it sends a
      command that all ranks run together, but parks only its own state (`parks_on`: its
      own arbiter; each other rank parks its own shards, `Seat.held`).

    `acquire` takes the turns one by one in the order given, and every user gives them in
    trainer-rank order. That order is what keeps a spanning guest and a collective trainer
    from waiting for each other: if each rank took its own turn once rank 0's command
    arrived, a guest on ranks 1 and 2 holding rank 1's turn while it waits for rank 2's,
    and rank 2 holding its own while its collective waits for rank 1, would wait forever.
    `turns` (and `parks_on`) are `Turns` or proxies to them.
    """

    def __init__(self, turns: Sequence[Any], parks_on: Sequence[Any] | None = None, *, clock: Clock = REAL) -> None:
        if not turns:
            raise ValueError("TurnsSpan needs at least one Turns")
        self._clock = clock
        self.turns = list(turns)
        self.parks_on = list(turns if parks_on is None else parks_on)
        self._waits: dict[int, Any] = {}  # arbiter index -> its pending `wait_park` (one each, kept across calls)
        self._pool: Any = None

    def join(self, seat: str) -> None:
        for t in self.parks_on:
            t.join(seat)

    def acquire(self, seat: str, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else self._clock.now() + timeout
        taken: list[Any] = []
        onload = False
        try:
            for t in self.turns:
                onload |= bool(t.acquire(seat, None if deadline is None else max(deadline - self._clock.now(), 0.0)))
                taken.append(t)
        except BaseException:
            failed = _release_each(reversed(taken), seat)
            if failed is not None:
                log.warning("seat %r: giving back the turns it took after its acquire failed: %s", seat, failed)
            raise
        return onload

    def release(self, seat: str) -> None:
        """Give back every arbiter's turn; one that fails (its `Turns` actor gone) stops none
        of the others, and its error is raised once all were tried."""
        failed = _release_each(reversed(self.turns), seat)
        if failed is not None:
            raise failed

    def wanted(self, seat: str) -> bool:
        return any(t.wanted(seat) for t in self.turns)

    def wait_park(self, seat: str, timeout: float) -> bool:
        """True once any of `parks_on` asks `seat` to park (each waited on by a thread of a small pool)."""
        if len(self.parks_on) == 1:
            return self.parks_on[0].wait_park(seat, timeout)
        if self._pool is None:
            self._pool = self._clock.executor(len(self.parks_on), name=f"park-wait-{seat}")
        for i, t in enumerate(self.parks_on):
            if i not in self._waits:
                self._waits[i] = self._pool.submit(t.wait_park, seat, timeout)
        done, _ = self._clock.wait_futures(self._waits.values(), timeout=timeout)
        asked = False
        for i, future in list(self._waits.items()):
            if future in done:
                del self._waits[i]
                asked |= bool(future.result())
        return asked

    def begin_park(self, seat: str) -> bool:
        return any(t.begin_park(seat) for t in self.parks_on)

    def park_failed(self, seat: str, error: str) -> None:
        for t in self.parks_on:
            t.park_failed(seat, error)

    def parked(self, seat: str) -> None:
        for t in self.parks_on:
            t.parked(seat)

    def leave(self, seat: str) -> None:
        for t in self.parks_on:
            t.leave(seat)  # wakes the pool's waits too
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def state(self) -> dict[str, Any]:
        """`handoffs`: summed over the arbiters of this seat's state; `arbiters`: each one's state."""
        states = [t.state() for t in self.parks_on]
        return {"handoffs": sum(s["handoffs"] for s in states), "arbiters": states}


def _release_each(turns: Iterable[Any], seat: str) -> BaseException | None:
    """Release `seat`'s turn at each of `turns`, going on past failures; the first failure, or None."""
    first: BaseException | None = None
    for t in turns:
        try:
            t.release(seat)
        except Exception as e:  # noqa: BLE001 - raised by the caller, once every turn was tried
            first = first or e
    return first


class Seat:
    """One role instance's place at a `Turns`: `park()` moves its state to host memory, `unpark()` back.

    `turns` is a `Turns` or anything with its methods (the Ray runtime passes a proxy to
    a `Turns` actor). A daemon thread parks this seat's state when another seat asks.
    A park that raises may have moved part of the state, so the seat's next computation
    calls `unpark` first as after any park: `unpark` brings back whatever the last `park`
    moved (nothing, where it moved nothing), and one that raises is called again next time.
    Until an `unpark` succeeds after such a failure, park requests fail the seat that waits,
    naming it: what is on the devices then is not known.
    """

    def __init__(self, turns: Any, name: str, *, park: Callable[[], None], unpark: Callable[[], None], clock: Clock = REAL) -> None:
        self.turns, self.name = turns, name
        self._park, self._unpark = park, unpark
        self._lock = ClockMutex(clock)  # held while computing and while parking: never both at once
        self._parked = False  # this seat's state may be (partly) off the devices: unpark before computing
        self._move_error: str | None = None  # why the last park or unpark failed; park requests fail with it until an unpark succeeds
        self._owner: int | None = None  # the thread computing in this seat's turn
        self._closed = clock.event()
        self.num_parks = 0
        turns.join(name)
        self._thread = clock.thread(self._parking_loop, name=f"park-{name}", daemon=True)
        self._thread.start()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Take a turn; inside one this thread holds already, go on in it (a train step and
        the weight pass after it, see `SharedTrainEngine.turn_for_step`)."""
        if self._owner == threading.get_ident():
            yield
            return
        # Wait for the turn holding no lock of ours: meanwhile our parking thread may
        # have to park our state for the seat ahead of us.
        self.turns.acquire(self.name)
        try:
            with self.held():
                self._owner = threading.get_ident()
                try:
                    yield
                finally:
                    self._owner = None
        finally:
            self.turns.release(self.name)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Compute in a turn taken under this seat's name: by `turn()`, or by another
        process (rank 0 of a multi-rank trainer takes every rank's turn, `TurnsSpan`, before
        it sends the command they all run). Onloads this seat's state if it was parked;
        parks wait until the end (a guest whose turn comes after rank 0 released asks this
        seat to park, and that park waits for this computation)."""
        with self._lock:  # a park still running finishes first
            if self._parked:  # our own record, not the arbiter's: it saw the request, we did the work
                try:
                    self._unpark()
                except Exception as e:
                    self._move_error = f"its last onload failed: {type(e).__name__}: {e}"
                    raise
                self._parked = False
                self._move_error = None
            yield

    def wanted(self) -> bool:
        """Another seat waits for the devices: stop at the next safe point."""
        return self.turns.wanted(self.name)

    def close(self) -> None:
        self._closed.set()
        self.turns.leave(self.name)
        self._thread.join(timeout=PARK_POLL_S + 1)

    def _parking_loop(self) -> None:
        while not self._closed.is_set():
            if not self.turns.wait_park(self.name, PARK_POLL_S):
                continue
            with self._lock:
                if not self.turns.begin_park(self.name):
                    continue  # our turn came first (the seat that asked gave up waiting)
                error = self._move_error or self._park_once()
                if error is None:
                    self.turns.parked(self.name)
                else:  # reported to the seat that waits (else it waited for ever)
                    self.turns.park_failed(self.name, error)

    def _park_once(self) -> str | None:
        """Park unless parked already (the lock held); why it failed, or None."""
        if self._parked:
            return None
        try:
            self._park()
        except Exception as e:  # reported to the seat that waits
            log.exception("seat %r could not park its state", self.name)
            self._parked = True  # it may have moved part of it: the next computation unparks first
            self._move_error = f"{type(e).__name__}: {e}"
            return self._move_error
        self._parked = True
        self.num_parks += 1
        return None


class Offloader:
    """`park`/`unpark` for a module (and optimizer) through the hal platform's `offload`.

    `moved` runs after each park and unpark: what an engine with sharded parameters needs
    (the fsdp engine's `after_offload_move` points FSDP at the moved shards). Such an
    engine lets go of the old shards only in `moved`, after the platform's `offload` emptied
    its cache, so a park empties it again: else that device memory stays cached in this
    process, out of reach of a seat in another one.
    """

    def __init__(self, platform: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, moved: Callable[[], None] | None = None) -> None:
        self.platform, self.module, self.optimizer = platform, module, optimizer
        self._moved = moved
        self._handle: Any = None
        self.num_bytes = 0
        """Bytes the last park moved to host memory (0 where the device is the host's memory)."""

    def park(self) -> None:
        """Move the state to host memory. The platform's `offload` raises with nothing moved;
        once it has moved everything, a failing `moved` leaves the state parked, for `unpark`
        to bring back (the seat unparks after a park that raised: `Seat`)."""
        assert self._handle is None, "parked twice without an unpark"
        self._handle = self.platform.offload(module=self.module, optimizer=self.optimizer)
        self.num_bytes = self._handle.num_bytes
        if self._moved is not None:
            self._moved()
            self.platform.empty_cache()

    def unpark(self) -> None:
        """Bring back what the last park moved (nothing, after one that raised before moving).
        One that raises can be called again: the handle stays until its onload succeeded,
        and `moved` only points the engine at the tensors where they are."""
        if self._handle is not None:
            self._handle.onload()
            self._handle = None
        if self._moved is not None:
            self._moved()


class SharedTrainEngine:
    """A train engine whose computing calls each take a turn on the shared devices."""

    def __init__(self, engine: Any, seat: Seat) -> None:
        self.engine, self.seat = engine, seat

    def __getattr__(self, name: str) -> Any:  # version, state_dict, ...: the engine's own
        return getattr(self.engine, name)

    @property
    def model(self) -> torch.nn.Module | None:
        """The engine's (`HoldsModel`: declared, so `isinstance` sees it on any Python); None
        for an engine without one (it parks itself: `ParksItself`)."""
        return self.engine.model if isinstance(self.engine, HoldsModel) else None

    @property
    def _collective_engine(self) -> bool:
        """Its engine's weight passes and state are collectives (`Collective`)."""
        return isinstance(self.engine, Collective) and self.engine.collective

    def turn_for_step(self) -> AbstractContextManager[None]:
        """What a workflow holds from a train step through the weight pass after it. A
        multi-rank engine's pass takes a turn of its own (see `named_weights`): holding one
        turn for both hands the devices over once a step instead of twice (a waiting guest
        would otherwise compute in between). A one-process engine's pass takes none: nothing to hold."""
        return self.seat.turn() if self._collective_engine else nullcontext()

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        with self.seat.turn():
            return self.engine.logprobs(batch)

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        with self.seat.turn():
            return self.engine.train_step(batch, advantages, loss=loss, proximal_logprobs=proximal_logprobs)

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        with self.seat.turn():
            return self.engine.sft_step(batch)

    def named_weights(self) -> Any:
        """The engine's `WeightSource`. A one-process engine's pass takes no turn: parking
        swaps each parameter's storage for an equal copy, so what is read is this version's
        weights wherever they sit (device, or host once parked). A multi-rank engine's pass
        (`engine.collective`) gathers shards with its other ranks, which take a turn for it
        (`follow()`): its shards must be on the devices too, so each pass runs in a turn."""
        source = self.engine.named_weights()
        if not self._collective_engine:
            return source
        return LazyWeights(source.specs, lambda: self._pass_in_turn(source.tensors()))

    def _pass_in_turn(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        with self.seat.turn():
            yield from tensors  # closing this pass early closes the engine's (finishing its collective)

    # A multi-rank engine's full state is gathered (or scattered) by all ranks too (see `named_weights`).
    def state_dict(self) -> dict[str, Any]:
        return self._collective(self.engine.state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Always in a turn: loaded into a parked engine, the optimizer's new state tensors
        would be replaced by the parked copies at the next onload."""
        with self.seat.turn():
            self.engine.load_state_dict(state)

    def _collective(self, call: Callable[..., Any], *args: Any) -> Any:
        if not self._collective_engine:
            return call(*args)
        with self.seat.turn():
            return call(*args)


class SharedRolloutEngine:
    """A rollout engine that generates and loads weights in turns, pausing when another seat waits."""

    def __init__(self, engine: Any, seat: Seat) -> None:
        self.engine, self.seat = engine, seat
        self.reclaimed = False
        """The last `generate` paused because another seat wanted the devices (not for `should_pause`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    # declared, so `isinstance` sees them on any Python (`HoldsModel`, `Pads`)
    @property
    def model(self) -> torch.nn.Module | None:
        return self.engine.model if isinstance(self.engine, HoldsModel) else None  # None: it parks itself (vLLM)

    @property
    def pad_id(self) -> int:
        return self.engine.pad_id

    def generate(
        self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None, refill: Refill | None = None
    ) -> list[Trajectory]:
        self.reclaimed = False

        def pause() -> bool:
            if should_pause is not None and should_pause():
                return True
            self.reclaimed = self.seat.wanted()
            return self.reclaimed

        with self.seat.turn():
            return self.engine.generate(trajectories, max_new_tokens=max_new_tokens, should_pause=pause, refill=refill)

    def wait_turn(self) -> None:
        """Block until this seat's next turn (the devices are back), and give it up again."""
        with self.seat.turn():
            pass

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self.seat.turn():
            self.engine.load_weights(version, named_tensors)
