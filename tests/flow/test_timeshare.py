"""Turns on shared devices: one seat computes at a time, state parks only on a hand-off."""

from __future__ import annotations

import copy
import queue
import threading
import time

import pytest
import torch

from tidal.flow.timeshare import Offloader, Seat, SharedRolloutEngine, SharedTrainEngine
from tidal.flow.trajectory import Trajectory
from tidal.flow.turns import Turns, TurnsSpan
from tidal.hal import select_platform
from tidal.hal.transfer import LazyWeights, TensorSpec


class Recorder:
    """park/unpark callbacks that log what happened and check no one computes while parked."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.parked = name, log, False

    def park(self) -> None:
        assert not self.parked
        self.parked = True
        self.log.append(f"park {self.name}")

    def unpark(self) -> None:
        assert self.parked
        self.parked = False
        self.log.append(f"unpark {self.name}")


def seat(turns: Turns, name: str, log: list[str]) -> tuple[Seat, Recorder]:
    rec = Recorder(name, log)
    return Seat(turns, name, park=rec.park, unpark=rec.unpark), rec


def test_two_seats_alternate_and_park_only_on_a_hand_off():
    turns, log = Turns(), []
    a, ra = seat(turns, "a", log)
    b, rb = seat(turns, "b", log)
    try:
        for _ in range(2):  # the same seat again: nothing moves
            with a.turn():
                assert not ra.parked
        with b.turn():  # a's state leaves before b computes
            assert ra.parked and not rb.parked
        with a.turn():
            assert rb.parked and not ra.parked
        assert log == ["park a", "park b", "unpark a"]
        assert turns.state() == {"holder": None, "resident": "a", "queue": [], "announced": [], "handoffs": 3}
    finally:
        a.close(), b.close()


def test_concurrent_seats_never_compute_together():
    turns, log = Turns(), []
    seats = [seat(turns, name, log) for name in ("train", "rollout", "borrowed")]
    inside, errors = [], []

    def work(s: Seat, rec: Recorder) -> None:
        try:
            for _ in range(30):
                with s.turn():
                    assert not rec.parked
                    inside.append(s.name)
                    assert len(inside) == 1, inside
                    time.sleep(0.0005)
                    inside.remove(s.name)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=pair) for pair in seats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s, _ in seats:
        s.close()
    assert not errors and not any(t.is_alive() for t in threads)
    parks = sum(entry.startswith("park") for entry in log)
    assert parks >= 2 and parks == sum(s.num_parks for s, _ in seats)
    assert turns.state()["handoffs"] == parks + 1  # every hand-off but the very first parked someone


class RemoteLikeTurns(Turns):
    """A `Turns` whose acquire answers a little late, as a `Turns` actor's does over Ray."""

    def acquire(self, seat: str, timeout: float | None = None, *, holding: bool = False) -> bool:
        onload = super().acquire(seat, timeout, holding=holding)
        time.sleep(0.002)
        return onload


