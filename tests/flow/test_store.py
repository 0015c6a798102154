"""The in-process store: readiness, leases, acks, samplers, capacity, metrics, persistence."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tidal.flow.clock import RealClock
from tidal.flow.store import Grouped, SeqlenBalanced, StalenessFilter, Store, StoreError, StoreTimeout, TaggedFirst
from tidal.flow.store.persist import load, save
from tidal.flow.store.samplers import Sequential, from_spec, to_spec


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(consumers=("reward", "train"), **kw) -> Store:
    store = Store()
    store.create_partition("p", consumers=list(consumers), **kw)
    return store


def test_rows_are_ready_when_all_requested_columns_are_present():
    store = make()
    idx = store.put("p", {"response": torch.arange(6).reshape(3, 2)})
    with pytest.raises(StoreTimeout, match="0 of 1 rows were ready"):
        store.get("train", "p", ["response", "reward"], 1, timeout=0)
    store.put("p", {"reward": [1.0, 2.0]}, indexes=idx[:2])
    batch = store.get("train", "p", ["response", "reward"], 2, timeout=0)
    assert batch.indexes == [0, 1] and batch.columns["reward"] == [1.0, 2.0]
    assert torch.equal(batch.stack("response"), torch.tensor([[0, 1], [2, 3]]))


def test_get_hands_back_views_not_copies():
    store = make(consumers=["c"])
    data = torch.arange(8.0).reshape(4, 2)
    store.put("p", {"x": data})
    batch = store.get("c", "p", ["x"], 4)
    assert all(cell.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() for cell in batch.columns["x"])


def test_consumers_are_independent_and_each_sees_each_row_once():
    store = make(consumers=["a", "b"])
    store.put("p", {"x": list(range(4))})
    a = store.get("a", "p", ["x"], 4)
    b = store.get("b", "p", ["x"], 4)
    assert a.indexes == b.indexes == [0, 1, 2, 3]
    store.ack("a", "p", a.indexes)
    with pytest.raises(StoreTimeout):
        store.get("a", "p", ["x"], 1, timeout=0)
    assert store.metrics()["partitions"]["p"]["rows"] == 4  # b has not acked yet
    store.ack("b", "p", b.indexes)
    assert store.metrics()["partitions"]["p"]["rows"] == 0  # evicted once everyone acked


def test_get_wakes_on_put_without_polling():
    store = make(consumers=["c"])
    got = {}

    def consumer():
        got["batch"] = store.get("c", "p", ["x"], 2, timeout=10)
        got["t"] = time.monotonic()

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.05)
    assert thread.is_alive()
    t_put = time.monotonic()
    store.put("p", {"x": [1, 2]})
    thread.join(5)
    assert got["batch"].columns["x"] == [1, 2]
    assert got["t"] - t_put < 0.5


def test_a_change_wakes_only_the_waiters_it_concerns():
    """A waiting get rechecks (its sampler runs) only after a put of a column it asked for,
    or a change to the whole store; listeners hear which partition changed."""
    store = Store()
    store.create_partition("p", consumers=["reader", "other"])
    store.create_partition("q", consumers=["c"])
    changed = []
    store.add_change_listener(changed.append)
    checks = []

    class Counting(Sequential):
        def select(self, rows, batch_size, partial, ctx):
            checks.append(len(rows))
            return super().select(rows, batch_size, partial, ctx)

    got = {}
    thread = threading.Thread(target=lambda: got.update(batch=store.get("reader", "p", ["reward"], 2, sampler=Counting(), timeout=10)))
    thread.start()
    _wait_until(lambda: checks == [0])
    indexes = store.put("p", {"tokens": [1, 2]})  # rows, but not the column it waits for
    store.put("q", {"tokens": [3]})  # another partition
    store.ack("other", "p", indexes)  # room, not rows
    time.sleep(0.05)
    assert checks == [0] and thread.is_alive()
    store.set_version(1)  # may concern every waiter (a staleness filter)
    _wait_until(lambda: len(checks) == 2)
    store.put("p", {"reward": [0.5, 1.0]}, indexes)
    thread.join(5)
    assert got["batch"].columns["reward"] == [0.5, 1.0] and checks[-1] == 2
    assert changed == ["p", "q", "p", None, "p"]


def _wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_lease_expiry_redelivers_and_acks_are_idempotent():
    clock = FakeTime()
    store = Store(clock=RealClock(now=clock))
    store.create_partition("p", consumers=["c"], lease_s=10)
    store.put("p", {"x": [1, 2]})
    first = store.get("c", "p", ["x"], 2, timeout=0)
    with pytest.raises(StoreTimeout):
        store.get("c", "p", ["x"], 1, timeout=0)
    clock.now = 11
    again = store.get("c", "p", ["x"], 2, timeout=0)
    assert again.indexes == first.indexes
    assert store.ack("c", "p", again.indexes) == 2
    assert store.ack("c", "p", first.indexes) == 0  # the late ack of the first lease
    m = store.metrics()["partitions"]["p"]["consumers"]["c"]
    assert m["redelivered"] == 2 and m["acked"] == 2 and m["leased"] == 0


def test_release_returns_a_dead_consumers_rows():
    store = make(consumers=["c"])
    store.put("p", {"x": [1, 2, 3]})
    store.get("c", "p", ["x"], 3)
    assert store.release("c") == 3
    assert store.get("c", "p", ["x"], 3, timeout=0).indexes == [0, 1, 2]


def test_partial_get_returns_what_is_ready():
    store = make(consumers=["c"])
    store.put("p", {"x": [1, 2]})
    assert len(store.get("c", "p", ["x"], 8, partial=True, timeout=0)) == 2


def test_grouped_sampler_returns_complete_groups_only():
    store = make(consumers=["c"])
    store.put("p", {"x": [0, 1, 2]}, groups=["g0", "g1", "g0"])
    with pytest.raises(StoreTimeout):
        store.get("c", "p", ["x"], 4, sampler=Grouped(2), timeout=0)
    batch = store.get("c", "p", ["x"], 2, sampler=Grouped(2), timeout=0)
    assert batch.indexes == [0, 2] and batch.groups == ["g0", "g0"]
    with pytest.raises(ValueError, match="multiple of group_size"):
        store.get("c", "p", ["x"], 3, sampler=Grouped(2), timeout=0)


def test_staleness_filter():
    store = make(consumers=["drop", "hold"])
    store.put("p", {"x": [0, 1, 2, 3]}, versions=[0, 1, 2, 3])
    store.set_version(3)
    batch = store.get("drop", "p", ["x"], 2, sampler=StalenessFilter(max_staleness=1), timeout=0)
    assert batch.versions == [2, 3]
    m = store.metrics()["partitions"]["p"]["consumers"]
    assert m["drop"]["dropped"] == 2
    held = store.get("hold", "p", ["x"], 2, sampler=StalenessFilter(max_staleness=1, hold=True), timeout=0)
    assert held.versions == [2, 3] and store.metrics()["partitions"]["p"]["consumers"]["hold"]["dropped"] == 0
    with pytest.raises(StoreTimeout, match="2 of 1"):  # two old rows remain, held
        store.get("hold", "p", ["x"], 1, sampler=StalenessFilter(max_staleness=1, hold=True), timeout=0)


def test_staleness_filter_at_a_version_judges_rows_as_of_that_version():
    store = make(consumers=["next", "later"])
    store.put("p", {"x": [0, 1, 2, 3]}, versions=[0, 1, 2, 3])
    store.set_version(2)  # at 2 with max_staleness 1, rows of version 1 would be trainable
    batch = store.get("next", "p", ["x"], 2, sampler=StalenessFilter(1, at_version=3), timeout=0)
    assert batch.versions == [2, 3] and store.metrics()["partitions"]["p"]["consumers"]["next"]["dropped"] == 2
    store.set_version(9)  # the store moved on: the version asked for still decides
    assert store.get("later", "p", ["x"], 2, sampler=StalenessFilter(1, at_version=3), timeout=0).versions == [2, 3]
    spec = to_spec(StalenessFilter(1, Grouped(2), at_version=3))
    assert from_spec(spec) == StalenessFilter(1, Grouped(2), at_version=3) and from_spec({**spec, "at_version": None}).at_version is None
    with pytest.raises(ValueError, match="at_version"):
        from_spec({**spec, "at_version": "3"})


def test_seqlen_balanced_sampler_balances_tokens_across_ranks():
    store = make(consumers=["c"])
    lengths = [100, 1, 90, 2, 80, 3, 70, 4]
    store.put("p", {"tokens": [torch.zeros(n) for n in lengths]})
    batch = store.get("c", "p", ["tokens"], 8, sampler=SeqlenBalanced(num_ranks=2, length_column="tokens"), timeout=0)
    halves = [sum(len(t) for t in batch.columns["tokens"][r * 4 : (r + 1) * 4]) for r in range(2)]
    assert sorted(batch.indexes) == list(range(8))
    assert abs(halves[0] - halves[1]) <= 20, halves  # sequential halves would be 193 vs 157


def test_tagged_first_sampler_hands_out_tagged_rows_before_the_rest():
    store = make(consumers=["c", "whole", "stale"])
    store.put("p", {"x": [0, 1, 2]}, versions=[0, 0, 5])
    store.put("p", {"x": [3, 4]}, versions=[5, 5], tags=[{"resume": True}, {"resume": False}])
    store.put("p", {"x": [5]}, versions=[0], tags=[{"resume": True}])  # tagged and stale: first, unfiltered
    first = TaggedFirst("resume")
    assert store.get("c", "p", ["x"], 3, sampler=first, timeout=0).indexes == [3, 5, 0]
    assert store.get("c", "p", ["x"], 8, sampler=first, partial=True, timeout=0).indexes == [1, 2, 4]
    with pytest.raises(StoreTimeout, match="6 of 7 rows"):  # a whole batch or nothing, unless partial
        store.get("whole", "p", ["x"], 7, sampler=first, timeout=0)
    store.set_version(5)
    batch = store.get("stale", "p", ["x"], 4, sampler=TaggedFirst("resume", StalenessFilter(max_staleness=1)), timeout=0)
    assert batch.indexes == [3, 5, 2, 4] and store.metrics()["partitions"]["p"]["consumers"]["stale"]["dropped"] == 2


def test_capacity_blocks_put_until_rows_are_consumed():
    store = make(consumers=["c"], capacity_rows=4)
    store.put("p", {"x": [1, 2, 3, 4]})
    with pytest.raises(StoreTimeout, match="is full"):
        store.put("p", {"x": [5]}, timeout=0.05)
    with pytest.raises(StoreError, match="can never fit"):
        store.put("p", {"x": list(range(5))})
    done = threading.Event()

    def producer():
        store.put("p", {"x": [5, 6]}, timeout=10)
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()  # blocked: back-pressure
    batch = store.get("c", "p", ["x"], 2)
    store.ack("c", "p", batch.indexes)
    thread.join(5)
    assert done.is_set()
    assert store.metrics()["partitions"]["p"]["rows"] == 4


def test_capacity_in_bytes():
    store = make(consumers=["c"], capacity_bytes=1000)
    store.put("p", {"x": torch.zeros(2, 100)})  # 800 bytes
    with pytest.raises(StoreTimeout):
        store.put("p", {"x": torch.zeros(1, 100)}, timeout=0)


def test_list_and_dict_cells_count_what_they_hold_toward_capacity_bytes():
    store = make(consumers=["c"], capacity_bytes=1000)
    floats = torch.zeros(100)  # 400 bytes
    with pytest.raises(StoreError, match="can never fit"):
        store.put("p", {"x": [[floats, floats, (floats,)]]})  # one cell, holding 1200 bytes
    store.put("p", {"meta": [{"ids": [1] * 50, "text": "abcd"}]})  # 50 numbers, 4 characters and two keys
    assert 400 < store.metrics()["partitions"]["p"]["bytes"] < 500


def test_cells_replaced_by_smaller_ones_wake_a_put_waiting_for_bytes():
    store = make(consumers=["c"], capacity_bytes=1000)
    store.put("p", {"x": torch.zeros(2, 100)})  # 800 bytes
    done = threading.Event()
    thread = threading.Thread(target=lambda: (store.put("p", {"x": torch.zeros(1, 100)}, timeout=10), done.set()))
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()
    store.put("p", {"x": torch.zeros(2, 10)}, indexes=[0, 1])  # 80 bytes now: room, without an ack
    assert done.wait(2)  # woken, not left to its timeout
    thread.join(5)


def test_puts_and_gets_that_could_only_corrupt_or_wait_are_refused():
    store = make(consumers=["c"], capacity_rows=4)
    store.put("p", {"x": torch.tensor([[10], [11], [12]])})
    with pytest.raises(ValueError, match=r"a put to partition 'p' names rows more than once: \[0\]"):
        store.put("p", {"x": torch.tensor([[1], [2]])}, indexes=[0, 0])  # counted row 0's chunk twice: freed while in use
    store.ack("c", "p", [1])
    assert store.get("c", "p", ["x"], 2, timeout=0).stack("x").tolist() == [[10], [12]]
    with pytest.raises(StoreError, match="a get of 5 rows can never be served by partition 'p' \\(capacity_rows=4\\)"):
        store.get("c", "p", ["x"], 5, timeout=1)  # waited for rows its producers could never put
    assert store.put("p", {"x": torch.zeros(0, 1)}) == [] and len(store._part("p").chunks) == 1  # nothing kept for 0 rows


def test_errors_name_the_bad_input():
    store = make(consumers=["c"])
    with pytest.raises(ValueError, match="no partition 'q'"):
        store.put("q", {"x": [1]})
    with pytest.raises(ValueError, match="'nobody' is not a consumer"):
        store.get("nobody", "p", ["x"], 1)
    with pytest.raises(ValueError, match="column 'y' has 1 values for 2 rows"):
        store.put("p", {"x": [1, 2], "y": [1]})
    with pytest.raises(StoreError, match="never had row 7"):
        store.ack("c", "p", [7])
    with pytest.raises(StoreError, match="no rows"):
        store.put("p", {"y": [1]}, indexes=[42])


def test_close_wakes_waiters():
    store = make(consumers=["c"])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(StoreError, store.get, "c", "p", ["x"], 1)))
    thread.start()
    time.sleep(0.05)
    store.close()
    thread.join(5)
    assert not thread.is_alive() and errors


def test_metrics_counts():
    store = make(consumers=["a", "b"])
    store.put("p", {"x": [1, 2, 3]})
    store.put("p", {"y": [1]}, indexes=[0])
    store.get("a", "p", ["x"], 2)
    m = store.metrics()["partitions"]["p"]
    assert m["ready_by_column"] == {"x": 3, "y": 1}
    assert m["consumers"]["a"]["leased"] == 2 and m["consumers"]["a"]["ready"] == {"x": 1}
    assert m["consumers"]["a"]["wait_s"]["count"] == 1


def test_save_and_load_resume_in_flight_rows(tmp_path):
    store = make(consumers=["a", "b"])
    store.put("p", {"x": torch.arange(6).reshape(3, 2), "s": ["u", "v", "w"], "n": np.ones((3, 2))}, groups=[0, 0, 1], versions=[1, 1, 2])
    store.set_version(2)
    leased = store.get("a", "p", ["x"], 2)
    store.ack("a", "p", [leased.indexes[0]])
    save(store, tmp_path / "store.bin")
    again = load(tmp_path / "store.bin")
    assert again.version == 2
    batch = again.get("a", "p", ["x", "s", "n"], 2, timeout=0)  # the un-acked lease comes back
    assert batch.indexes == [1, 2] and batch.columns["s"] == ["v", "w"] and batch.groups == [0, 1]
    assert torch.equal(batch.stack("x"), torch.tensor([[2, 3], [4, 5]]))
    assert again.get("b", "p", ["x"], 3, timeout=0).versions == [1, 1, 2]
    (tmp_path / "bad.bin").write_bytes(b"TIDALST1" + b"\xff" * 20)
    with pytest.raises(StoreError, match="cannot load"):
        load(tmp_path / "bad.bin")


def test_a_saved_store_keeps_each_consumers_dropped_and_redelivered_counts(tmp_path):
    store = make(consumers=["train"])
    store.put("p", {"x": [0, 1, 2, 3, 4]}, versions=[0, 0, 2, 2, 2])
    store.set_version(2)
    store.get("train", "p", ["x"], 1, sampler=StalenessFilter(max_staleness=1), timeout=0)  # drops the two of version 0
    store.release("train")  # the leased row comes back: redelivered
    before = store.metrics()["partitions"]["p"]["consumers"]["train"]
    assert before["dropped"] == 2 and before["redelivered"] == 1
    save(store, tmp_path / "store.bin")
    after = load(tmp_path / "store.bin").metrics()["partitions"]["p"]["consumers"]["train"]
    assert {k: after[k] for k in ("acked", "dropped", "redelivered")} == {k: before[k] for k in ("acked", "dropped", "redelivered")}


def test_async_form_streams_between_coroutines():
    import asyncio

    from tidal.flow.store import AsyncStore

    async def main():
        store = AsyncStore(make(consumers=["c"], capacity_rows=4))

        async def produce():
            for k in range(5):
                await store.put("p", {"x": [2 * k, 2 * k + 1]}, timeout=10)

        async def consume():
            seen = []
            while len(seen) < 10:
                batch = await store.get("c", "p", ["x"], 2, timeout=10)
                seen.extend(batch.columns["x"])
                assert await store.ack("c", "p", batch.indexes) == 2
            return seen

        _, seen = await asyncio.gather(produce(), consume())
        return seen

    assert asyncio.run(main()) == list(range(10))  # capacity 4 < 10 rows: back-pressure held


def test_put_can_ack_its_input_rows_in_the_same_step():
    store = Store()
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["train"])
    prompts = store.put("prompts", {"prompt": ["1+1", "2+2"]})
    assert store.get("rollout", "prompts", ["prompt"], 2).indexes == prompts
    with pytest.raises(ValueError, match="'trainer' is not a consumer of partition 'prompts'"):
        store.put("train", {"tokens": [torch.arange(2)]}, ack=("trainer", "prompts", prompts))
    with pytest.raises(StoreError, match="never had row 9"):
        store.put("train", {"tokens": [torch.arange(2)]}, ack=("rollout", "prompts", [9]))
    assert store.metrics()["partitions"]["train"]["rows"] == 0  # a bad ack leaves no half-done put
    assert store.put("train", {"tokens": [torch.arange(2), torch.arange(3)]}, groups=prompts, ack=("rollout", "prompts", prompts)) == [0, 1]
    assert store.metrics()["partitions"]["prompts"]["rows"] == 0  # acked by every consumer: evicted
    assert store.release("rollout") == 0  # nothing left to redeliver


def test_a_put_that_acks_rows_of_its_own_full_partition_counts_the_room_they_free():
    # A rollout worker hands paused groups back to `prompts`, acking the rows it took there.
    store = make(consumers=["c"], capacity_rows=3, capacity_bytes=3 * 8 * 4)
    store.put("p", {"x": torch.zeros(3, 4, dtype=torch.float64)})  # full: rows and bytes
    taken = store.get("c", "p", ["x"], 2).indexes
    with pytest.raises(StoreTimeout, match="is full"):
        store.put("p", {"x": torch.ones(1, 4, dtype=torch.float64)}, timeout=0.05)  # room from an ack of other rows only
    assert store.put("p", {"x": torch.ones(2, 4, dtype=torch.float64)}, timeout=1, ack=("c", "p", taken)) == [3, 4]
    assert store.metrics()["partitions"]["p"]["rows"] == 3
    with pytest.raises(StoreTimeout, match="is full"):  # the rows it acks were acked already: no room
        store.put("p", {"x": torch.ones(1, 4, dtype=torch.float64)}, timeout=0.05, ack=("c", "p", taken))
    two = make(consumers=["c", "d"], capacity_rows=2)  # a row another consumer still needs stays
    rows = two.put("p", {"x": [1, 2]})
    two.ack("d", "p", rows[:1])
    with pytest.raises(StoreTimeout, match="is full"):
        two.put("p", {"x": [3, 4]}, timeout=0.05, ack=("c", "p", rows))
    assert two.put("p", {"x": [3]}, timeout=1, ack=("c", "p", rows)) == [2]
    assert two.metrics()["partitions"]["p"]["rows"] == 2 and two.get("d", "p", ["x"], 2).indexes == [1, 2]


def test_tags_of_a_row_may_be_none_and_bad_tags_are_named():
    store = make(consumers=["c"])
    store.put("p", {"x": [0, 1]}, tags=[None, {"resume": True}])  # no tags, like groups and versions
    assert store.get("c", "p", ["x"], 2, sampler=TaggedFirst("resume"), timeout=0).indexes == [1, 0]
    with pytest.raises(ValueError, match=r"tags\[1\] is 'resume'"):
        store.put("p", {"x": [2, 3]}, tags=[{}, "resume"])
    assert store.metrics()["partitions"]["p"]["rows"] == 2


def test_a_get_of_columns_given_as_one_string_is_refused_not_left_waiting():
    store = make(consumers=["c"])
    store.put("p", {"reward": [1.0]})
    with pytest.raises(ValueError, match=r"columns must be a list of column names, got the string 'reward'; pass \['reward'\]"):
        store.get("c", "p", "reward", 1, timeout=0)  # waited (for ever, without a timeout) for columns 'r', 'e', 'w', 'a', 'd'


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"capacity_rows": 0}, r"partition 'p': capacity_rows must be an int >= 1 or None, got 0"),
        ({"capacity_bytes": -5}, r"partition 'p': capacity_bytes must be an int >= 1 or None, got -5"),
        ({"capacity_rows": 2.5}, r"capacity_rows must be an int >= 1 or None, got 2.5"),
        ({"lease_s": 0}, r"partition 'p': lease_s must be a number of seconds > 0, got 0"),
        ({"lease_s": float("nan")}, r"lease_s must be a number of seconds > 0, got nan"),
    ],
)
def test_partition_settings_that_would_block_for_ever_or_never_lease_are_named(settings, message):
    """A capacity of 0 made every put wait for ever; a lease of 0 (or NaN) handed rows out
    again at once. `configure_partition` checks the same."""
    store = Store()
    with pytest.raises(ValueError, match=message):
        store.create_partition("p", consumers=["c"], **settings)
    store.create_partition("p", consumers=["c"], capacity_rows=1, lease_s=float("inf"))
    if "capacity_bytes" not in settings:
        with pytest.raises(ValueError, match=message):
            store.configure_partition("p", **settings)


def test_counts_and_releases_of_a_consumer_a_partition_lacks_are_named():
    store = make(consumers=["c"])
    store.put("p", {"x": [0]})
    with pytest.raises(ValueError, match="'d' is not a consumer of partition 'p'"):
        store.consumer_counts("p", "d")  # was a bare KeyError
    with pytest.raises(ValueError, match="'d' is not a consumer of partition 'p'"):
        store.release("d", "p")  # was 0, as for a consumer that holds nothing
    assert store.release("d") == 0  # every partition: none where it is no consumer


def test_a_get_acking_a_row_the_partition_never_had_says_so_and_takes_nothing():
    store = make(consumers=("train",))
    store.put("p", {"x": [1, 2]})
    with pytest.raises(StoreError, match="never had row 7"):
        store.get("train", "p", ["x"], 1, timeout=0, ack=[0, 7])  # a typo'd index is no silent no-op
    assert store.consumer_counts("p", "train")["acked"] == 0  # and row 0's ack did not half happen
    assert store.get("train", "p", ["x"], 2, timeout=0).indexes == [0, 1]


def test_a_get_looks_again_only_at_segments_that_changed_since_it_found_them_empty():
    store = make(consumers=["train"])
    firsts = [store.put("p", {"response": [k, k]})[0] for k in range(40)]  # 40 segments of 2 rows
    with pytest.raises(StoreTimeout):
        store.get("train", "p", ["response", "reward"], 1, timeout=0)
    part = store._parts["p"]
    wanted = ("train", frozenset({"response", "reward"}))
    assert part.ready_index[wanted].unsettled == {}  # all found with nothing ready: none looked at again
    store.put("p", {"reward": [1.0, 2.0]}, indexes=[firsts[7], firsts[7] + 1])
    store.put("p", {"reward": [3.0, 4.0]}, indexes=[firsts[3], firsts[3] + 1])
    assert sorted(part.ready_index[wanted].unsettled) == [firsts[3], firsts[7]]
    batch = store.get("train", "p", ["response", "reward"], 4, timeout=0)
    assert sorted(batch.indexes) == [firsts[3], firsts[3] + 1, firsts[7], firsts[7] + 1]
    assert batch.columns["reward"] == [1.0, 2.0, 3.0, 4.0]  # in the order they became ready
    last = store.put("p", {"response": [9, 9]})[0]  # a new segment is looked at; so is every one for a new consumer
    assert sorted(part.ready_index[wanted].unsettled) == [firsts[3], firsts[7], last]
    with pytest.raises(StoreTimeout):  # leased, and no reward: none ready
        store.get("train", "p", ["response", "reward"], 1, timeout=0)
    assert part.ready_index[wanted].unsettled == {}
    store.add_consumer("p", "late")
    assert part.ready_index == {}
    assert len(store.get("late", "p", ["response", "reward"], 4, timeout=0).indexes) == 4
    store.ack("train", "p", batch.indexes)
    store.ack("late", "p", batch.indexes)  # both acked: evicted, and forgotten by every get
    assert all(s not in index.unsettled and s not in {first for first, *_ in index.runs(None)} for index in part.ready_index.values() for s in (firsts[3], firsts[7]))
