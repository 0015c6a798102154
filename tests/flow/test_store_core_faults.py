"""Faults of the store core that lost, leaked or silently corrupted rows (review W5):
empty puts that ack, cancelled async calls, corrupted store files, resumed stores."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

from tidal.flow.clock import RealClock
from tidal.flow.store import AsyncStore, Store, StoreError
from tidal.flow.store.persist import MAGIC, load, save


def test_a_put_of_no_rows_that_acks_its_input_keeps_no_segment_or_chunk():
    store = Store()
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("out", consumers=["train"])
    store.put("prompts", {"x": [1, 2, 3]})
    batch = store.get("rollout", "prompts", ["x"], 3)
    for index in batch.indexes:  # every response was filtered out: nothing to put, the input is done
        assert store.put("out", {"y": []}, ack=("rollout", "prompts", [index])) == []
    store.put("out", {"y": torch.zeros(0, 4)}, [], ack=("rollout", "prompts", batch.indexes))
    out = store._parts["out"]  # the leak is in the partition's bookkeeping
    assert out.segments == [] and out.chunks == {} and out.chunk_refs == {}
    assert store.metrics()["partitions"]["prompts"]["rows"] == 0  # the acks happened
    assert store.put("out", {"y": [7]}) == [0]  # and the partition still works


def _run_with_deadline(coro, seconds: float = 10.0):
    """Run `coro` with asyncio.run in a thread; fail (instead of hanging) past `seconds`."""
    box: dict[str, object] = {}

    def target():
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as e:  # reported below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "asyncio.run did not return: a cancelled store call kept its worker thread waiting"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("result")


def test_a_cancelled_async_get_ends_its_thread_and_leases_nothing():
    store = Store()
    store.create_partition("p", consumers=["c"])
    aio = AsyncStore(store)

    async def main():
        task = asyncio.create_task(aio.get("c", "p", ["x"], 1))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.put("p", {"x": [1]})
        await asyncio.sleep(0.05)

    _run_with_deadline(main())
    assert store.metrics()["partitions"]["p"]["consumers"]["c"]["leased"] == 0
    assert store.get("c", "p", ["x"], 1, timeout=0).columns["x"] == [1]  # ready now, not after a lease expiry


def _leasing_store(delay_s: float):
    """A store of two rows whose `get` returns `delay_s` after leasing them (the cancel reaches
    the thread in between); (store, its AsyncStore, set once leased, the undelayed get)."""
    store = Store()
    store.create_partition("p", consumers=["c"])
    leased = threading.Event()
    original = store.get

    def slow_get(*args, **kwargs):
        batch = original(*args, **kwargs)
        leased.set()
        time.sleep(delay_s)
        return batch

    store.get = slow_get  # type: ignore[method-assign]
    store.put("p", {"x": [1, 2]})
    return store, AsyncStore(store), leased, original


def test_a_cancelled_async_get_that_had_leased_rows_gives_them_back():
    store, aio, leased, original = _leasing_store(0.1)

    async def main():
        task = asyncio.create_task(aio.get("c", "p", ["x"], 2))
        while not leased.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run_with_deadline(main())
    assert store.metrics()["partitions"]["p"]["consumers"]["c"]["leased"] == 0
    assert original("c", "p", ["x"], 2, timeout=0).indexes == [0, 1]


def test_a_cancelled_async_put_waiting_for_room_does_not_happen_later():
    store = Store()
    store.create_partition("p", consumers=["c"], capacity_rows=1)
    store.put("p", {"x": [0]})
    aio = AsyncStore(store)

    async def main():
        task = asyncio.create_task(aio.put("p", {"x": [1]}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.ack("c", "p", [0])  # room now: a put still waiting in its thread would land
        await asyncio.sleep(0.05)

    _run_with_deadline(main())
    assert store.metrics()["partitions"]["p"]["rows"] == 0


def _saved(tmp_path):
    store = Store()
    store.create_partition("p", consumers=["c"])
    store.put("p", {"x": torch.arange(4 * 2000, dtype=torch.float32).reshape(4, 2000), "s": ["a", "b", "c", "d"]}, versions=[0, 1, 2, 3], groups=[1, 1, 2, 2])
    path = tmp_path / "store.bin"
    save(store, path)
    return path


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_store_file_with_a_flipped_bit_is_refused_not_loaded_wrong(tmp_path, where):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[8:16], "little")
    if where == "header":
        at = [k for k in range(16, 16 + header_len) if data[k : k + 1] == b"\x03"][0]  # the version 3 of row 3
    else:
        at = len(data) - 1000  # inside the tensor's raw bytes
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        load(path)


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (lambda data: data[: len(data) // 2], "checksum mismatch"),
        (lambda data: data[:12], r"file is truncated \(12 bytes\)"),
        (lambda data: b"TIDALST1" + data[8 : len(data) // 2], "file is truncated"),  # the format before checksums, cut inside a buffer
        (lambda data: b"NOTASTOR" + data[8:], "bad magic"),
    ],
)
def test_a_store_file_cut_short_or_foreign_is_refused_by_name(tmp_path, cut, message):
    path = _saved(tmp_path)
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(StoreError, match=rf"cannot load store from '{path}': .*{message}"):
        load(path)


def test_a_store_file_of_the_format_before_checksums_still_loads(tmp_path):
    path = _saved(tmp_path)
    data = path.read_bytes()
    assert data[:8] == MAGIC != b"TIDALST1"
    header_len = int.from_bytes(data[8:16], "little")
    old = b"TIDALST1" + data[8:-4]  # the old layout: no checksum at the end
    assert len(old) > 16 + header_len
    (tmp_path / "old.bin").write_bytes(old)
    batch = load(tmp_path / "old.bin").get("c", "p", ["x", "s"], 4, timeout=0)
    assert batch.columns["s"] == ["a", "b", "c", "d"] and batch.versions == [0, 1, 2, 3]
    assert torch.equal(batch.stack("x"), torch.arange(4 * 2000, dtype=torch.float32).reshape(4, 2000))


def test_a_resumed_store_keeps_consecutive_rows_together_and_gets_stay_cheap(tmp_path):
    store = Store()
    store.create_partition("p", consumers=["a", "b"])
    for k in range(20):
        store.put("p", {"x": torch.full((50, 3), k)}, versions=[k] * 50, groups=[k] * 50, tags=[{"t": k}] * 50)
    store.ack("a", "p", range(0, 60))  # a's acks alone evict nothing
    store.ack("b", "p", range(0, 30))  # rows 0..29 go (both acked): a gap before the rest
    for consumer in ("a", "b"):
        store.ack(consumer, "p", [500, 501])  # two more go: a second gap, inside a put's rows
    save(store, tmp_path / "store.bin")
    again = load(tmp_path / "store.bin")
    assert len(again._parts["p"].segments) == 2  # one per run of consecutive live rows (30..499, 502..999), not one per row
    batch = again.get("b", "p", ["x"], 470, timeout=0)
    assert batch.indexes == list(range(30, 500)) and batch.versions == [k // 50 for k in range(30, 500)]
    assert batch.groups == [k // 50 for k in range(30, 500)]
    assert torch.equal(batch.stack("x")[:, 0], torch.tensor([k // 50 for k in range(30, 500)]))
    rest = again.get("b", "p", ["x"], 498, timeout=0)
    assert rest.indexes == list(range(502, 1000))
    assert again.get("a", "p", ["x"], 938, timeout=0).indexes == [*range(60, 500), *range(502, 1000)]
    meta = again._parts["p"].metas(np.asarray([30, 999]))
    assert [m.tags for m in meta] == [{"t": 0}, {"t": 19}]


def test_a_grouped_get_from_a_partition_too_small_for_one_group_is_refused_not_left_waiting():
    from tidal.flow.store import Grouped, StalenessFilter

    store = Store()
    store.create_partition("p", consumers=["c"], capacity_rows=3)
    store.put("p", {"x": [0, 1, 2]}, groups=[0, 0, 0])  # the fourth row of group 0 can never get in
    for sampler in (Grouped(4), StalenessFilter(1, Grouped(4))):
        with pytest.raises(StoreError, match=r"group of 4 rows can never be complete.*capacity_rows=3"):
            store.get("c", "p", ["x"], 4, sampler=sampler, partial=True, timeout=5)
    assert store.get("c", "p", ["x"], 3, sampler=Grouped(3), timeout=0).indexes == [0, 1, 2]  # a group that fits is served


def test_a_put_with_an_unhashable_group_is_refused_before_it_wedges_grouped_gets():
    from tidal.flow.store import Grouped

    store = Store()
    store.create_partition("p", consumers=["c"])
    with pytest.raises(ValueError, match=r"groups\[1\] is \[0\], which is not hashable"):
        store.put("p", {"x": [1, 2]}, groups=[(0,), [0]])
    store.put("p", {"x": [3, 4]}, groups=[(0, "a"), (0, "a")])
    assert store.get("c", "p", ["x"], 2, sampler=Grouped(2), timeout=0).columns["x"] == [3, 4]


def test_a_load_holds_the_file_about_once_not_twice(tmp_path):
    """`load` read the whole file, then copied each buffer out of it: a resume peaked at
    twice the file's size. The buffers are read straight from the file now."""
    store = Store()
    store.create_partition("p", consumers=["c"])
    for k in range(8):
        store.put("p", {"x": torch.full((16, 32768), float(k))})  # 2 MB a put, 16 MB in all
    path = tmp_path / "store.bin"
    save(store, path)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        again = load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 16 * 2**20 and peak < 1.3 * size, (peak, size)
    batch = again.get("c", "p", ["x"], 128, timeout=0)
    assert torch.equal(batch.stack("x")[::16, 0], torch.arange(8.0))