def test_guests_spanning_trainer_ranks_and_the_ranks_collectives_take_turns_without_deadlock():
    """Three trainer ranks, one arbiter each. Rank 0 takes every rank's turn before each
    command, the other ranks compute in the turn taken for them (`held`) and all three
    meet in a barrier (their collective). Guests: one on ranks 1 and 2's devices, one on
    rank 0's and one on rank 2's alone. Were each rank to take its own turn, the spanning
    guest could hold rank 1's turn while waiting for rank 2's, held by rank 2 waiting in
    the collective for rank 1: a deadlock. Whoever computes finds every other state that
    shares its devices parked."""
    arbiters, log = [RemoteLikeTurns(), RemoteLikeTurns(), RemoteLikeTurns()], []
    devices = {"rank0": {0}, "rank1": {1}, "rank2": {2}, "wide": {1, 2}, "guest0": {0}, "guest2": {2}}
    recs = {name: Recorder(name, log) for name in devices}

    def seated(name: str, turns, seat_name: str) -> Seat:
        return Seat(turns, seat_name, park=recs[name].park, unpark=recs[name].unpark)

    seats = {
        "rank0": seated("rank0", TurnsSpan(arbiters, parks_on=arbiters[:1]), "train"),
        "rank1": seated("rank1", arbiters[1], "train"),
        "rank2": seated("rank2", arbiters[2], "train"),
        "wide": seated("wide", TurnsSpan(arbiters[1:]), "wide"),
        "guest0": seated("guest0", arbiters[0], "guest0"),
        "guest2": seated("guest2", arbiters[2], "guest2"),
    }
    computed: set[str] = set()
    lock, errors, collective = threading.Lock(), [], threading.Barrier(3, timeout=20)
    commands = {1: queue.Queue(), 2: queue.Queue()}

    def compute(name: str) -> None:
        with lock:
            for other, used in devices.items():
                if other != name and other in computed and used & devices[name]:
                    assert recs[other].parked, f"{name} computes while {other}'s state is on device(s) {sorted(used & devices[name])}"
            computed.add(name)
        time.sleep(0.0005)

    def run(body) -> None:
        try:
            body()
        except Exception as e:  # reported below
            errors.append(e)
            collective.abort()

    def lead() -> None:
        for step in range(40):
            with seats["rank0"].turn():
                for q in commands.values():
                    q.put(step)
                compute("rank0")
                collective.wait()
        for q in commands.values():
            q.put(None)

    def follower(rank: int) -> None:
        while commands[rank].get() is not None:
            with seats[f"rank{rank}"].held():
                compute(f"rank{rank}")
                collective.wait()

    def guest(name: str) -> None:
        for _ in range(40):
            with seats[name].turn():
                compute(name)

    bodies = [lead, lambda: follower(1), lambda: follower(2), *(lambda n=n: guest(n) for n in ("wide", "guest0", "guest2"))]
    threads = [threading.Thread(target=run, args=(body,)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    hung = [t for t in threads if t.is_alive()]
    for s in seats.values():
        s.close()
    assert not errors and not hung, (errors, [t.state() for t in arbiters])
    assert computed == set(devices)
    assert seats["wide"].num_parks >= 1 and all(seats[f"rank{r}"].num_parks >= 1 for r in range(3))  # the guests did take the trainer's devices
    assert seats["rank0"].num_parks == log.count("park rank0")  # rank 0 parks only for its own arbiter's requests


def test_a_timeout_names_the_holder_and_a_nested_turn_is_refused():
    turns = Turns()
    turns.join("train")
    turns.acquire("train")
    with pytest.raises(TimeoutError, match="held by 'train'"):
        turns.acquire("rollout", timeout=0.05)
    with pytest.raises(RuntimeError, match="do not nest"):
        turns.acquire("train")
    assert turns.state()["queue"] == []


def test_a_rejoining_seat_drops_the_claims_of_its_dead_process():
    turns = Turns()
    turns.join("rollout")
    turns.acquire("rollout")  # ... and its process dies holding the turn
    turns.join("rollout")  # the restarted actor
    assert turns.state()["holder"] is None and turns.state()["resident"] is None
    assert turns.acquire("train", timeout=1) is True


def test_an_acquire_left_waiting_by_a_dead_process_never_takes_the_turn():
    """Under Ray, the `Turns` actor keeps running an `acquire` whose caller died. Once the
    restarted process joins, that call must fail rather than win the turn for nobody."""
    turns = Turns()
    turns.join("train")
    turns.join("rollout")
    turns.acquire("train")
    outcomes: dict[str, object] = {}

    def acquire(name: str) -> None:
        try:
            outcomes[name] = turns.acquire("rollout", timeout=5)
        except Exception as e:  # the test looks at it
            outcomes[name] = e

    old = threading.Thread(target=acquire, args=("old",))
    old.start()
    time.sleep(0.1)  # it waits behind train; then its process dies
    turns.join("rollout")  # the restarted actor
    new = threading.Thread(target=acquire, args=("new",))
    new.start()
    time.sleep(0.1)
    assert turns.state()["queue"] == ["rollout"]  # the new call's claim, once
    turns.release("train")
    turns.parked("train")  # what train's parking thread does when asked
    old.join(5)
    new.join(5)
    assert isinstance(outcomes["old"], RuntimeError) and "joined again" in str(outcomes["old"])
    assert outcomes["new"] is True and turns.state()["holder"] == "rollout"
    turns.release("rollout")
    assert turns.state() == {"holder": None, "resident": "rollout", "queue": [], "announced": [], "handoffs": 2}


class ChunkedEngine:
    """A rollout engine that decodes one token per chunk and honours `should_pause`."""

    version = 0

    def __init__(self) -> None:
        self.chunks = 0
        self.started = threading.Event()

    def generate(self, trajectories, *, max_new_tokens, should_pause=None, refill=None):
        for _ in range(max_new_tokens):
            if all(t.done for t in trajectories):
                break
            if should_pause is not None and should_pause():
                return list(trajectories)
            self.started.set()
            time.sleep(0.005)
            self.chunks += 1
            for t in trajectories:
                t.extend([1], [-0.1], self.version)
                if len(t.tokens) >= max_new_tokens:
                    t.finish_reason = "length"
        return list(trajectories)


def test_rollout_pauses_at_a_chunk_boundary_when_the_trainer_waits():
    turns, log = Turns(), []
    train_seat, _ = seat(turns, "train", log)
    roll_seat, _ = seat(turns, "rollout", log)
    engine = ChunkedEngine()
    rollout = SharedRolloutEngine(engine, roll_seat)
    trajectory = Trajectory(prompt_ids=[1, 2], group=0)
    got = {}

    def trainer() -> None:
        engine.started.wait(5)
        with train_seat.turn():
            got["chunks when trained"] = engine.chunks

    t = threading.Thread(target=trainer)
    t.start()
    try:
        rollout.generate([trajectory], max_new_tokens=10_000)  # returns paused, not done
        t.join(10)
        assert not trajectory.done and 0 < len(trajectory.tokens) < 10_000
        assert got["chunks when trained"] == len(trajectory.tokens)  # no chunk ran during the train turn
        assert log == ["park rollout"]
        rollout.generate([trajectory], max_new_tokens=len(trajectory.tokens) + 3)  # resumes where it paused
        assert trajectory.done and log == ["park rollout", "park train", "unpark rollout"]
    finally:
        train_seat.close(), roll_seat.close()


def test_offloader_moves_a_trainer_to_host_and_back_bit_exactly():
    platform = select_platform("fake:cuda:1").platform
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()] + [v.clone() for s in optimizer.state.values() for v in s.values()]

    class Engine:
        version = 3

        def __init__(self) -> None:
            self.steps = 0

        def train_step(self, batch, advantages, *, loss, proximal_logprobs=None):
            self.steps += 1
            return {"loss": float(model.weight.detach().sum())}

        def named_weights(self):
            yield from model.state_dict().items()

    turns, log = Turns(), []
    offloader = Offloader(platform, model, optimizer)
    train_seat = Seat(turns, "train", park=offloader.park, unpark=offloader.unpark)
    other, _ = seat(turns, "rollout", log)
    engine = SharedTrainEngine(Engine(), train_seat)
    try:
        engine.train_step(None, None, loss=None)
        storages = [p.data.untyped_storage().data_ptr() for p in model.parameters()]
        with other.turn():  # the trainer parks: every tensor now lives in a new host buffer
            assert [p.data.untyped_storage().data_ptr() for p in model.parameters()] != storages
            assert dict(engine.named_weights()).keys() == {"weight", "bias"}  # readable while parked
        engine.train_step(None, None, loss=None)
        after = [p.detach() for p in model.parameters()] + [v for s in optimizer.state.values() for v in s.values()]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        assert engine.version == 3 and engine.steps == 2 and train_seat.num_parks == 1
    finally:
        train_seat.close(), other.close()


def test_a_park_whose_hook_lets_go_of_the_old_tensors_empties_the_cache_after_it():
    """FSDP2 keeps its own references to the shards (its flat shard buffers) until
    `after_offload_move` points them at the moved ones, so the `empty_cache` in an
    accelerator's `offload` could return none of the parameters' device memory: it stayed
    in the trainer process's caching allocator, out of reach of a guest in another process."""
    fake = select_platform("fake:cuda:1").platform
    model = torch.nn.Linear(8, 4)
    old = {p.data.untyped_storage().data_ptr() for p in model.parameters()}
    shards = [p.data for p in model.parameters()]  # what FSDP2 holds, until `moved`
    cache_calls: list[int] = []  # per empty_cache: old storages still referenced by `shards`

    class Accelerator:
        """The fake platform's offload (a real copy), then `empty_cache` as on an accelerator."""

        def offload(self, **kwargs):
            handle = fake.offload(**kwargs)
            self.empty_cache()
            return handle

        def empty_cache(self) -> None:
            cache_calls.append(sum(t.untyped_storage().data_ptr() in old for t in shards))

    def moved() -> None:
        shards[:] = [p.data for p in model.parameters()]

    offloader = Offloader(Accelerator(), model, moved=moved)
    offloader.park()
    assert cache_calls and cache_calls[-1] == 0  # the last one came once nothing held the device memory


def test_a_park_that_fails_fails_the_seat_waiting_for_the_devices_instead_of_hanging_it():
    """A park that raised (host memory for the parked copy ran out, say) ended the seat's
    parking thread, and the seat waiting for its state to leave the devices waited for ever."""
    turns, failing = Turns(), [True]

    def park() -> None:
        if failing[0]:
            raise RuntimeError("no pinned host memory left")

    train = Seat(turns, "train", park=park, unpark=lambda: None)
    guest = Seat(turns, "rollout", park=lambda: None, unpark=lambda: None)
    try:
        with train.turn():  # the trainer's state is on the devices
            pass
        with pytest.raises(RuntimeError, match=r"'train' failed to move its state off the devices \(RuntimeError: no pinned host memory left\)"):
            turns.acquire("rollout", timeout=30)
        assert turns.state()["queue"] == [] and train._thread.is_alive()
        failing[0] = False
        with train.turn():  # it computes again: a later park is tried again
            pass
        with guest.turn():
            assert train.num_parks == 1
    finally:
        train.close(), guest.close()


def test_a_state_loaded_while_the_trainer_is_parked_is_the_state_it_computes_with():
    """`load_state_dict` of a one-process engine took no turn: loaded into a parked engine,
    the optimizer's new state was replaced by the parked copy at the next onload."""
    platform = select_platform("fake:cuda:1").platform

    class Engine:
        def __init__(self, seed: int) -> None:
            torch.manual_seed(seed)
            self.model = torch.nn.Linear(4, 2)
            self.optimizer = torch.optim.AdamW(self.model.parameters())
            self.model(torch.randn(3, 4)).sum().backward()
            self.optimizer.step()

        def state_dict(self) -> dict:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

        def load_state_dict(self, state: dict) -> None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])

    engine, saved = Engine(0), copy.deepcopy(Engine(1).state_dict())
    turns = Turns()
    offloader = Offloader(platform, engine.model, engine.optimizer)
    trainer = SharedTrainEngine(engine, Seat(turns, "train", park=offloader.park, unpark=offloader.unpark))
    guest, _ = seat(turns, "guest", [])
    try:
        with trainer.seat.turn():
            pass
        with guest.turn():  # the trainer parks, and stays parked until its next turn
            pass
        assert offloader._handle is not None
        trainer.load_state_dict(saved)
        with trainer.seat.turn():
            state = engine.state_dict()
        moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in state["optimizer"]["state"].values()]
        want = [(s["exp_avg"], s["exp_avg_sq"]) for s in saved["optimizer"]["state"].values()]
        assert all(torch.equal(x, y) for pair, wanted in zip(moments, want, strict=True) for x, y in zip(pair, wanted))
        assert all(torch.equal(state["model"][k], saved["model"][k]) for k in saved["model"])
    finally:
        trainer.seat.close(), guest.close()


