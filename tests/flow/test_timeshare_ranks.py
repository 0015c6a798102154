"""A multi-rank trainer's turns: rank 0 takes every rank's turn under the seat name the other
ranks' seats use (`TurnsSpan`), and each other rank seats every engine it builds (`follow()`)."""

from __future__ import annotations

import threading

import pytest

from tidal.flow.timeshare import Seat
from tidal.flow.turns import Turns, TurnsSpan


class Recorder:
    """park/unpark callbacks that count what happened."""

    def __init__(self) -> None:
        self.parks = self.unparks = 0
        self.parked = False

    def park(self) -> None:
        self.parks += 1
        self.parked = True

    def unpark(self) -> None:
        self.unparks += 1
        self.parked = False


def seated(turns, name: str) -> tuple[Seat, Recorder]:
    rec = Recorder()
    return Seat(turns, name, park=rec.park, unpark=rec.unpark), rec


def test_a_followers_seat_joining_while_rank_0_holds_its_turn_keeps_that_turn():
    """Rank 0 may take rank 1's turn (its first weight pass, say) before rank 1 has built its
    engine and seated it. That seat's `join` took the turn back from rank 0: rank 1's guest
    computed on rank 1's devices inside rank 0's command, and rank 0's release failed."""
    arbiters = [Turns(), Turns()]
    rank0, _ = seated(TurnsSpan(arbiters, parks_on=arbiters[:1]), "train")
    guest1, guest_rec = seated(arbiters[1], "rollout-1")
    follower = None
    try:
        with rank0.turn():
            follower, follower_rec = seated(arbiters[1], "train")  # rank 1's seat, built late
            assert arbiters[1].state()["holder"] == "train"
            with pytest.raises(TimeoutError, match="held by 'train'"):
                arbiters[1].acquire("rollout-1", timeout=0.05)
            with follower.held():  # rank 1 computes in the turn rank 0 took for it
                pass
        with guest1.turn():  # rank 0 gave rank 1's turn back: the guest has it, rank 1's shards parked
            assert follower_rec.parked
        assert arbiters[1].state()["holder"] is None
    finally:
        for s in (rank0, guest1, follower):
            if s is not None:
                s.close()


def test_a_followers_seat_joining_while_rank_0_waits_for_its_turn_does_not_fail_that_wait(wait_for):
    """Rank 0 waiting for rank 1's turn (a guest holds it) when rank 1's seat joins: the wait
    was failed as the call of a dead, restarted process ("joined again")."""
    arbiters = [Turns(), Turns()]
    rank0, _ = seated(TurnsSpan(arbiters, parks_on=arbiters[:1]), "train")
    guest1, guest_rec = seated(arbiters[1], "rollout-1")
    follower = None
    outcome: dict[str, object] = {}
    go = threading.Event()

    def lead() -> None:
        try:
            with rank0.turn():
                outcome["turn"] = True
        except Exception as e:  # the test looks at it
            outcome["error"] = e
        go.set()

    try:
        with guest1.turn():
            thread = threading.Thread(target=lead, daemon=True)
            thread.start()
            wait_for(lambda: arbiters[1].state()["queue"] == ["train"])  # rank 0 holds arbiter 0 and waits for arbiter 1
            follower, _ = seated(arbiters[1], "train")
        assert go.wait(10), arbiters[1].state()
        assert outcome == {"turn": True} and guest_rec.parks == 1
        assert [a.state()["holder"] for a in arbiters] == [None, None]
    finally:
        for s in (rank0, guest1, follower):
            if s is not None:
                s.close()


def test_a_restarted_process_joining_again_still_drops_its_old_claims():
    """What `join` dropping claims is for: a rollout actor killed in its turn, restarted
    under the same seat name, must not wait for (or hold) its dead incarnation's turn."""
    turns = Turns()
    turns.join("rollout")
    turns.acquire("rollout")  # ... and its process dies here
    turns.join("rollout")  # the restarted actor, no `leave` in between
    assert turns.state()["holder"] is None and turns.state()["resident"] is None
    assert turns.acquire("train", timeout=1) is True


