"""The asyncio form of the store API.

Each call runs the blocking store call in a worker thread, so an event loop never blocks
on a waiting `get` or a back-pressured `put`. A `get` whose task is cancelled may still
lease rows in its thread; nobody acks them, so their lease expires and they are
delivered again (at-least-once, as for a consumer that died).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tidal.flow.store.cells import Batch
from tidal.flow.store.table import Store


class AsyncStore:
    """`await store.get(...)` over a `Store` shared with synchronous callers."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def put(self, partition: str, columns: Mapping[str, Any], indexes: Sequence[int] | None = None, **kwargs: Any) -> list[int]:
        return await asyncio.to_thread(functools.partial(self.store.put, partition, columns, indexes, **kwargs))

    async def get(self, consumer: str, partition: str, columns: Sequence[str], batch_size: int, **kwargs: Any) -> Batch:
        return await asyncio.to_thread(functools.partial(self.store.get, consumer, partition, columns, batch_size, **kwargs))

    async def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        return self.store.ack(consumer, partition, indexes)  # never blocks beyond the lock
