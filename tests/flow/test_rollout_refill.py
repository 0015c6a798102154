"""The rollout worker's continuous batching: a group whose samples all ended goes into
`train` while the rest of its batch still decodes, and admitted prompts take its place
in the same generate call (`RolloutWorker.continuous`, `flow.protocols.Refill`)."""

from __future__ import annotations

import threading
import time

from tidal.flow.rollout import RolloutWorker, Stop
from tidal.flow.rows import TRAJECTORY_COLUMNS, trajectories_of
from tidal.flow.store import Store, StoreError
from tidal.flow.trajectory import Trajectory

BUDGET = 6


class SteppingEngine:
    """Decodes one token (10 * position) per step for every row; a row ends at its prompt's
    `stop_at` tokens, else at the budget. Each step is a safe point: with a `refill`, it
    hands over what ended and takes new rows. Waits at `gate` (when set) after the step
    where `gate_after` tokens were decoded, until the test opens it."""

    def __init__(self, gate_after: int | None = None) -> None:
        self.version = 0
        self.calls: list[list[int]] = []  # each generate call: the groups it decoded (given and joined)
        self.gate_after, self.gate, self.at_gate = gate_after, threading.Event(), threading.Event()

    def generate(self, trajectories, *, max_new_tokens, should_pause=None, refill=None):
        rows = [t for t in trajectories if not t.done]
        added: list[Trajectory] = []
        self.calls.append([t.group for t in rows])
        steps = 0
        while rows:
            for t in rows:
                t.extend([10 * len(t.tokens)], [-0.5], self.version)
                if len(t.tokens) >= t.meta.get("stop_at", max_new_tokens):
                    t.finish_reason = "stop" if len(t.tokens) < max_new_tokens else "length"
            steps += 1
            ended = [t for t in rows if t.done]
            rows = [t for t in rows if not t.done]
            if refill is not None:
                if ended:
                    refill.done(ended)
                new = [t for t in refill.more() if not t.done]
                self.calls[-1] += [t.group for t in new]
                rows += new
                added += new
            if steps == self.gate_after:
                self.at_gate.set()
                assert self.gate.wait(10), "the test never opened the gate"
            if should_pause is not None and should_pause():
                break
        return list(trajectories) + added

    def load_weights(self, version, named_tensors) -> None:
        self.version = version


def _setup(continuous: bool, engine: SteppingEngine) -> tuple[Store, list[int], RolloutWorker]:
    store = Store()
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["check"])
    prompts = [{"prompt_ids": [1, k], "stop_at": 2 if k == 0 else BUDGET} for k in range(3)]  # group 0 ends after 2 tokens
    indexes = store.put("prompts", {"prompt": prompts})
    worker = RolloutWorker(store=store, engine=engine, group_size=2, max_new_tokens=BUDGET, prompts_per_generate=2, stopping=threading.Event(), continuous=continuous)
    return store, indexes, worker


def _run(worker: RolloutWorker, errors: list[BaseException]) -> threading.Thread:
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


def _stop(store: Store, worker: RolloutWorker, thread: threading.Thread, errors: list[BaseException]) -> None:
    worker.stop()
    store.wake()
    thread.join(10)
    assert not errors and not thread.is_alive()


def test_a_group_that_ended_is_trained_on_while_its_batch_decodes_and_a_prompt_takes_its_place():
    engine = SteppingEngine(gate_after=4)
    store, indexes, worker = _setup(True, engine)
    errors: list[BaseException] = []
    thread = _run(worker, errors)
    assert engine.at_gate.wait(10)  # 4 tokens into the batch of groups 0 and 1
    early = store.get("check", "train", list(TRAJECTORY_COLUMNS), 2, timeout=5)  # group 0, while group 1 still decodes
    assert set(early.groups) == {indexes[0]} and [t.tokens for t in trajectories_of(early)] == [[0, 10]] * 2
    assert engine.calls == [[indexes[0]] * 2 + [indexes[1]] * 2 + [indexes[2]] * 2]  # group 2 joined the running call
    engine.gate.set()
    rest = store.get("check", "train", list(TRAJECTORY_COLUMNS), 4, timeout=5)
    assert sorted(rest.groups) == [indexes[1]] * 2 + [indexes[2]] * 2
    assert all(t.tokens == [0, 10, 20, 30, 40, 50] and t.finish_reason == "length" for t in trajectories_of(rest))
    assert len(engine.calls) == 1 and worker.num_samples == 6 and store.release("rollout") == 0  # every prompt acked
    _stop(store, worker, thread, errors)


