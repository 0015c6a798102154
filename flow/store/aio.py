"""The asyncio form of the store API.

Each call runs the blocking store call in a worker thread, so an event loop never blocks
on a waiting `get` or a back-pressured `put`. Cancelling the task of a waiting call ends
its thread too (the call's `cancel` event is set and the store woken), so a run that
stops by cancelling its tasks leaves no thread waiting for ever (which would also hang
`asyncio.run` at exit). A cancelled `get` that had already leased rows gives them back
at once (they are ready again, not held until their lease expires); a cancelled `put`
that was still waiting for room does not happen. A put that had already landed when the
cancel came keeps its rows: the store never drops rows it has taken.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from tidal.flow.store.cells import Batch
from tidal.flow.store.protocol import StoreApi

T = TypeVar("T")


class AsyncStore:
    """`await store.get(...)` over a store shared with synchronous callers (in process, or a
    `RemoteStore`): an `AsyncStoreApi`."""

    def __init__(self, store: StoreApi) -> None:
        self.store = store

    async def put(self, partition: str, columns: Mapping[str, Any], indexes: Sequence[int] | None = None, **kwargs: Any) -> list[int]:
        _refuse_cancel(kwargs)
        return await self._call(lambda cancel: self.store.put(partition, columns, indexes, cancel=cancel, **kwargs), undo=None)

    async def get(self, consumer: str, partition: str, columns: Sequence[str], batch_size: int, **kwargs: Any) -> Batch:
        _refuse_cancel(kwargs)

        def give_back(batch: Batch) -> None:
            self.store.release(consumer, partition, batch.index_array)

        return await self._call(lambda cancel: self.store.get(consumer, partition, columns, batch_size, cancel=cancel, **kwargs), undo=give_back)

    async def wait_partition(self, name: str, *, timeout: float | None = None) -> None:
        await self._call(lambda cancel: self.store.wait_partition(name, timeout=timeout, cancel=cancel), undo=None)

    async def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        return self.store.ack(consumer, partition, indexes)  # never blocks beyond the lock

    async def _call(self, call: Callable[[threading.Event], T], *, undo: Callable[[T], None] | None) -> T:
        """Run `call(cancel)` in a worker thread; if this task is cancelled, end the call
        through `cancel`, wait for its thread, `undo` a result it still produced, and
        re-raise the cancellation."""
        cancel = threading.Event()
        # a plain future, not a task (as `asyncio.to_thread` makes): `asyncio.run` cancels the
        # tasks left at its end, and a cancelled one would hide the rows its call still leased
        future = asyncio.get_running_loop().run_in_executor(None, functools.partial(contextvars.copy_context().run, call, cancel))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancel.set()
            self.store.wake()
            await _settled(future)
            if not future.cancelled() and future.exception() is None and undo is not None:  # reading the exception retrieves it: the caller hears of the cancellation
                undo(future.result())
            raise


async def _settled(future: asyncio.Future[Any]) -> None:
    """Wait until `future` is done, through further cancellations of this task: its
    thread ends at once (it was told to), and what it did must be known before the
    cancellation goes on."""
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            continue


def _refuse_cancel(kwargs: Mapping[str, Any]) -> None:
    if "cancel" in kwargs:
        raise ValueError("AsyncStore calls take no cancel= event: cancel the task that awaits the call instead")
