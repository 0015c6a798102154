"""Who a store change wakes: the conditions waiters wait on, and the store's listeners.

A waiter waits on a condition of the store's lock chosen by what it waits for, and a
change wakes only those it may concern: a get for rows of (partition, consumer), a put
for room in a partition, a `wait_partition` for a partition to be created. Listeners
hear every change (a server retries its parked requests) and every chunk the store lets
go of (a controller frees it on its storage unit). Everything here runs with the store's
lock held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from tidal.flow.clock import REAL, Clock, ClockCondition
from tidal.flow.store.segments import Partition


class Signals:
    """The store's waiters and listeners; every method is called with `lock` held."""

    def __init__(self, lock: threading.RLock, clock: Clock = REAL) -> None:
        self._lock, self._clock = lock, clock
        self._readers: dict[tuple[str, str], ClockCondition] = {}
        self._room: dict[str, ClockCondition] = {}
        self.created = clock.condition(lock)
        """What `wait_partition` waits on; `create_partition` and whole-store changes notify it."""
        self.free_listeners: list[Callable[[str, Any], None]] = []
        self.change_listeners: list[Callable[[str | None], None]] = []

    def notify(self, part: Partition | None = None, *, columns: Iterable[str] | None = None, room: bool = False) -> None:
        """Wake the waiters a change may concern, then call the change listeners.

        No `part`: every waiter (version, releases, lease expiries, `wake`, `close`). With
        `columns`, the readers of `part` that asked for one of them (or for none): a put
        makes rows ready only for the keys it completes. With `room`, the puts waiting for
        room in `part` (acks and drops evict rows).
        """
        if part is None:
            for cond in (*self._readers.values(), *self._room.values(), self.created):
                cond.notify_all()
        else:
            if columns is not None:
                written = set(columns)
                for (name, consumer), cond in self._readers.items():  # a reader's get added its key before waiting
                    if name == part.name and any(not key or key & written for key in part.consumers[consumer].keys):
                        cond.notify_all()
            if room and part.name in self._room:
                self._room[part.name].notify_all()
        for listener in self.change_listeners:
            listener(None if part is None else part.name)

    def partition_created(self, name: str) -> None:
        """Wake `wait_partition`s; the listeners hear of `name` (a server retries what waits there)."""
        self.created.notify_all()
        for listener in self.change_listeners:
            listener(name)

    def reader(self, part: Partition, consumer: str) -> ClockCondition:
        """What a get for `consumer`'s rows of `part` waits on."""
        cond = self._readers.get((part.name, consumer))
        if cond is None:
            cond = self._readers[(part.name, consumer)] = self._clock.condition(self._lock)
        return cond

    def room_in(self, part: Partition) -> ClockCondition:
        """What a put waiting for room in `part` waits on."""
        cond = self._room.get(part.name)
        if cond is None:
            cond = self._room[part.name] = self._clock.condition(self._lock)
        return cond

    def chunk_freed(self, partition: str, chunk: Any) -> None:
        for listener in self.free_listeners:
            listener(partition, chunk)

    def remove(self, listener: Callable[..., None]) -> None:
        for listeners in (self.change_listeners, self.free_listeners):
            if listener in listeners:
                listeners.remove(listener)
