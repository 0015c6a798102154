"""The loader and its prompt source (`flow.stages.Stages`): what a checkpoint saves of it, and
how a stop ends it, whatever the source does meanwhile.

A save records the position of the prompts the store holds: a take from the source that is
not in the store yet is not counted (a resumed run draws it again), and never holds the save
up. A stop ends the loader cleanly, even when the source ends or blocks at that moment.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from tidal.engines.tasks import arithmetic
from tidal.engines.tiny import CharTokenizer
from tidal.flow import stages as stages_module
from tidal.flow.stages import Stages
from tidal.flow.store import Store, StoreError, persist
from tidal.flow.workflow import WorkflowConfig

TOKENIZER = CharTokenizer()
CONFIG = dict(num_steps=3, prompts_per_step=2, group_size=4, max_new_tokens=4, prompts_per_generate=1, tis_cap=None, decoupled=True)
FIRST_TAKE = 4
"""Prompts the loader takes at version 0 with max_staleness 1: (max_staleness + 1) steps of 2."""


def _prompts(n: int) -> list[dict]:
    return [{**item, "prompt_ids": TOKENIZER.encode(item["prompt"])} for item in arithmetic(n, seed=3, max_value=9)]


def _no_score(trajectories):
    raise AssertionError("nothing is generated here: nothing to score")


class _Source:
    """`prompts` one by one, counted in `position` (as a resumable source counts); before the
    prompt numbered `pause_at` (from 0) it sets `taking` and waits for `go_on` (up to
    `wait_s`), calling `on_pause` first if given (`pause_at=-1`: never). After `prompts` it ends."""

    def __init__(self, prompts: list[dict], *, pause_at: int, wait_s: float = 10, on_pause=None) -> None:
        self.prompts, self.pause_at, self.wait_s, self.on_pause = prompts, pause_at, wait_s, on_pause
        self.taking, self.go_on, self.position = threading.Event(), threading.Event(), 0

    def __iter__(self):
        for i in range(len(self.prompts) + 1):
            if i == self.pause_at:
                self.taking.set()
                if self.on_pause is not None:
                    self.on_pause()
                self.go_on.wait(self.wait_s)
            if i == len(self.prompts):
                return
            self.position += 1
            yield self.prompts[i]


def _stages(source, store: Store | None = None) -> Stages:
    """Started stages (max_staleness 1, 3 steps of 2 prompts) over `source`; no rollout."""
    stages = Stages(store=store or Store(), prompts=source, score=_no_score, config=WorkflowConfig.from_keys(max_staleness=1, **CONFIG), version=0)
    stages.start()
    return stages


def _saved_prompts(path) -> int:
    return persist.load(path).state_dict()["partitions"]["prompts"]["next_index"]


def _within(seconds: float, fn):
    """`fn()`'s result, or fail if it takes longer than `seconds` (it is left running)."""
    future = concurrent.futures.ThreadPoolExecutor(1).submit(fn)
    done, _ = concurrent.futures.wait([future], timeout=seconds)
    assert done, f"{getattr(fn, '__name__', fn)} did not return within {seconds}s"
    return future.result()


def test_a_store_saved_while_the_loader_takes_prompts_holds_every_prompt_before_the_saved_position(tmp_path):
    # The loader takes prompts from the source, then puts them: a save in between records the
    # position of the prompts already in the store, so a resumed run neither skips the take
    # nor has it twice. The save does not wait for the take: a source can take its time (or
    # block, waiting for prompts that do not come), and the trainer's checkpoint with it.
    # (It once waited, holding the trainer's step; a position past prompts the saved store
    # never got was the fault before that.)
    source = _Source(_prompts(40), pause_at=3)
    stages = _stages(source)
    try:
        assert source.taking.wait(10)
        position = _within(5, lambda: stages.save(tmp_path / "during.bin"))["prompt_position"]
        assert position == _saved_prompts(tmp_path / "during.bin") == 0  # the take is not in the store: not counted
        source.go_on.set()
        _wait_for(lambda: stages.store.metrics()["partitions"]["prompts"]["rows"] == FIRST_TAKE)
        position = stages.save(tmp_path / "after.bin")["prompt_position"]
    finally:
        stages.stop()
        stages.wait()
    assert position == _saved_prompts(tmp_path / "after.bin") == FIRST_TAKE  # every prompt the position counts is in the saved store