def test_a_seat_that_left_does_not_hold_up_the_next_turn():
    turns = Turns()
    turns.join("rollout")
    turns.acquire("rollout")
    turns.release("rollout")  # its state stays on the devices ...
    turns.leave("rollout")  # ... until it leaves (its process was killed): nobody waits for it to park
    assert turns.state()["resident"] is None
    assert turns.acquire("train", timeout=1) is True and turns.state()["resident"] == "train"


def test_a_seat_killed_inside_its_turn_gives_the_turn_up_when_it_leaves():
    """Under Ray a rollout actor killed in its turn never releases it; when no restart is
    left nobody joins again, and the trainer's next turn waited for ever."""
    turns = Turns()
    turns.join("train")
    turns.join("rollout")
    turns.acquire("rollout")  # ... and its process is killed here
    turns.leave("rollout")  # the runtime: that seat is gone
    assert turns.state() == {"holder": None, "resident": None, "queue": [], "announced": [], "handoffs": 1}
    assert turns.acquire("train", timeout=1) is True


class PassEngine:
    """A train engine whose weight passes and state are collectives (`collective`) or not."""

    def __init__(self, collective: bool) -> None:
        self.collective = collective
        self.passes_closed = 0

    def named_weights(self) -> LazyWeights:
        return LazyWeights(lambda: [TensorSpec("w", "float32", (2,))], self._pass)

    def _pass(self):
        try:
            yield "w", torch.zeros(2)
            yield "b", torch.zeros(2)
        finally:
            self.passes_closed += 1

    def state_dict(self) -> dict:
        return {"version": 1}


