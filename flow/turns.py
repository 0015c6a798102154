"""The arbiters of devices that roles take turns on (`flow.timeshare`): `Turns` for one set
of shared devices, `TurnsSpan` for a seat whose work needs the devices of several.

`Turns` has plain blocking methods, so the same class serves threads of one process
(`runtime: local`) and, as a threaded Ray actor, several processes (`runtime: ray`;
`flow.colocate.TurnsProxy`). Every wait goes through a `clock` (`flow.clock`), so `tidal
simulate` runs them on its virtual clock.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from tidal.flow.clock import REAL, Clock

log = logging.getLogger(__name__)


class Turns:
    """Who computes on one set of shared devices now, and whose state is on them."""

    def __init__(self, *, clock: Clock = REAL) -> None:
        self._clock = clock
        self._cond = clock.condition()
        self._queue: collections.deque[tuple[str, int, bool, int]] = collections.deque()  # (seat, its join count, holding, ticket) per waiting acquire
        self._announced: dict[str, int] = {}  # seat -> ticket: seats that will ask once they hold the turns before this one (`announce`)
        self._tickets = itertools.count()  # arrival order of claims and announcements
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

    def acquire(self, seat: str, timeout: float | None = None, *, holding: bool = False) -> bool:
        """Wait for `seat`'s turn; True when its state must be onloaded (it was parked).

        Claims are served in arrival order, but for one thing: a claim of a seat that holds
        no other turn (`holding` False) waits behind the claims of seats that do (a
        `TurnsSpan` past its first turn), and behind the seats that `announce`d this turn
        before it came. Those may hold turns that someone ahead of them waits for; a seat
        that holds none is in nobody's way, so letting them go first makes no cycle, and a
        spanning seat is not kept waiting turn by turn while guests without its other turns
        take this one. An announcement made after a claim does not pass it (no starving)."""
        deadline = None if timeout is None else self._clock.now() + timeout
        with self._cond:
            if self._holder == seat:
                raise RuntimeError(f"seat {seat!r} asked for a turn while holding one (turns do not nest)")
            claim = (seat, self._joins[seat], holding, next(self._tickets))
            self._announced.pop(seat, None)  # it asks now
            self._queue.append(claim)
            try:
                while True:
                    if self._joins[seat] != claim[1]:  # under Ray: a call whose caller died and was restarted
                        raise RuntimeError(f"seat {seat!r} joined again while this acquire waited (its process was restarted); dropped")
                    if self._holder is None and self._next() == claim:
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
                            f"state of {self._resident!r} on the devices, queue {[c[0] for c in self._queue]}"
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
            self._park_for_announced()
            self._cond.notify_all()

    def _next(self) -> tuple[str, int, bool, int] | None:
        """The claim served next (the lock held): the first of a seat holding other turns,
        else the first, unless a seat announced this turn before it came."""
        for claim in self._queue:
            if claim[2]:
                return claim
        if not self._queue or min(self._announced.values(), default=math.inf) < self._queue[0][3]:  # a queued seat's announcement is gone
            return None
        return self._queue[0]

    def wanted(self, seat: str) -> bool:
        """True when another seat is waiting for the devices, or has announced that it will."""
        with self._cond:
            return any(claim[0] != seat for claim in self._queue) or any(other != seat for other in self._announced)

    def announce(self, seat: str) -> None:
        """`seat` will ask for this turn once it holds the turns before it (`TurnsSpan`):
        meanwhile the seat computing here is `wanted` (a rollout engine pauses at its next
        step), claims of seats holding no turn wait behind it (see `acquire`), and the seat
        whose state is on these devices is asked to park now, or as soon as it releases the
        turn it holds (`release`). So a trainer's rank 0 walking its ranks' turns in order
        finds each rank's guest parked or parking: the guests park side by side, not one after
        the other (on 128 ranks, 128 parks a step in a row)."""
        with self._cond:
            self._announced.setdefault(seat, next(self._tickets))
            self._park_for_announced()

    def _park_for_announced(self) -> None:
        """Ask the idle resident seat to park for an announced one (the lock held)."""
        resident = self._resident
        if self._holder is None and resident is not None and resident not in self._park_errors and any(s != resident for s in self._announced):
            self._park_wanted.add(resident)
            self._cond.notify_all()

    def retract(self, seat: str) -> None:
        """Drop `seat`'s announcement: its acquire failed before it asked here. A park it asked
        for that has not begun is withdrawn when no other seat waits or announced."""
        with self._cond:
            self._announced.pop(seat, None)
            if not self._queue and not self._announced:
                self._park_wanted.clear()
            self._cond.notify_all()

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
        self._announced.pop(seat, None)
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
            return {"holder": self._holder, "resident": self._resident, "queue": [c[0] for c in self._queue], "announced": sorted(self._announced), "handoffs": self.handoffs}


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
    Before it waits for the first, it announces itself at the others (`Turns.announce`): a
    guest computing at a later turn pauses at its next step rather than when its call ends,
    and a guest holding no turn does not start one there while this seat waits its way
    through the turns before (the trainer would wait for that whole call too).
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
            for t in self.turns[1:]:
                t.announce(seat)
            for k, t in enumerate(self.turns):
                onload |= bool(t.acquire(seat, None if deadline is None else max(deadline - self._clock.now(), 0.0), holding=k > 0))
                taken.append(t)
        except BaseException:
            for t in self.turns[len(taken) :]:
                try:
                    t.retract(seat)
                except Exception:  # noqa: BLE001 - its `Turns` actor is gone: nothing is announced there any more
                    pass
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
