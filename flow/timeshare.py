"""Roles that take turns on the same devices (the colocated and multiplexed layouts).

When rollout is colocated with training, both engines live on the same devices but only
one may compute at a time, and the one waiting keeps its state in host memory so the
other has the device memory. Three pieces:

- `Turns` (`flow.turns`; `TurnsSpan` for a seat on several sets): the arbiter for one
  set of shared devices. A seat `acquire`s a turn (first come, first served, but for
  spanning seats: see `Turns.acquire`), computes, `release`s it. Which seat's state is
  *resident* on the devices is tracked too: a seat that acquires while another seat's
  state is resident waits until that seat has parked it (and fails, naming it, if that
  park failed).
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

    def logprobs_under_reference(self, batch: TokenBatch) -> torch.Tensor:
        with self.seat.turn():
            return self.engine.logprobs_under_reference(batch)

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


class SharedCritic:
    """A critic (`flow.protocols.Critic`) seated at the trainer's devices: each of its passes
    takes a turn, so its model and optimizer state are parked while the policy's trainer or
    rollout computes there, as theirs are while it does."""

    def __init__(self, critic: Any, seat: Seat) -> None:
        self.critic, self.seat = critic, seat

    def values(self, batch: TokenBatch) -> torch.Tensor:
        with self.seat.turn():
            return self.critic.values(batch)

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        with self.seat.turn():
            return self.critic.train_step(batch, returns, old_values)

    def state_dict(self) -> dict[str, Any]:
        """Host copies, read wherever the state sits (a parked one is on the host already)."""
        with self.seat.turn():
            return self.critic.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """In a turn: loaded into a parked critic, the optimizer's new state would be replaced by the parked copies at the next onload."""
        with self.seat.turn():
            self.critic.load_state_dict(state)


class SharedRewardModel:
    """A reward model seated at the trainer's devices: each scoring takes a turn, its weights
    parked while the trainer or rollout computes there."""

    def __init__(self, model: Any, seat: Seat) -> None:
        self.reward_model, self.seat = model, seat

    def score(self, conversations: Sequence[Any], responses: Sequence[str]) -> list[float]:
        with self.seat.turn():
            return self.reward_model.score(conversations, responses)


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
