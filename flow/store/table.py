"""The in-process streaming store: partitions of rows (samples) and columns (fields).

Every stage of the RL loop talks to the others only through a store. A producer `put`s
rows or adds columns to existing rows; a consumer `get`s a batch of rows that have the
columns it asks for, as soon as enough are ready, and `ack`s them when done.

How readiness stays cheap: each consumer keeps, per set of columns it asks for, an
ordered set of rows that are ready for it. A row enters the set when its last missing
column arrives, and leaves when it is leased or acked; no request ever rescans the table.
Waiting is a condition variable: puts, acks, lease expiries and version changes wake
waiters; the only timeout a waiter sets is its own deadline or the next lease expiry.

Delivery is at least once: a row handed out is leased to that consumer until acked; an
expired lease (or `release` of a consumer that died) makes it ready again. Acks are
idempotent. A row acked by every consumer of its partition is evicted, which frees
capacity for blocked producers (back-pressure).
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tidal.flow.store.samplers import RowMeta, SampleContext, Sampler, Sequential

_WAIT_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, float("inf"))


class StoreError(RuntimeError):
    """A store call that cannot be served; the message says why."""


class StoreTimeout(StoreError, TimeoutError):
    """`get` or `put` waited for its whole timeout."""


@dataclasses.dataclass
class Batch:
    """Rows handed to a consumer. Cells are the stored objects (tensor views, no copies)."""

    partition: str
    indexes: list[int]
    columns: dict[str, list[Any]]
    groups: list[Any]
    versions: list[int | None]

    def __len__(self) -> int:
        return len(self.indexes)

    def stack(self, column: str) -> torch.Tensor:
        """The column's cells stacked into one tensor (they must share a shape)."""
        return torch.stack([torch.as_tensor(v) for v in self.columns[column]])


def nbytes_of(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (str, bytes)):
        return len(value)
    return int(getattr(value, "nbytes", 8))  # e.g. a reference to data held elsewhere


def num_rows_of(item: tuple[str, Any]) -> int:
    name, value = item
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim:
        return int(value.shape[0])
    if isinstance(value, (list, tuple)):
        return len(value)
    raise ValueError(f"column {name!r} must be a batched tensor, array or list, got {type(value).__name__}")


def _check_row_meta(num_rows: int, groups: Any, versions: Any, tags: Any) -> None:
    for name, per_row in (("groups", groups), ("versions", versions), ("tags", tags)):
        if per_row is not None and len(per_row) != num_rows:
            raise ValueError(f"{name} has {len(per_row)} entries for {num_rows} rows")


