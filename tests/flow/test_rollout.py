"""The rollout stage's rows: trajectories into the `train` partition and back, and paused
groups handed from a reclaimed (borrowed) seat to another worker."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

from tidal.flow.rollout import RESUME_KEY, RolloutWorker, Stop, _Group, group_of, resumable_prompt
from tidal.flow.rows import TRAJECTORY_COLUMNS, put_trajectories, token_batch_of, trajectories_of
from tidal.flow.store import Store, StoreError, StoreTimeout
from tidal.flow.store.codec import decode, encode
from tidal.flow.timeshare import Seat, SharedRolloutEngine
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.flow.turns import Turns


def _trajectory(prompt, tokens, version, *, group, env=()):
    t = Trajectory(prompt_ids=list(prompt), group=group, meta={"answer": str(group)})
    t.extend(tokens[:1], [-0.5] * len(tokens[:1]), version)
    t.append_env(env)
    t.extend(tokens[1:], [-0.25] * len(tokens[1:]), version + 1)
    t.finish_reason = "stop"
    return t


def test_trajectories_round_trip_through_the_store_whatever_the_puts_widths():
    store = Store()
    store.create_partition("train", consumers=["c", "d"])
    first = [_trajectory([1, 5], [7, 8, 2], 3, group="a"), _trajectory([1, 5, 6, 6], [9], 3, group="a", env=[4, 4])]
    second = [_trajectory([1], [7], 4, group="b"), Trajectory(prompt_ids=[1, 2, 3], group="b", finish_reason="length")]
    put_trajectories(store, first)  # continuations padded to 5 tokens (2 of them environment tokens)
    put_trajectories(store, second)  # padded to 1: rows of both puts come back in one batch
    for consumer, num_rows in (("c", 4), ("d", 2)):  # rows of both puts (two widths); rows of the first only
        batch = store.get(consumer, "train", [*TRAJECTORY_COLUMNS, "meta"], num_rows)
        for want, have in zip(first + second, trajectories_of(batch), strict=False):
            assert (have.prompt_ids, have.tokens, have.logprobs, have.versions) == (want.prompt_ids, want.tokens, want.logprobs, want.versions)
            assert (have.group, have.finish_reason, have.meta) == (want.group, want.finish_reason, want.meta)
        assert len(batch) == num_rows and batch.versions == [3, 3, 4, None][:num_rows]  # a row's version is its oldest token's


def test_a_trajectory_whose_lists_disagree_is_refused_before_padding_hides_it():
    store = Store()
    store.create_partition("train", consumers=["c"])
    t = _trajectory([1, 5], [7, 8, 2], 3, group="a")
    t.logprobs.pop()  # changed after it was made
    with pytest.raises(ValueError, match="3 tokens, 2 logprobs, 3 versions"):
        put_trajectories(store, [t])
    assert store.metrics()["partitions"]["train"]["rows"] == 0


def test_token_batch_of_the_stored_columns_is_the_trajectories_token_batch():
    store = Store()
    store.create_partition("train", consumers=["c", "d", "e"])
    first = [_trajectory([1, 5], [7, 8, 2], 3, group="a"), _trajectory([1, 5, 6, 6], [9], 3, group="a", env=[4, 4])]
    second = [_trajectory([1], [7], 4, group="b"), Trajectory(prompt_ids=[1, 2, 3], group="b", finish_reason="length")]
    put_trajectories(store, first)  # continuations 5 wide, environment tokens among them
    put_trajectories(store, second)  # 1 wide; with a row of no continuation at all
    put_trajectories(store, [Trajectory(prompt_ids=[1, 2], group="c", finish_reason="length")])  # 0 wide
    for consumer, num_rows, order in (("c", 5, [4, 2, 0, 3, 1]), ("d", 2, None), ("e", 1, None)):
        batch = store.get(consumer, "train", list(TRAJECTORY_COLUMNS), num_rows)
        trajectories = trajectories_of(batch)
        want = to_token_batch([trajectories[k] for k in order] if order else trajectories, pad_id=0)
        have = token_batch_of(batch, pad_id=0, order=order)
        for name, a, b in zip(("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "versions"), have.tensors(), want.tensors(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_resumable_row_is_plain_data_and_gives_back_the_group_as_it_was():
    group = [_trajectory([1, 5], [7, 8, 2], 3, group=11, env=[4]), Trajectory(prompt_ids=[1, 5], group=11, meta={"answer": "11"})]
    group[1].extend([9], [-0.5], 4)
    row = resumable_prompt({"prompt_ids": [1, 5], "answer": "11"}, group)
    assert decode(*encode(row)) == row  # msgpack values only: it crosses processes and checkpoints
    back = group_of(42, row, group_size=2)  # a new row index; the group keeps its id
    assert [dataclass_fields(t) for t in back] == [dataclass_fields(t) for t in group]
    fresh = group_of(42, {"prompt_ids": [1, 5], "answer": "42"}, group_size=3)
    assert [(t.group, t.tokens, t.meta, t.done) for t in fresh] == [(42, [], {"answer": "42"}, False)] * 3


def dataclass_fields(t: Trajectory) -> tuple:
    return (t.prompt_ids, t.group, t.tokens, t.logprobs, t.versions, t.finish_reason, t.meta)


class CountingEngine:
    """Decodes one token per chunk: 10 * version + position, logprob -version / 8 (exact in
    float32). A trajectory stops at its prompt's `stop_at` tokens, else ends at the budget.
    With `stall_at`, it stalls there until `should_pause` (a trainer reclaiming the seat)."""

    def __init__(self, version: int, *, stall_at: int | None = None) -> None:
        self.version, self.stall_at = version, stall_at
        self.seen: list[Trajectory] = []
        self.stalled = threading.Event()

    def generate(self, trajectories, *, max_new_tokens, should_pause=None, refill=None):
        self.seen += trajectories
        active = [t for t in trajectories if not t.done]
        while active:
            if self.stall_at is not None and min(len(t.tokens) for t in active) >= self.stall_at:
                deadline = time.monotonic() + 10
                self.stalled.set()
                while not should_pause():
                    assert time.monotonic() < deadline, "nobody reclaimed the seat"
                    time.sleep(0.001)
            if should_pause is not None and should_pause():
                break
            for t in active:
                t.extend([10 * self.version + len(t.tokens)], [-self.version / 8], self.version)
                if len(t.tokens) >= t.meta.get("stop_at", max_new_tokens + 1):
                    t.finish_reason = "stop"
                elif len(t.tokens) >= max_new_tokens:
                    t.finish_reason = "length"
            active = [t for t in active if not t.done]
        return list(trajectories)

    def load_weights(self, version, named_tensors) -> None:
        self.version = version


def _seat(turns: Turns, name: str) -> Seat:
    return Seat(turns, name, park=lambda: None, unpark=lambda: None)


def _start(worker: RolloutWorker, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            worker.run()
        except (Stop, StoreError):
            pass
        except BaseException as e:  # asserted empty by the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


BUDGET, STALL = 8, 3


def _stores(num_prompts: int, capacity: int | None = None) -> tuple[Store, list[int]]:
    store = Store()
    store.create_partition("prompts", consumers=["rollout"], capacity_rows=capacity)
    store.create_partition("train", consumers=["check"])
    prompts = [{"prompt_ids": [1, k], "answer": str(k)} for k in range(num_prompts)]
    prompts[0]["stop_at"] = 2  # this group finishes before the reclaim
    return store, store.put("prompts", {"prompt": prompts})


def _worker(store: Store, engine, **kw) -> RolloutWorker:
    return RolloutWorker(store=store, engine=engine, group_size=2, max_new_tokens=BUDGET, prompts_per_generate=4, stopping=threading.Event(), **kw)


def _check_continued(batch, engine_a: CountingEngine, prompts: list[int]) -> None:
    """Every group once, whole; A's tokens (version 3) a prefix of each, the rest B's (version 4)."""
    assert collections.Counter(batch.groups) == dict.fromkeys(prompts, 2)
    paused_by_a = collections.defaultdict(list)
    for t in engine_a.seen:
        paused_by_a[t.group].append(t)
    for t in trajectories_of(batch):
        assert t.meta["answer"] == str(t.group - prompts[0]) and t.prompt_ids == [1, t.group - prompts[0]]
        if t.meta.get("stop_at"):  # finished by A before the reclaim
            assert (t.tokens, t.versions, t.finish_reason) == ([30, 31], [3, 3], "stop")
            continue
        assert any(t.tokens[:STALL] == mine.tokens for mine in paused_by_a[t.group])  # A's tokens, kept
        assert t.tokens == [30, 31, 32] + [40 + k for k in range(STALL, BUDGET)]
        assert t.versions == [3] * STALL + [4] * (BUDGET - STALL) and t.logprobs == [-3 / 8] * STALL + [-4 / 8] * (BUDGET - STALL)
        assert t.finish_reason == "length"


def _stalled_borrowed_worker(store: Store, errors: list[BaseException]) -> tuple[RolloutWorker, threading.Thread, Seat]:
    """Worker A on a borrowed seat (hand-off mode), started and stalled mid-generation with
    version 3, and the trainer's seat at the same `Turns`. A's engine is `a.engine.engine`."""
    turns = Turns()
    train_seat = _seat(turns, "train")
    engine_a = CountingEngine(3, stall_at=STALL)
    a = _worker(store, SharedRolloutEngine(engine_a, _seat(turns, "rollout-1")), hand_off=True)
    thread = _start(a, errors)
    assert engine_a.stalled.wait(10)
    return a, thread, train_seat


def _stop(store: Store, workers: list[RolloutWorker], threads: list[threading.Thread], errors: list[BaseException]) -> None:
    for worker in workers:
        worker.stopping.set()
    store.wake()
    for thread in threads:
        thread.join(10)
    assert not errors and not any(thread.is_alive() for thread in threads)


def test_a_reclaimed_borrowed_seat_hands_its_paused_groups_to_another_worker():
    store, prompts = _stores(4, capacity=4)  # full: the hand-off put counts the rows it acks as room
    errors: list[BaseException] = []
    a, thread_a, train_seat = _stalled_borrowed_worker(store, errors)
    borrowed, engine_a, engine_b = a.engine, a.engine.engine, CountingEngine(4)
    b = _worker(store, engine_b)
    threads = [thread_a]
    with train_seat.turn():  # the trainer reclaims its devices: A pauses at the next chunk boundary
        assert borrowed.reclaimed
        _until(lambda: (a.num_handed_off, a.num_samples) == (3, 2), "A did not hand off its paused groups")
        assert store.release("rollout") == 0  # A holds no rows: every one it took was acked
        threads.append(_start(b, errors))  # B continues them while A waits for its turn
        batch = store.get("check", "train", [*TRAJECTORY_COLUMNS, "meta"], 8, timeout=10)
        assert all(len(t.tokens) in (2, STALL) for t in engine_a.seen)  # A computed nothing during the trainer's turn
    _stop(store, [a, b], threads, errors)
    _check_continued(batch, engine_a, prompts)
    assert (a.num_handed_off, a.num_samples, a.num_paused, b.num_handed_off, b.num_samples) == (3, 2, 1, 0, 6)
    assert store.metrics()["partitions"]["prompts"]["rows"] == 0  # every row acked: nothing leased or ready
    train_seat.close(), borrowed.seat.close()


def test_workers_take_handed_off_groups_before_fresh_prompts():
    store, prompts = _stores(4)
    errors: list[BaseException] = []
    a, thread_a, train_seat = _stalled_borrowed_worker(store, errors)
    engine_b = CountingEngine(4)
    b = _worker(store, engine_b)
    threads = [thread_a]
    fresh = store.put("prompts", {"prompt": [{"prompt_ids": [2, k], "answer": "x"} for k in range(4)]})  # queued ahead of the hand-off
    with train_seat.turn():
        _until(lambda: a.num_handed_off == 3, "A did not hand off its paused groups")
        threads.append(_start(b, errors))
        _until(lambda: b.num_samples >= 8, "B did not finish its first batch")
    _stop(store, [a, b], threads, errors)
    first_batch = {t.group for t in engine_b.seen[:8]}  # B's first generate: 4 groups of 2
    assert first_batch == {*prompts[1:], fresh[0]}  # the three paused groups, then the oldest fresh prompt
    train_seat.close(), a.engine.seat.close()


def test_groups_handed_off_survive_the_worker_that_took_them_dying():
    store, prompts = _stores(2)
    errors: list[BaseException] = []
    a, thread, train_seat = _stalled_borrowed_worker(store, errors)
    with train_seat.turn():
        _until(lambda: (a.num_handed_off, a.num_samples) == (1, 2), "A did not hand off its paused group")
        a.stopping.set()  # A stops (its process ends) before anyone picks the group up
    store.wake()
    thread.join(10)
    assert not errors and not thread.is_alive()
    taken = store.get("rollout", "prompts", ["prompt"], 2, partial=True, timeout=1)  # another worker takes it and dies
    (row,) = taken.columns["prompt"]
    assert row[RESUME_KEY]["group"] == prompts[1] and [s["versions"] for s in row[RESUME_KEY]["samples"]] == [[3] * STALL] * 2
    assert taken.versions == [3]  # the version its tokens (and its admission) need: the next worker catches up to it
    assert store.release("rollout", "prompts", taken.indexes) == 1  # its lease ends: redelivered like any prompt row
    b = _worker(store, CountingEngine(2))  # older weights than the group's tokens
    thread = _start(b, errors)
    with pytest.raises(StoreTimeout):  # it waits for a version >= 3 before it continues the group
        store.get("check", "train", ["tokens"], 4, timeout=0.3)
    assert b.engine.seen == []
    b.inbox.offer(4, {})
    batch = store.get("check", "train", [*TRAJECTORY_COLUMNS, "meta"], 4, timeout=10)
    _stop(store, [b], [thread], errors)
    _check_continued(batch, a.engine.engine, prompts)
    assert store.metrics()["partitions"]["prompts"]["rows"] == 0
    train_seat.close(), a.engine.seat.close()


def test_a_handed_off_group_keeps_its_newest_generated_version_behind_environment_tokens():
    store, prompts = _stores(1)
    worker = _worker(store, CountingEngine(5))
    taken = store.get("rollout", "prompts", ["prompt"], 1, timeout=1)
    (group,) = [group_of(taken.indexes[0], taken.columns["prompt"][0], 2)]
    for t in group:  # a turn generated by version 5, then a tool's answer: the policy's next turn is due
        t.extend([7], [-0.5], 5)
        t.append_env([9, 9])
    worker._hand_back([_Group(taken.indexes[0], taken.columns["prompt"][0], group, 2)])
    again = store.get("rollout", "prompts", ["prompt"], 1, timeout=1)
    assert again.versions == [5]  # not 2: the next worker must not continue with weights older than its tokens