@pytest.mark.parametrize("collective", [True, False])
def test_a_multi_rank_engines_weight_pass_and_state_take_a_turn(collective):
    """Its other ranks gather their shards in a turn (`follow()`), so rank 0 must have its
    shards on the devices too; a one-process engine reads parked copies without a turn."""
    turns, log = Turns(), []
    guest, _ = seat(turns, "guest", log)
    train_seat, _ = seat(turns, "train", log)
    engine = SharedTrainEngine(PassEngine(collective), train_seat)
    done = threading.Event()

    def export() -> None:
        source = engine.named_weights()
        stopped = iter(source)
        assert next(stopped)[0] == "w"
        stopped.close()  # a pass stopped early ends its turn (and the engine's pass)
        assert [name for name, _ in source] == ["w", "b"]
        assert engine.state_dict() == {"version": 1}
        done.set()

    with guest.turn():  # the guest holds the devices
        assert engine.named_weights().specs()[0].name == "w"  # specs need no turn
        thread = threading.Thread(target=export, daemon=True)
        thread.start()
        assert done.wait(0.3) is not collective  # a collective pass waits for the guest's turn to end
    assert done.wait(10)
    thread.join(10)
    with guest.turn():  # every turn the passes took was given back
        pass
    assert engine.engine.passes_closed == 2