def split_rows(name: str, value: Any, num_rows: int) -> list[Any]:
    """One cell per row: a batched tensor/array splits along dim 0 into views."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0 or value.shape[0] != num_rows:
            raise ValueError(f"column {name!r} has leading dimension {tuple(value.shape)[:1]} for {num_rows} rows")
        return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value)
    if isinstance(value, (list, tuple)):
        if len(value) != num_rows:
            raise ValueError(f"column {name!r} has {len(value)} values for {num_rows} rows")
        return list(value)
    raise ValueError(f"column {name!r} must be a batched tensor, array or list, got {type(value).__name__}")


class _Row:
    __slots__ = ("meta", "columns", "nbytes", "num_acked")

    def __init__(self, meta: RowMeta) -> None:
        self.meta = meta
        self.columns: set[str] = set()
        self.nbytes = 0
        self.num_acked = 0


class _Consumer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.acked: set[int] = set()
        self.leased: dict[int, float] = {}
        self.ready: dict[frozenset[str], dict[int, None]] = {}  # column set -> ordered ready rows
        self.num_dropped = 0
        self.num_redelivered = 0
        self.wait_counts = [0] * len(_WAIT_BUCKETS)
        self.wait_sum = 0.0


class _Partition:
    def __init__(self, name: str, consumers: Iterable[str], capacity_rows: int | None, capacity_bytes: int | None, lease_s: float) -> None:
        self.name = name
        self.rows: dict[int, _Row] = {}
        self.data: dict[str, dict[int, Any]] = {}
        self.consumers = {c: _Consumer(c) for c in consumers}
        if not self.consumers:
            raise ValueError(f"partition {name!r} needs at least one consumer")
        self.capacity_rows = capacity_rows
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self.next_index = 0
        self.nbytes = 0
        self.num_evicted = 0
        self.leases: list[tuple[float, str, int]] = []  # heap of (deadline, consumer, index)


class Store:
    """A thread-safe in-process store. `runtime: local` uses it directly (zero copy)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, int, dict[str, Any]], None] | None = None,
    ) -> None:
        """`clock` times leases and timeouts; tests pass a fake one to expire leases at will.

        `on_evict(partition, index, cells)` is called (with the store's lock held, so it
        must not call back into the store) for every evicted row; a controller whose cells
        are references uses it to free the data on the storage units.
        """
        self._clock = clock
        self._evict_listeners = [on_evict] if on_evict is not None else []
        self._cond = threading.Condition()
        self._parts: dict[str, _Partition] = {}
        self._version = 0
        self._closed = False

    # Setup ------------------------------------------------------------------------------
    def create_partition(
        self,
        name: str,
        *,
        consumers: Sequence[str],
        capacity_rows: int | None = None,
        capacity_bytes: int | None = None,
        lease_s: float = 300.0,
    ) -> None:
        """Create a table. Every row stays until each of `consumers` has acked it."""
        with self._cond:
            if name in self._parts:
                raise ValueError(f"partition {name!r} already exists")
            self._parts[name] = _Partition(name, consumers, capacity_rows, capacity_bytes, lease_s)

    def add_consumer(self, partition: str, consumer: str) -> None:
        """A new consumer of `partition`; it will see every row not yet evicted."""
        with self._cond:
            part = self._part(partition)
            if consumer in part.consumers:
                raise ValueError(f"consumer {consumer!r} of partition {partition!r} already exists")
            part.consumers[consumer] = _Consumer(consumer)

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The current policy version, read by staleness-aware samplers."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    # Put --------------------------------------------------------------------------------
    def put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        *,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Add rows (`indexes=None`) or add columns to existing rows; return the indexes.

        New rows wait for capacity (back-pressure) up to `timeout` seconds, then raise
        `StoreTimeout`. `groups`, `versions` and `tags` describe new rows only.
        """
        if not columns:
            raise ValueError("put needs at least one column")
        num_rows = len(indexes) if indexes is not None else num_rows_of(next(iter(columns.items())))
        cells = {name: split_rows(name, value, num_rows) for name, value in columns.items()}
        sizes = [sum(nbytes_of(cells[c][i]) for c in cells) for i in range(num_rows)]
        _check_row_meta(num_rows, groups, versions, tags)
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            part = self._part(partition)
            if indexes is None:
                indexes = self._create_rows(part, num_rows, sum(sizes), groups, versions, tags, deadline)
            else:
                if groups is not None or versions is not None or tags is not None:
                    raise ValueError("groups, versions and tags are set when rows are created, not on later puts")
                missing = [i for i in indexes if i not in part.rows]
                if missing:
                    raise StoreError(f"partition {partition!r} has no rows {missing[:8]} (never put, or already evicted)")
            for name, per_row in cells.items():
                column = part.data.setdefault(name, {})
                for i, value in zip(indexes, per_row):
                    row = part.rows[i]
                    if name in row.columns:
                        part.nbytes -= nbytes_of(column[i])
                        row.nbytes -= nbytes_of(column[i])
                    column[i] = value
                    row.columns.add(name)
            for k, i in enumerate(indexes):
                row = part.rows[i]
                row.nbytes += sizes[k]
                part.nbytes += sizes[k]
                for consumer in part.consumers.values():
                    self._maybe_ready(consumer, row)
            self._cond.notify_all()
            return list(indexes)

    def reserve(
        self,
        partition: str,
        num_rows: int,
        *,
        nbytes: int = 0,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Create `num_rows` rows with no columns yet (never ready) and return their indexes.

        Waits for room for `num_rows` rows and `nbytes` bytes like `put`. A producer whose
        data lives on a storage unit reserves rows, writes the cells there, then `put`s
        references to them at these indexes.
        """
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        _check_row_meta(num_rows, groups, versions, tags)
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            return self._create_rows(self._part(partition), num_rows, nbytes, groups, versions, tags, deadline)

    def _create_rows(
        self,
        part: _Partition,
        num_rows: int,
        nbytes: int,
        groups: Sequence[Any] | None,
        versions: Sequence[int | None] | None,
        tags: Sequence[Mapping[str, Any]] | None,
        deadline: float | None,
    ) -> list[int]:
        self._wait_for_room(part, num_rows, nbytes, deadline)
        indexes = list(range(part.next_index, part.next_index + num_rows))
        part.next_index += num_rows
        for k, i in enumerate(indexes):
            part.rows[i] = _Row(
                RowMeta(
                    index=i,
                    group=groups[k] if groups is not None else None,
                    version=versions[k] if versions is not None else None,
                    tags=dict(tags[k]) if tags is not None else {},
                )
            )
        return indexes

    def _wait_for_room(self, part: _Partition, num_rows: int, nbytes: int, deadline: float | None) -> None:
        if part.capacity_rows is not None and num_rows > part.capacity_rows:
            raise StoreError(f"a put of {num_rows} rows can never fit partition {part.name!r} (capacity_rows={part.capacity_rows}); raise capacity_rows or put fewer rows at a time")
        if part.capacity_bytes is not None and nbytes > part.capacity_bytes:
            raise StoreError(f"a put of {nbytes} bytes can never fit partition {part.name!r} (capacity_bytes={part.capacity_bytes}); raise capacity_bytes or put fewer rows at a time")

        def full() -> bool:
            return (part.capacity_rows is not None and len(part.rows) + num_rows > part.capacity_rows) or (
                part.capacity_bytes is not None and part.nbytes + nbytes > part.capacity_bytes
            )

        while full():
            self._check_open()
            if deadline is not None and self._clock() >= deadline:
                raise StoreTimeout(
                    f"partition {part.name!r} is full ({len(part.rows)} rows, {part.nbytes} bytes); "
                    f"a put of {num_rows} rows waited for its whole timeout"
                )
            # Only evictions (acks) free room, and they notify: wait for them or the deadline.
            self._cond.wait(None if deadline is None else max(deadline - self._clock(), 0.0))

    # Get / ack --------------------------------------------------------------------------
    def get(
        self,
        consumer: str,
        partition: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        partial: bool = False,
        cancel: threading.Event | None = None,
    ) -> Batch:
        """Wait until `batch_size` rows are ready for `consumer` and lease them to it.

        With `partial=True`, return as soon as at least one row is ready (up to
        `batch_size`). Raises `StoreTimeout` after `timeout` seconds, saying how many rows
        were ready. Setting `cancel` (then calling `wake`) ends the wait with `StoreError`;
        a server does this when the waiting client disconnects.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        sampler = sampler or Sequential()
        key = frozenset(columns)
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            part = self._part(partition)
            state = part.consumers.get(consumer)
            if state is None:
                raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}; consumers: {sorted(part.consumers)}")
            ready = self._subscription(part, state, key)
            while True:
                self._check_open()
                if cancel is not None and cancel.is_set():
                    raise StoreError(f"get({consumer!r}, {partition!r}) was cancelled")
                self._expire_leases(part)
                ctx = SampleContext(version=self._version, value=lambda i, c: part.data[c][i])
                choice = sampler.select([part.rows[i].meta for i in ready], batch_size, partial, ctx)
                for i in choice.drop:
                    state.num_dropped += 1
                    self._ack_one(part, state, i)
                if choice.take:
                    break
                if deadline is not None and self._clock() >= deadline:
                    raise StoreTimeout(
                        f"get({consumer!r}, {partition!r}, {sorted(key)}) timed out after {timeout}s: "
                        f"{len(ready)} of {batch_size} rows were ready"
                    )
                self._cond.wait(self._wait_time(part, deadline))
            expiry = self._clock() + part.lease_s
            for i in choice.take:
                self._unready(state, i)
                state.leased[i] = expiry
                heapq.heappush(part.leases, (expiry, consumer, i))
            waited = self._clock() - start
            state.wait_sum += waited
            state.wait_counts[next(k for k, b in enumerate(_WAIT_BUCKETS) if waited <= b)] += 1
            return Batch(
                partition=partition,
                indexes=list(choice.take),
                columns={c: [part.data[c][i] for i in choice.take] for c in columns},
                groups=[part.rows[i].meta.group for i in choice.take],
                versions=[part.rows[i].meta.version for i in choice.take],
            )

    def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        """Mark rows done for `consumer`; return how many were newly acked (idempotent)."""
        with self._cond:
            part = self._part(partition)
            state = part.consumers.get(consumer)
            if state is None:
                raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}")
            newly = 0
            for i in indexes:
                if i >= part.next_index or i < 0:
                    raise StoreError(f"partition {partition!r} never had row {i}")
                newly += self._ack_one(part, state, i)
            self._cond.notify_all()
            return newly

    def release(self, consumer: str, partition: str | None = None, indexes: Iterable[int] | None = None) -> int:
        """Return rows leased to `consumer` (it died or disconnected) to its ready set.

        By default every row it holds in every partition; `partition` and `indexes` narrow
        it. Rows already acked or no longer leased are skipped. Returns how many came back.
        """
        with self._cond:
            parts = [self._part(partition)] if partition else list(self._parts.values())
            wanted = None if indexes is None else set(indexes)
            released = 0
            for part in parts:
                state = part.consumers.get(consumer)
                if state is None:
                    continue
                for i in [i for i in state.leased if wanted is None or i in wanted]:
                    del state.leased[i]
                    state.num_redelivered += 1
                    self._maybe_ready(state, part.rows[i])
                    released += 1
            self._cond.notify_all()
            return released

    # Internals (called with the lock held) ------------------------------------------------
    def _part(self, name: str) -> _Partition:
        part = self._parts.get(name)
        if part is None:
            raise ValueError(f"no partition {name!r}; partitions: {sorted(self._parts)}")
        return part

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _subscription(self, part: _Partition, state: _Consumer, key: frozenset[str]) -> dict[int, None]:
        ready = state.ready.get(key)
        if ready is None:
            ready = state.ready[key] = {}
            for i, row in part.rows.items():
                if key <= row.columns and i not in state.acked and i not in state.leased:
                    ready[i] = None
        return ready

    def _maybe_ready(self, state: _Consumer, row: _Row) -> None:
        i = row.meta.index
        if i in state.acked or i in state.leased:
            return
        for key, ready in state.ready.items():
            if key <= row.columns:
                ready[i] = None

    @staticmethod
    def _unready(state: _Consumer, i: int) -> None:
        for ready in state.ready.values():
            ready.pop(i, None)

    def _ack_one(self, part: _Partition, state: _Consumer, i: int) -> int:
        row = part.rows.get(i)
        if row is None or i in state.acked:
            return 0  # already acked by everyone and evicted, or by this consumer
        state.leased.pop(i, None)
        self._unready(state, i)
        state.acked.add(i)
        row.num_acked += 1
        if row.num_acked == len(part.consumers):
            self._evict(part, i)
        return 1

    def _evict(self, part: _Partition, i: int) -> None:
        row = part.rows.pop(i)
        cells = {name: part.data[name].pop(i) for name in row.columns}
        for listener in self._evict_listeners:
            listener(part.name, i, cells)
        part.nbytes -= row.nbytes
        part.num_evicted += 1
        for state in part.consumers.values():
            state.acked.discard(i)  # indexes below next_index that are gone count as acked

    def _expire_leases(self, part: _Partition) -> int:
        now, expired = self._clock(), 0
        while part.leases and part.leases[0][0] <= now:
            deadline, consumer, i = heapq.heappop(part.leases)
            state = part.consumers[consumer]
            if state.leased.get(i) == deadline:  # not acked, released or re-leased since
                del state.leased[i]
                state.num_redelivered += 1
                self._maybe_ready(state, part.rows[i])
                expired += 1
        if expired:
            self._cond.notify_all()
        return expired

    def _wait_time(self, part: _Partition, deadline: float | None) -> float | None:
        now = self._clock()
        waits = [deadline - now] if deadline is not None else []
        if part.leases:
            waits.append(max(part.leases[0][0] - now, 0.0))
        return min(waits) if waits else None

    # Introspection ----------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counts per partition, column and consumer, and each consumer's get wait times."""
        with self._cond:
            out: dict[str, Any] = {"version": self._version, "partitions": {}}
            for part in self._parts.values():
                self._expire_leases(part)
                out["partitions"][part.name] = {
                    "rows": len(part.rows),
                    "bytes": part.nbytes,
                    "evicted": part.num_evicted,
                    "ready_by_column": {c: len(cells) for c, cells in part.data.items()},
                    "consumers": {
                        s.name: {
                            "acked": len(s.acked) + part.num_evicted,
                            "leased": len(s.leased),
                            "dropped": s.num_dropped,
                            "redelivered": s.num_redelivered,
                            "ready": {",".join(sorted(k)): len(v) for k, v in s.ready.items()},
                            "wait_s": {
                                "count": sum(s.wait_counts),
                                "sum": s.wait_sum,
                                "buckets": dict(zip(map(str, _WAIT_BUCKETS), s.wait_counts)),
                            },
                        }
                        for s in part.consumers.values()
                    },
                }
            return out

    # Persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Metadata and every row not yet evicted, as plain data (see `persist.save`).

        Leased rows are saved as not consumed: after a restart they are delivered again.
        """
        with self._cond:
            parts = {}
            for part in self._parts.values():
                indexes = sorted(part.rows)
                parts[part.name] = {
                    "capacity_rows": part.capacity_rows,
                    "capacity_bytes": part.capacity_bytes,
                    "lease_s": part.lease_s,
                    "next_index": part.next_index,
                    "num_evicted": part.num_evicted,
                    "rows": [
                        [i, part.rows[i].meta.group, part.rows[i].meta.version, part.rows[i].meta.tags] for i in indexes
                    ],
                    "consumers": {s.name: sorted(s.acked) for s in part.consumers.values()},
                    "columns": {c: [[i, v] for i, v in sorted(cells.items())] for c, cells in part.data.items()},
                }
            return {"format": 1, "version": self._version, "partitions": parts}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Store:
        if state.get("format") != 1:
            raise StoreError(f"unknown store state format {state.get('format')!r}")
        store = cls()
        store._version = int(state["version"])
        for name, p in state["partitions"].items():
            store.create_partition(
                name,
                consumers=list(p["consumers"]),
                capacity_rows=p["capacity_rows"],
                capacity_bytes=p["capacity_bytes"],
                lease_s=p["lease_s"],
            )
            part = store._parts[name]
            part.next_index, part.num_evicted = p["next_index"], p["num_evicted"]
            for i, group, version, tags in p["rows"]:
                part.rows[i] = _Row(RowMeta(index=i, group=group, version=version, tags=tags))
            for column, cells in p["columns"].items():
                data = part.data.setdefault(column, {})
                for i, value in cells:
                    data[i] = value
                    part.rows[i].columns.add(column)
                    part.rows[i].nbytes += nbytes_of(value)
                    part.nbytes += nbytes_of(value)
            for consumer, acked in p["consumers"].items():
                state_c = part.consumers[consumer]
                state_c.acked = set(acked)
                for i in acked:
                    part.rows[i].num_acked += 1
        return store

    def add_evict_listener(self, listener: Callable[[str, int, dict[str, Any]], None]) -> None:
        """Also call `listener(partition, index, cells)` on every eviction (see `__init__`)."""
        with self._cond:
            self._evict_listeners.append(listener)

    def wake(self) -> None:
        """Wake every waiter so it rechecks its `cancel` event."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with `StoreError`; later calls fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