def test_without_continuous_batching_a_batch_goes_into_train_when_its_last_group_ends():
    engine = SteppingEngine(gate_after=4)
    store, indexes, worker = _setup(False, engine)
    errors: list[BaseException] = []
    thread = _run(worker, errors)
    assert engine.at_gate.wait(10)
    time.sleep(0.05)
    assert store.metrics()["partitions"]["train"]["rows"] == 0  # group 0 ended, but waits for group 1
    engine.gate.set()
    batch = store.get("check", "train", list(TRAJECTORY_COLUMNS), 6, timeout=5)
    assert sorted(batch.groups) == sorted([indexes[0]] * 2 + [indexes[1]] * 2 + [indexes[2]] * 2)
    assert engine.calls == [[indexes[0]] * 2 + [indexes[1]] * 2, [indexes[2]] * 2]  # group 2 waited for a call of its own
    _stop(store, worker, thread, errors)


def test_a_prompt_admitted_by_newer_weights_waits_for_them_instead_of_joining():
    engine = SteppingEngine(gate_after=4)
    store = Store()
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["check"])
    prompts = [{"prompt_ids": [1, k], "stop_at": 2 if k == 0 else BUDGET} for k in range(3)]
    indexes = store.put("prompts", {"prompt": prompts}, versions=[0, 0, 1])  # the third admitted once version 1 was published
    worker = RolloutWorker(store=store, engine=engine, group_size=2, max_new_tokens=BUDGET, prompts_per_generate=2, stopping=threading.Event())
    errors: list[BaseException] = []
    thread = _run(worker, errors)
    assert engine.at_gate.wait(10)
    assert engine.calls == [[indexes[0]] * 2 + [indexes[1]] * 2]  # taken from the store, but not decoded by version 0
    worker.inbox.offer(1, {})  # version 1 arrives: the call pauses at its next safe point
    engine.gate.set()
    batch = store.get("check", "train", list(TRAJECTORY_COLUMNS), 6, timeout=5)
    by_group = {t.group: t for t in trajectories_of(batch)}
    assert by_group[indexes[2]].versions == [1] * BUDGET and by_group[indexes[1]].versions[:4] == [0] * 4
    assert engine.calls[1][-2:] == [indexes[2]] * 2 and worker.versions_applied == [1]
    _stop(store, worker, thread, errors)


def test_refill_looks_at_the_groups_of_rows_that_ended_and_one_complete_from_the_start():
    """`_Refill` keeps each group's open rows: a row ending puts its group once the group is
    complete, a group complete before the call goes in at the first `done`, and the room
    for new rows counts the open rows of the groups still held."""
    from tidal.flow.rollout import _Refill

    store, indexes, worker = _setup(True, SteppingEngine())
    groups = worker._groups_of(store.get("rollout", "prompts", ["prompt"], 2, timeout=1))
    first, second = groups
    for t in first.trajectories:  # already ended when the call starts (a resumed group of finished rows)
        t.extend([5], [-0.1], 0)
        t.finish_reason = "stop"
    refill = _Refill(worker, groups)
    a, b = second.trajectories
    a.extend([5], [-0.1], 0)
    a.finish_reason = "stop"
    refill.done([a])
    assert [g.index for g in refill.groups] == [second.index]  # the complete group went in; the other waits for b
    assert store.metrics()["partitions"]["train"]["rows"] == 2
    assert sum(refill._open.values()) == 1  # b, the one row still decoding
    b.extend([5], [-0.1], 0)
    b.finish_reason = "stop"
    refill.done([b])
    assert refill.groups == [] and refill._open == {} and refill._group_of == {}
    assert store.metrics()["partitions"]["train"]["rows"] == 4 and store.release("rollout") == 0  # both prompts acked with their puts
    new = refill.more()  # room for every row again: the third prompt joins
    assert {t.group for t in new} == {indexes[2]} and len(new) == 2 and sum(refill._open.values()) == 2
