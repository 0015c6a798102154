"""`Turns` and `Seat` on a virtual clock (what `tidal simulate` needs to run colocated layouts):
turns, parks and onloads happen in simulated time, in a timeline fixed by the code alone."""

from __future__ import annotations

import threading

import pytest

from tidal.flow.timeshare import Seat
from tidal.flow.turns import Turns
from tidal.flow.virtual_clock import VirtualClock


def _run(clock: VirtualClock, main):
    """`clock.run(main)`, failing (not hanging) if simulated time stops: a thread blocked on a
    real lock held across a simulated wait would stop it for good."""
    out: list = []
    runner = threading.Thread(target=lambda: out.append(clock.run(main)), daemon=True)
    runner.start()
    runner.join(timeout=60)
    if runner.is_alive():
        pytest.fail(f"the simulation stopped at t={clock.now()}: a thread blocks outside the clock")
    return out[0]


def test_two_seats_take_turns_and_park_in_virtual_time():
    clock = VirtualClock()
    log: list[tuple[float, str]] = []

    def costs(what: str, seconds: float):
        def move() -> None:
            clock.sleep(seconds)  # a park or an onload takes time: the seat's lock is held meanwhile
            log.append((clock.now(), what))

        return move

    def role(seat: Seat, work_s: float, rounds: int) -> None:
        for _ in range(rounds):
            with seat.turn():
                clock.sleep(work_s)
                log.append((clock.now(), f"{seat.name} computed"))

    def main() -> int:
        turns = Turns(clock=clock)
        rollout = Seat(turns, "rollout", park=costs("rollout parked", 1.0), unpark=costs("rollout onloaded", 1.0), clock=clock)
        train = Seat(turns, "train", park=costs("train parked", 2.0), unpark=costs("train onloaded", 2.0), clock=clock)
        threads = [clock.thread(role, name="rollout", args=(rollout, 3.0, 2)), clock.thread(role, name="train", args=(train, 5.0, 2))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rollout.close()
        train.close()
        return turns.handoffs

    handoffs = _run(clock, main)
    assert log == [
        (3.0, "rollout computed"),
        (4.0, "rollout parked"),  # train waits for rollout's state to leave, not only for its turn
        (9.0, "train computed"),
        (11.0, "train parked"),
        (12.0, "rollout onloaded"),
        (15.0, "rollout computed"),
        (16.0, "rollout parked"),
        (18.0, "train onloaded"),
        (23.0, "train computed"),
    ]
    assert handoffs == 4 and clock.now() == 23.0


def test_a_turn_that_comes_while_its_seat_parks_waits_for_the_park_in_virtual_time():
    """The seat that asked for the devices gives up while the holder's state is being parked;
    the holder's next turn comes at once and its computation waits for its own park to end
    (the seat's lock, held across the park), then onloads: on a virtual clock that lock must
    be the clock's, or the waiting thread would stop simulated time."""
    clock = VirtualClock()
    log: list[tuple[float, str]] = []

    def costs(what: str, seconds: float):
        def move() -> None:
            clock.sleep(seconds)
            log.append((clock.now(), what))

        return move

    def main() -> None:
        turns = Turns(clock=clock)
        rollout = Seat(turns, "rollout", park=costs("rollout parked", 2.0), unpark=costs("rollout onloaded", 1.0), clock=clock)

        def impatient() -> None:
            try:
                turns.acquire("train", timeout=3.5)
            except TimeoutError:
                log.append((clock.now(), "train gave up"))

        def compute(rounds: int) -> None:
            for _ in range(rounds):
                with rollout.turn():
                    clock.sleep(3.0)
                    log.append((clock.now(), "rollout computed"))

        threads = [clock.thread(compute, name="rollout", args=(2,)), clock.thread(impatient, name="train")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rollout.close()

    _run(clock, main)
    assert log == [(3.0, "rollout computed"), (3.5, "train gave up"), (5.0, "rollout parked"), (6.0, "rollout onloaded"), (9.0, "rollout computed")]


def test_a_span_over_several_ranks_finds_their_guests_parking_side_by_side():
    """Rank 0 of a 4-rank trainer takes the ranks' turns in order; each rank's guest (a rollout
    instance whose state is on that rank's devices) takes 1 s to park. Announced at every turn
    at once, the guests park together: the span has all four turns after 1 s, not 4."""
    from tidal.flow.turns import TurnsSpan

    clock = VirtualClock()
    parked_at: list[float] = []

    def park() -> None:
        clock.sleep(1.0)
        parked_at.append(clock.now())

    def main() -> float:
        arbiters = [Turns(clock=clock) for _ in range(4)]
        guests = [Seat(t, f"rollout-{k}", park=park, unpark=lambda: None, clock=clock) for k, t in enumerate(arbiters)]
        for guest in guests:
            with guest.turn():  # each guest computed once: its state is on its rank's devices
                pass
        span = TurnsSpan(arbiters, clock=clock)
        span.join("train")
        span.acquire("train")
        took = clock.now()
        span.release("train")
        for guest in guests:
            guest.close()
        return took

    assert _run(clock, main) == 1.0
    assert parked_at == [1.0] * 4