def test_a_stop_while_the_loader_takes_prompts_keeps_every_taken_prompt_in_the_store(tmp_path):
    # The loader checked for a stop between taking prompts from the source and putting them:
    # a stop in between dropped them, and the checkpoint written at the stop recorded a
    # position past prompts its store never got (a resumed run skipped them).
    source = _Source(_prompts(40), pause_at=3)
    stages = _stages(source)
    try:
        assert source.taking.wait(10)
        stages.stop()  # as a run stopped early does, before its checkpoint
    finally:
        source.go_on.set()
        stages.wait()
    position = stages.save(tmp_path / "store.bin")["prompt_position"]
    assert position == _saved_prompts(tmp_path / "store.bin") == FIRST_TAKE  # the whole take: (max_staleness + 1) steps of 2 prompts


def test_a_stop_as_a_too_short_source_ends_is_a_clean_stop_not_a_source_that_ran_out():
    # Ctrl-C reaches the whole process group: a source fed by another process (a pipe) ends
    # when that process stops, while the loader waits on it. The loader once checked whether
    # the prompts it had could fill the run before it checked for the stop, and the stopped
    # run ended with "the prompt source ran out" and no checkpoint.
    stages = None
    source = _Source(_prompts(FIRST_TAKE), pause_at=FIRST_TAKE, on_pause=lambda: stages.stop())  # 4 prompts for 3 steps of 2
    stages = _stages(source)
    _wait_for(lambda: source.position == FIRST_TAKE)
    stages.store.set_version(1)  # a step trained: room for one more step's prompts, which the source has not got
    source.go_on.set()
    _within(10, stages.wait)  # no error: a clean stop


def test_a_source_that_ran_out_without_a_stop_still_says_so():
    source = _Source(_prompts(FIRST_TAKE), pause_at=FIRST_TAKE)
    source.go_on.set()
    stages = _stages(source)
    _wait_for(lambda: source.position == FIRST_TAKE)
    stages.store.set_version(1)
    with pytest.raises(RuntimeError, match="the prompt source ran out: 3 steps of 2 prompts need 6 groups, and 4 started"):
        _within(10, stages.wait)


def test_a_source_that_blocks_at_a_stop_holds_up_neither_the_stages_end_nor_the_checkpoint(tmp_path, monkeypatch):
    # A source waiting for prompts that never come (a queue whose producer is gone) once held
    # the loader's lock: the checkpoint of a stopped run waited for it forever.
    monkeypatch.setattr(stages_module, "SOURCE_ON_STOP_S", 0.5)
    source = _Source(_prompts(40), pause_at=FIRST_TAKE, wait_s=120)
    stages = _stages(source)
    try:
        _wait_for(lambda: source.position == FIRST_TAKE)
        stages.store.set_version(1)  # the loader goes back to the source, which blocks
        assert source.taking.wait(10)
        stages.stop()
        _within(10, stages.wait)
        position = _within(10, lambda: stages.save(tmp_path / "store.bin"))["prompt_position"]
        assert position == _saved_prompts(tmp_path / "store.bin") == FIRST_TAKE
    finally:
        source.go_on.set()  # the loader's thread ends


def test_a_put_that_a_stop_cancels_leaves_its_prompts_out_of_the_saved_position(tmp_path):
    # A put that waits for room (a full `prompts` partition) ends with the stop, its prompts
    # not in the store: the position a checkpoint then records must not count them (it
    # counted every prompt taken from the source, and a resumed run skipped these).
    store = Store()
    blocked = threading.Event()
    put = store.put

    def put_waiting_for_room(partition, columns, *args, cancel=None, **kwargs):
        if partition == "prompts" and cancel is not None:  # no room: waits as the store's put does, until cancelled
            blocked.set()
            while not cancel.wait(0.01):
                pass
            raise StoreError(f"put into {partition!r} was cancelled")
        return put(partition, columns, *args, cancel=cancel, **kwargs)

    store.put = put_waiting_for_room
    source = _Source(_prompts(40), pause_at=-1)
    stages = _stages(source, store)
    assert blocked.wait(10) and source.position == FIRST_TAKE
    stages.stop()
    _within(10, stages.wait)
    position = stages.save(tmp_path / "store.bin")["prompt_position"]
    assert position == _saved_prompts(tmp_path / "store.bin") == 0


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)