@pytest.mark.parametrize("collective", [True, False])
def test_a_train_step_and_its_weight_pass_hand_the_devices_over_once(collective, wait_for):
    """`turn_for_step` holds a multi-rank engine's turn from the step through the pass, so a
    guest waiting meanwhile gets the devices once, after both; nested turns of the same
    thread go on in the held one. A one-process engine's pass needs no turn: nothing held."""
    turns, log = Turns(), []
    guest, _ = seat(turns, "guest", log)
    train_seat, _ = seat(turns, "train", log)
    engine = SharedTrainEngine(PassEngine(collective), train_seat)
    order: list[str] = []
    waiting = threading.Event()

    def guest_turn() -> None:
        waiting.set()
        with guest.turn():
            order.append("guest")

    try:
        with engine.turn_for_step():
            with engine.seat.turn():  # the step's own turn, nested: no second acquire
                order.append("step")
            thread = threading.Thread(target=guest_turn, daemon=True)
            thread.start()
            waiting.wait(5)
            wait_for(lambda: turns.state()["queue"] == ["guest"] or not collective)
            assert [name for name, _ in engine.named_weights()] == ["w", "b"]
            order.append("pass")
        thread.join(10)
        if collective:
            assert order == ["step", "pass", "guest"]  # the guest waited for both
            assert turns.state()["handoffs"] == 2  # to the trainer, then to the guest: once each way
        else:
            assert order[0] == "step" and sorted(order) == ["guest", "pass", "step"]
    finally:
        guest.close(), train_seat.close()