def test_a_seat_closed_and_seated_again_for_the_next_engine_starts_clean():
    """A follower closes its warm-start engine's seat and seats the RL engine under the same
    name: the new seat joins with nothing of the old one left (its `leave` dropped it)."""
    turns = Turns()
    old, _ = seated(turns, "train")
    with old.turn():
        pass
    old.close()
    new, rec = seated(turns, "train")
    try:
        assert turns.state() == {"holder": None, "resident": None, "queue": [], "announced": [], "handoffs": 1}
        with new.turn():
            assert rec.unparks == 0
    finally:
        new.close()


class DeadArbiter(Turns):
    """An arbiter whose calls fail, as a proxy to a `Turns` actor that died does."""

    def __init__(self, fail: str) -> None:
        super().__init__()
        self.fail = fail

    def release(self, seat: str) -> None:
        if self.fail == "release":
            raise ConnectionError("release: the Turns actor died")
        super().release(seat)

    def acquire(self, seat: str, timeout: float | None = None, *, holding: bool = False) -> bool:
        if self.fail == "acquire":
            raise ConnectionError("acquire: the Turns actor died")
        return super().acquire(seat, timeout, holding=holding)


def test_a_span_whose_last_release_fails_still_gives_back_the_other_turns():
    """Released in reverse rank order, a failing release of rank 1's turn (its `Turns` actor
    gone, or its turn dropped by that rank's seat leaving) kept rank 0's turn held: rank 0's
    own guest waited for ever."""
    arbiters = [Turns(), DeadArbiter("release")]
    rank0, rank0_rec = seated(TurnsSpan(arbiters, parks_on=arbiters[:1]), "train")
    guest0, _ = seated(arbiters[0], "rollout-0")
    try:
        with pytest.raises(ConnectionError, match="release: the Turns actor died"), rank0.turn():
            pass
        assert arbiters[0].state()["holder"] is None
        assert arbiters[0].acquire("rollout-0", timeout=10) is True  # rank 0's state parked for it
        assert rank0_rec.parked
        arbiters[0].release("rollout-0")
    finally:
        rank0.close(), guest0.close()


def test_a_span_whose_acquire_fails_gives_back_the_turns_it_took_even_when_one_release_fails():
    arbiters = [Turns(), DeadArbiter("release"), DeadArbiter("acquire")]
    span = TurnsSpan(arbiters, parks_on=arbiters[:1])
    span.join("train")
    with pytest.raises(ConnectionError, match="acquire: the Turns actor died"):  # the acquire's error, not the rollback's
        span.acquire("train")
    assert arbiters[0].state()["holder"] is None


def test_announced_seats_go_before_later_claims_of_seats_that_hold_no_turn():
    """`Turns.announce`: the seat computing is wanted at once; a claim of a seat holding no
    other turn that came after the announcement waits for the announcer, one that came
    before does not (no starving); a claim of a seat holding other turns is never held back."""
    turns = Turns()
    for seat in ("guest", "late", "early", "span", "other"):
        turns.join(seat)
    assert turns.acquire("guest") is True
    assert not turns.wanted("guest")
    turns.announce("span")
    assert turns.wanted("guest") and not turns.wanted("span")  # its own announcement does not want it
    assert turns.state()["announced"] == ["span"]
    turns.release("guest")
    turns.parked("guest")  # as its seat's parking thread would, asked to
    with pytest.raises(TimeoutError, match="queue \\['late'\\]"):
        turns.acquire("late", timeout=0.05)  # came after the announcement: waits for "span"
    assert turns.acquire("span", timeout=1, holding=True) is True  # the announcer asks, holding other turns: served
    assert turns.state()["announced"] == []
    turns.release("span")
    turns.parked("span")

    results: list[str] = []
    early = threading.Thread(target=lambda: (turns.acquire("early", timeout=5), results.append("early")))
    turns.acquire("other")  # busy, so that "early" queues
    early.start()
    _wait_until(lambda: turns.state()["queue"] == ["early"])
    turns.announce("span")  # after "early" queued: does not pass it
    turns.release("other")
    turns.parked("other")
    early.join(timeout=5)
    assert results == ["early"] and turns.state()["holder"] == "early"
    turns.release("early")
    turns.parked("early")
    turns.retract("span")  # its acquire failed elsewhere: "late" is no longer kept waiting
    assert turns.state()["announced"] == [] and not turns.wanted("late")
    turns.acquire("late", timeout=1)
    turns.release("late")


