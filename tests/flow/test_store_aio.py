"""The asyncio form of the store when the event loop itself ends its tasks."""

from __future__ import annotations

import asyncio
import threading
import time

from tidal.flow.store import AsyncStore, Store


def test_a_get_left_waiting_when_asyncio_run_ends_gives_its_leased_rows_back():
    """`asyncio.run` cancels every task left at its end, the call's own worker task too: a
    get whose rows were leased by then kept them leased until the lease expired."""
    store = Store()
    store.create_partition("p", consumers=["c"])
    leased = threading.Event()
    aio = AsyncStore(store)
    original = store.get

    def slow_get(*args, **kwargs):  # the rows are leased before the cancel reaches the thread
        batch = original(*args, **kwargs)
        leased.set()
        time.sleep(0.05)
        return batch

    store.get = slow_get  # type: ignore[method-assign]
    store.put("p", {"x": [1, 2]})

    left: list[asyncio.Task] = []

    async def main():
        left.append(asyncio.create_task(aio.get("c", "p", ["x"], 2)))  # not awaited: asyncio.run cancels it
        while not leased.is_set():
            await asyncio.sleep(0.005)

    asyncio.run(main())
    assert left[0].cancelled()
    assert store.metrics()["partitions"]["p"]["consumers"]["c"]["leased"] == 0
    assert original("c", "p", ["x"], 2, timeout=0).indexes == [0, 1]