def test_a_lease_or_timeout_longer_than_threads_can_wait_still_waits_for_rows_and_room():
    # lease_s: .inf ("never hand rows out again") passes the recipe check; waits past
    # threading.TIMEOUT_MAX made every get that had to wait raise OverflowError.
    store = Store()
    store.create_partition("p", consumers=["c"], capacity_rows=1, lease_s=float("inf"))
    store.put("p", {"x": [0]})
    taken = store.get("c", "p", ["x"], 1, timeout=0)
    threading.Timer(0.05, lambda: store.ack("c", "p", taken.indexes)).start()
    assert store.put("p", {"x": [1]}, timeout=float("inf")) == [1]  # waited for room
    assert store.get("c", "p", ["x"], 1, timeout=0).indexes == [1]  # leased for ever
    for row, timeout in ((2, None), (3, 1e12)):  # waits for a put, until the next lease expiry (never)
        store.ack("c", "p", [row - 1])
        threading.Timer(0.05, lambda row=row: store.put("p", {"x": [row]}, timeout=10)).start()
        assert store.get("c", "p", ["x"], 1, timeout=timeout).indexes == [row]


def test_the_lease_heap_forgets_leases_acked_long_before_their_deadline():
    """Every get pushed a heap entry that stayed until its deadline (an hour in the
    workflow) though its rows were acked at once: a run of many batches a second held
    hundreds of thousands. A lease still out keeps its entry and still expires."""
    now = [0.0]
    store = Store(clock=RealClock(now=lambda: now[0]))
    store.create_partition("p", consumers=["c"], lease_s=3600)
    store.put("p", {"x": [-1]})
    kept = store.get("c", "p", ["x"], 1, timeout=0)  # never acked
    for k in range(5000):
        store.put("p", {"x": [k]})
        store.ack("c", "p", store.get("c", "p", ["x"], 1, timeout=0).indexes)
    assert len(store._parts["p"].leases) <= 2048  # was 5001
    now[0] = 3601.0
    assert store.get("c", "p", ["x"], 1, timeout=0).indexes == kept.indexes  # expired: delivered again


def test_a_save_that_fails_while_writing_leaves_no_partial_file_and_the_last_save_whole(tmp_path, monkeypatch):
    """A write error (a full disk) left the half-written `.tmp` file behind."""
    import tidal.flow.store.persist as persist

    path = _saved(tmp_path)
    before = path.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        save(load(path), path)
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == before


def test_a_get_left_waiting_when_asyncio_run_ends_gives_its_leased_rows_back():
    """`asyncio.run` cancels every task left at its end, the call's own worker task too: a
    get whose rows were leased by then kept them leased until the lease expired."""
    store, aio, leased, original = _leasing_store(0.05)
    left: list[asyncio.Task] = []

    async def main():
        left.append(asyncio.create_task(aio.get("c", "p", ["x"], 2)))  # not awaited: asyncio.run cancels it
        while not leased.is_set():
            await asyncio.sleep(0.005)

    asyncio.run(main())
    assert left[0].cancelled()
    assert store.metrics()["partitions"]["p"]["consumers"]["c"]["leased"] == 0
    assert original("c", "p", ["x"], 2, timeout=0).indexes == [0, 1]