def test_a_span_waiting_for_its_first_turn_is_wanted_at_the_others_and_no_new_guest_takes_them():
    """A trainer rank 0 waits for rank 0's turn (a guest computes there). Meanwhile a guest
    computing at rank 1 hears that it is wanted (it pauses at its next step), and a guest
    that asks for rank 1's turn after the span started does not get it before the span:
    otherwise the span, once it has rank 0's turn, would wait for that guest's whole call."""
    arbiters = [Turns(), Turns()]
    span = TurnsSpan(arbiters, parks_on=arbiters[:1])
    span.join("train")
    for k, t in enumerate(arbiters):
        t.join(f"rollout-{k}")
        t.join("late")
    arbiters[0].acquire("rollout-0")
    arbiters[1].acquire("rollout-1")
    got: list[bool] = []
    trainer = threading.Thread(target=lambda: got.append(span.acquire("train", timeout=5)))
    trainer.start()
    _wait_until(lambda: arbiters[0].state()["queue"] == ["train"])
    assert arbiters[1].wanted("rollout-1")  # before the span has asked there: it announced itself
    arbiters[1].release("rollout-1")
    arbiters[1].parked("rollout-1")  # as its seat would, asked to
    late = threading.Thread(target=lambda: arbiters[1].acquire("late", timeout=5))
    late.start()
    _wait_until(lambda: arbiters[1].state()["queue"] == ["late"])
    assert arbiters[1].state()["holder"] is None  # free, but kept for the span
    arbiters[0].release("rollout-0")
    arbiters[0].parked("rollout-0")
    trainer.join(timeout=5)
    assert got == [True] and [t.state()["holder"] for t in arbiters] == ["train", "train"]
    span.release("train")
    arbiters[1].parked("train")
    late.join(timeout=5)
    assert arbiters[1].state()["holder"] == "late"


def test_a_span_whose_acquire_fails_leaves_no_announcement():
    arbiters = [Turns(), Turns()]
    span = TurnsSpan(arbiters)
    span.join("train")
    arbiters[0].join("guest")
    arbiters[0].acquire("guest")
    with pytest.raises(TimeoutError):
        span.acquire("train", timeout=0.05)
    assert [t.state()["announced"] for t in arbiters] == [[], []]
    assert not arbiters[0].wanted("guest")


def _wait_until(condition, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_an_announcement_asks_the_resident_guest_to_park_and_a_retraction_withdraws_it():
    turns = Turns()
    turns.join("rollout")
    turns.join("train")
    turns.acquire("rollout")
    turns.release("rollout")  # its state stays on the devices
    assert not turns.wait_park("rollout", 0)
    turns.announce("train")
    assert turns.wait_park("rollout", 0)  # asked at once, not when the span reaches this turn
    turns.retract("train")
    assert not turns.wait_park("rollout", 0)  # nobody waits for the devices any more
    turns.announce("rollout")  # the resident announcing itself asks nobody to park
    assert not turns.wait_park("rollout", 0)
    turns.retract("rollout")
    turns.acquire("rollout")  # computing when the span announces itself: asked once its turn ends
    turns.announce("train")
    assert not turns.wait_park("rollout", 0)
    turns.release("rollout")
    assert turns.wait_park("rollout", 0)
