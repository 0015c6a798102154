"""The in-process streaming store: partitions of rows (samples) and columns (fields).

Every stage of the RL loop talks to the others only through a store. A producer `put`s
rows or adds columns to existing rows; a consumer `get`s a batch of rows that have the
columns it asks for, as soon as enough are ready, and `ack`s them when done.

How it stays fast: data is kept the way it arrived. A put of a batched tensor keeps that
tensor as one chunk; each row's cell is (chunk, offset), so nothing is split, copied or
pickled, and `Batch.stack` of rows that arrived together is a view. Row state lives in
numpy arrays per segment (the rows one put created): which columns each row has and
when they arrived, and per consumer whether it acked or leased the row. A `get` computes
the ready rows with a few vector operations per live segment instead of touching Python
objects per row. Waiting is a condition variable: puts, acks, lease expiries and version
changes wake waiters; the only timeout a waiter sets is its own deadline or the next
lease expiry.

Delivery is at least once: a row handed out is leased to that consumer until acked; an
expired lease (or `release` of a consumer that died) makes it ready again, after the rows
that were already ready. Acks are idempotent. A row acked by every consumer of its
partition is evicted, which frees capacity for blocked producers (back-pressure). A
chunk's memory is freed once every row using it is evicted or overwritten.
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, overload

import numpy as np

from tidal.flow.clock import REAL, Clock, ClockEvent
from tidal.flow.store.cells import Batch, Cells, as_indexes, cell_sizes, check_column, check_row_meta, distinct_rows, num_rows_of_put, row_nbytes, unique_sorted
from tidal.flow.store.errors import StoreError, StoreTimeout
from tidal.flow.store.evict import ack_rows, replace_cells
from tidal.flow.store.samplers import SampleContext, Sampler, Sequential, group_size_of
from tidal.flow.store.segments import WAIT_BUCKETS, Column, Partition, Segment, check_partition_settings
from tidal.flow.store.signals import Signals
from tidal.flow.store.state import restore, state_of


class Done:
    """A put that has already happened: `result()` returns its indexes."""

    def __init__(self, indexes: list[int]) -> None:
        self._indexes = indexes

    def result(self) -> list[int]:
        return self._indexes


class Store:
    """A thread-safe in-process store. `runtime: local` uses it directly (zero copy)."""

    def __init__(self, *, clock: Clock = REAL) -> None:
        """`clock` times leases and timeouts and makes the conditions waiters wait on (a
        simulation's virtual clock; a test's `RealClock(now=...)` expires leases at will)."""
        self._clock = clock.now
        self._lock = threading.RLock()
        self._signals = Signals(self._lock, clock)  # waiters wait on conditions of this lock by what they wait for
        self._parts: dict[str, Partition] = {}
        self._version = 0
        self._stamp = 0
        self._closed = False

    # Setup ------------------------------------------------------------------------------
    def create_partition(self, name: str, *, consumers: Sequence[str], capacity_rows: int | None = None, capacity_bytes: int | None = None, lease_s: float = 300.0, exist_ok: bool = False) -> None:
        """Create a table. Every row stays until each of `consumers` has acked it.

        With `exist_ok`, a partition `name` that exists with these settings is taken as it
        is, so a producer and a consumer may each create it, in either order; one with
        other settings is a ValueError naming them. A consumer that does not know the
        settings waits for the partition instead (`wait_partition`)."""
        with self._lock:
            part = self._parts.get(name)
            if part is not None:
                if not exist_ok:
                    raise ValueError(f"partition {name!r} already exists; create_partition(..., exist_ok=True) takes it as it is")
                part.check_same(consumers, capacity_rows, capacity_bytes, lease_s)
                return
            self._parts[name] = Partition(name, consumers, capacity_rows, capacity_bytes, lease_s)
            self._signals.partition_created(name)

    def wait_partition(self, name: str, *, timeout: float | None = None, cancel: ClockEvent | None = None) -> None:
        """Return once partition `name` exists (at once if it does): a consumer that may
        start before its producer created it. Raises `StoreTimeout` after `timeout`
        seconds, naming the partitions that exist; setting `cancel` (then `wake`) ends
        the wait with `StoreError`."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._lock:
            while name not in self._parts:
                self._check_open()
                if cancel is not None and cancel.is_set():
                    raise StoreError(f"wait_partition({name!r}) was cancelled")
                if deadline is not None and self._clock() >= deadline:
                    raise StoreTimeout(f"wait_partition({name!r}) timed out after {timeout}s: no partition {name!r}; partitions: {sorted(self._parts)}")
                self._signals.created.wait(self._left(deadline))

    def configure_partition(self, name: str, *, capacity_rows: int | None = None, lease_s: float | None = None) -> None:
        """Set a partition's row capacity and lease (those given; a resumed run's settings)."""
        check_partition_settings(name, capacity_rows=capacity_rows, lease_s=lease_s)
        with self._lock:
            part = self._part(name)
            part.capacity_rows = part.capacity_rows if capacity_rows is None else capacity_rows
            part.lease_s = part.lease_s if lease_s is None else lease_s
            self._notify()  # puts waiting for room look again

    def add_consumer(self, partition: str, consumer: str) -> None:
        """A new consumer of `partition`; it will see every row not yet evicted."""
        with self._lock:
            part = self._part(partition)
            if consumer in part.consumers:
                raise ValueError(f"consumer {consumer!r} of partition {partition!r} already exists")
            part.add_consumer(consumer)

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The store's (reentrant) lock: hold it to make several calls one atomic step."""
        return self._lock

    def add_free_listener(self, listener: Callable[[str, Any], None]) -> None:
        """Call `listener(partition, chunk)` when the store lets go of a chunk (every row
        using it evicted or overwritten); a controller whose chunks live on storage units
        uses it to free them there. Called with the lock held: it must not call back."""
        with self._lock:
            self._signals.free_listeners.append(listener)

    def add_change_listener(self, listener: Callable[[str | None], None]) -> None:
        """Call `listener(partition)` whenever waiters are woken: after puts, acks and rows
        a sampler dropped with the partition that changed, after version changes,
        releases, lease expiries, `wake` and `close` with None (they may concern every
        partition). It runs in the thread that made the change, with the lock held; it may
        call the store (the lock is reentrant) but must not wait for another thread that
        needs the lock."""
        with self._lock:
            self._signals.change_listeners.append(listener)

    def remove_listener(self, listener: Callable[..., None]) -> None:
        """Stop calling `listener` (a change or free listener); unknown ones are ignored."""
        with self._lock:
            self._signals.remove(listener)

    def _notify(self, part: Partition | None = None, *, columns: Iterable[str] | None = None, room: bool = False) -> None:
        self._signals.notify(part, columns=columns, room=room)

    def consumer_counts(self, partition: str, consumer: str) -> dict[str, int]:
        """Cheap counters of one consumer: rows acked, dropped by its sampler, redelivered."""
        with self._lock:
            part = self._part(partition)
            if consumer not in part.consumers:
                raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}")
            state = part.consumers[consumer]
            return {"acked": state.num_acked, "dropped": state.num_dropped, "redelivered": state.num_redelivered}

    def next_lease_expiry(self) -> float | None:
        """When the earliest outstanding lease expires (store clock), or None."""
        with self._lock:
            for part in self._parts.values():
                self._expire_leases(part)  # redelivers what expired, and drops its heap entries
            deadlines = [part.leases[0][0] for part in self._parts.values() if part.leases]
            return min(deadlines) if deadlines else None

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """The current policy version, read by staleness-aware samplers."""
        with self._lock:
            self._version = version
            self._notify()

    # Put --------------------------------------------------------------------------------
    @overload
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
        cancel: ClockEvent | None = None,
        ack: tuple[str, str, Sequence[int] | np.ndarray] | None = None,
        as_range: Literal[False] = False,
        num_rows: int | None = None,
    ) -> list[int]: ...

    @overload
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
        cancel: ClockEvent | None = None,
        ack: tuple[str, str, Sequence[int] | np.ndarray] | None = None,
        as_range: bool,
        num_rows: int | None = None,
    ) -> range | list[int]: ...

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
        cancel: ClockEvent | None = None,
        ack: tuple[str, str, Sequence[int] | np.ndarray] | None = None,
        as_range: bool = False,
        num_rows: int | None = None,
    ) -> range | list[int]:
        """Add rows (`indexes=None`) or add columns to existing rows; return the indexes
        (new rows as a `range` with `as_range=True`: no list per row, for a server).
        Each column holds one cell per row along dim 0 (a batched tensor or array) or per
        item (a list). A put of new rows whose columns are all 1-D tensors needs
        `num_rows` (`{"x": torch.zeros(256)}`: 256 rows of one value, or one row of 256?).

        `ack=(consumer, partition, indexes)` acks those rows in the same atomic step as
        the put: a stage that turns input rows into output rows (rollout: prompts ->
        trajectories) either does both or neither, so a crash between the two can never
        deliver the input again after its output is in (exactly-once hand-off).

        New rows wait for capacity (back-pressure) up to `timeout` seconds, then raise
        `StoreTimeout`; setting `cancel` (then `wake`) ends the wait with `StoreError`.
        `groups`, `versions` and `tags` describe new rows only. The store keeps the column
        objects it is given (no copy): do not modify them afterwards. It keeps any object;
        to be saved or served to another process a value must be one the codec carries
        (`codec`), else that save or get fails with `CodecError` naming its column and row.
        """
        if not columns:
            raise ValueError("put needs at least one column")
        num_rows = num_rows_of_put(columns, indexes, num_rows)
        chunks = {name: check_column(name, value, num_rows) for name, value in columns.items()}
        row_sizes = {name: row_nbytes(chunk) for name, chunk in chunks.items()}  # -1: sizes differ per row
        sizes = {name: cell_sizes(chunk) for name, chunk in chunks.items() if row_sizes[name] < 0 or indexes is not None}
        check_row_meta(num_rows, groups, versions, tags)
        deadline = None if timeout is None else self._clock() + timeout
        with self._lock:
            then_ack = self._check_ack(ack)
            part = self._part(partition)
            if num_rows == 0:  # nothing to hold: no segment, no chunk kept at refcount 0 (only the ack, if any)
                if then_ack is not None:
                    self._ack_many(*then_ack)
                    self._notify(then_ack[0], room=True)
                return range(0) if as_range else []
            if indexes is None:
                total = sum(size * num_rows if size >= 0 else int(sizes[name].sum()) for name, size in row_sizes.items())
                freed = self._freed_by(part, then_ack)
                start = self._create_rows(part, num_rows, total, groups, versions, tags, deadline, cancel, freed)
                seg = part.segments[-1]
                self._stamp += 1
                for name, chunk in chunks.items():  # the new segment's cells are the chunks' rows, in order
                    chunk_id = part.next_chunk
                    part.next_chunk += 1
                    part.chunks[chunk_id], part.chunk_refs[chunk_id] = chunk, num_rows
                    size = row_sizes[name]
                    seg.columns[name] = Column.lazy(seg.alive, chunk_id, self._stamp, size) if size >= 0 else Column.of_chunk(seg.alive, chunk_id, self._stamp, sizes[name])
                part.nbytes += total
                result: range | list[int] = range(start, start + num_rows)
            else:
                if groups is not None or versions is not None or tags is not None:
                    raise ValueError("groups, versions and tags are set when rows are created, not on later puts")
                where = distinct_rows(partition, indexes)
                found = np.zeros(len(where), dtype=bool)
                for seg, local, positions in part.locate(where):
                    found[positions] = seg.alive[local]
                if not found.all():
                    missing = where[~found][:8].tolist()
                    raise StoreError(f"partition {partition!r} has no rows {missing} (never put, or already evicted)")
                self._stamp, before = self._stamp + 1, part.nbytes
                for name, chunk in chunks.items():
                    replace_cells(part, name, chunk, sizes[name], where, stamp=self._stamp, on_free=self._signals.chunk_freed)
                result, smaller = where.tolist(), part.nbytes < before  # smaller cells free room too
            if then_ack is not None:
                self._ack_many(*then_ack)
                if then_ack[0] is not part:
                    self._notify(then_ack[0], room=True)
            self._notify(part, columns=chunks, room=(then_ack is not None and then_ack[0] is part) or (indexes is not None and smaller))
            return result if as_range or isinstance(result, list) else list(result)

    def submit_put(self, partition: str, columns: Mapping[str, Any], indexes: Sequence[int] | None = None, **kwargs: Any) -> Done:
        """`put`, in the form `RemoteStore.submit_put` has (in process it is done already)."""
        return Done(self.put(partition, columns, indexes, **kwargs))

    def _check_ack(self, ack: tuple[str, str, Sequence[int] | np.ndarray] | None) -> tuple[Partition, str, np.ndarray] | None:
        """A put's `ack=` checked before anything changes (a bad ack leaves no half-done put)."""
        if ack is None:
            return None
        consumer, partition, indexes = ack
        part = self._part(partition)
        if consumer not in part.consumers:
            raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}")
        return part, consumer, part.had(as_indexes(indexes))

    def _create_rows(
        self,
        part: Partition,
        num_rows: int,
        nbytes: int,
        groups: Sequence[Any] | None,
        versions: Sequence[int | None] | None,
        tags: Sequence[Mapping[str, Any]] | None,
        deadline: float | None,
        cancel: ClockEvent | None = None,
        freed: Callable[[], tuple[int, int]] | None = None,
    ) -> int:
        """Make `num_rows` rows (a new segment, last in `part.segments`); return the first index."""
        self._wait_for_room(part, num_rows, nbytes, deadline, cancel, freed)
        start = part.next_index
        part.add_segment(Segment(start, num_rows, groups, versions, tags, part.consumers))
        part.next_index += num_rows
        part.num_rows += num_rows
        return start

    def _freed_by(self, part: Partition, ack: tuple[Partition, str, np.ndarray] | None) -> Callable[[], tuple[int, int]] | None:
        """For a put whose `ack` acks rows of the partition it puts into (rollout handing groups
        back to `prompts`): the room that ack frees, which the put may count on (else a full
        partition would wait for the very rows the put frees). Asked after each wait."""
        if ack is None or ack[0] is not part:
            return None
        consumer, where = ack[1], unique_sorted(ack[2])
        return lambda: part.freed_by_ack(consumer, where)

    def _wait_for_room(self, part: Partition, num_rows: int, nbytes: int, deadline: float | None, cancel: ClockEvent | None = None, freed: Callable[[], tuple[int, int]] | None = None) -> None:
        if part.capacity_rows is not None and num_rows > part.capacity_rows:
            raise StoreError(f"a put of {num_rows} rows can never fit partition {part.name!r} (capacity_rows={part.capacity_rows}); raise capacity_rows or put fewer rows at a time")
        if part.capacity_bytes is not None and nbytes > part.capacity_bytes:
            raise StoreError(f"a put of {nbytes} bytes can never fit partition {part.name!r} (capacity_bytes={part.capacity_bytes}); raise capacity_bytes or put fewer rows at a time")

        def full() -> bool:
            freed_rows, freed_bytes = freed() if freed is not None else (0, 0)
            return (part.capacity_rows is not None and part.num_rows - freed_rows + num_rows > part.capacity_rows) or (
                part.capacity_bytes is not None and part.nbytes - freed_bytes + nbytes > part.capacity_bytes
            )

        while full():
            self._check_open()
            if cancel is not None and cancel.is_set():
                raise StoreError(f"put into {part.name!r} was cancelled")
            if deadline is not None and self._clock() >= deadline:
                raise StoreTimeout(
                    f"partition {part.name!r} is full ({part.num_rows} rows, {part.nbytes} bytes); "
                    f"a put of {num_rows} rows waited for its whole timeout"
                )
            # Only evictions (acks) free room, and they notify: wait for them or the deadline.
            self._signals.room_in(part).wait(self._left(deadline))

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
        cancel: ClockEvent | None = None,
        waiting_since: float | None = None,
        ack: Iterable[int] | None = None,
        holder: int = 0,
        describe_timeout: bool = True,
    ) -> Batch:
        """Wait until `batch_size` rows are ready for `consumer` and lease them to it.

        With `partial=True`, return as soon as at least one row is ready (up to
        `batch_size`). Raises `StoreTimeout` after `timeout` seconds, saying how many rows
        were ready. Setting `cancel` (then calling `wake`) ends the wait with `StoreError`;
        a server does this when the waiting client disconnects. `waiting_since` (store
        clock) is when the caller started waiting, for the wait-time histogram, when it
        waited elsewhere before this call. `ack` acks those rows first (the previous
        batch), saving a round trip per batch between processes. `holder` (a nonzero id)
        records who holds the lease, so `release_holder` can return exactly its rows; a
        server passes one per client connection. `describe_timeout=False` leaves the
        description (ready rows, the partition's columns: a look at every segment) out of
        a `StoreTimeout`, for a caller that tries again and describes only the timeout it
        gives up on: a server retrying a waiting get after every put.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(columns, str):  # else a get of "reward" waits for columns 'r', 'e', 'w', 'a', 'd'
            raise ValueError(f"columns must be a list of column names, got the string {columns!r}; pass [{columns!r}]")
        sampler = sampler or Sequential()
        sequential = type(sampler) is Sequential  # it takes rows only once enough are ready, and drops none
        key = frozenset(columns)
        start = self._clock()
        since = start if waiting_since is None else waiting_since
        deadline = None if timeout is None else start + timeout
        with self._lock:
            part = self._part(partition)
            state = part.consumers.get(consumer)
            if state is None:
                raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}; consumers: {sorted(part.consumers)}")
            if not partial and part.capacity_rows is not None and batch_size > part.capacity_rows:
                raise StoreError(f"a get of {batch_size} rows can never be served by partition {partition!r} (capacity_rows={part.capacity_rows}): its producers block first")
            group_size = group_size_of(sampler)
            if group_size is not None and part.capacity_rows is not None and group_size > part.capacity_rows:
                raise StoreError(f"a group of {group_size} rows can never be complete in partition {partition!r} (capacity_rows={part.capacity_rows}): its producers block first; raise capacity_rows to at least the group size")
            state.keys.add(key)
            if ack is not None:
                where = part.had(as_indexes(ack))
                if len(where):
                    self._ack_many(part, consumer, where)
                    self._notify(part, room=True)
            while True:
                self._check_open()
                if cancel is not None and cancel.is_set():
                    raise StoreError(f"get({consumer!r}, {partition!r}) was cancelled")
                self._expire_leases(part)
                if not sequential or part.could_take(consumer, key, 1 if partial else batch_size):
                    rows = part.ready(consumer, key, batch_size if sequential else None)
                    ctx = SampleContext(version=self._version, value=lambda i, c: self._cell(part, i, c))
                    choice = sampler.select(rows, batch_size, partial, ctx)
                    if len(choice.drop):
                        state.num_dropped += self._ack_many(part, consumer, np.asarray(choice.drop, dtype=np.int64))
                        self._notify(part, room=True)  # the drops freed room, and whoever counts them (admission) must hear
                    if len(choice.take):
                        break
                if deadline is not None and self._clock() >= deadline:
                    raise StoreTimeout(part.timed_out(consumer, key, batch_size, timeout) if describe_timeout else "not ready")
                self._signals.reader(part, consumer).wait(self._wait_time(part, deadline))
            take = choice.take if isinstance(choice.take, range) and choice.take.step == 1 else as_indexes(choice.take)
            take, versions, groups, blocks = part.lease(consumer, take, columns, self._clock() + part.lease_s, holder)
            waited = self._clock() - since
            state.wait_sum += waited
            state.wait_counts[min(bisect.bisect_left(WAIT_BUCKETS, waited), len(WAIT_BUCKETS) - 1)] += 1
            return Batch(partition, take, Cells(blocks), groups, versions, blocks=blocks)

    def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        """Mark rows done for `consumer`; return how many were newly acked (idempotent)."""
        where = as_indexes(indexes)
        with self._lock:
            part = self._part(partition)
            if consumer not in part.consumers:
                raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}")
            newly = self._ack_many(part, consumer, part.had(where))
            self._notify(part, room=True)
            return newly

    def release(self, consumer: str, partition: str | None = None, indexes: Iterable[int] | None = None) -> int:
        """Return rows leased to `consumer` (it died or disconnected) to its ready set.

        By default every row it holds in every partition (none where it is no consumer);
        `partition` and `indexes` narrow it, and a named partition must have `consumer`.
        Rows already acked or no longer leased are skipped. Returns how many came back.
        """
        with self._lock:
            parts = [self._part(partition)] if partition else list(self._parts.values())
            if partition and consumer not in parts[0].consumers:
                raise ValueError(f"{consumer!r} is not a consumer of partition {partition!r}")
            released = 0
            for part in parts:
                if consumer not in part.consumers:
                    continue
                if indexes is None:
                    pieces = [(seg, np.flatnonzero(seg.lease[consumer] > 0)) for seg in part.segments]
                else:
                    pieces = [(seg, local) for seg, local, _ in part.locate(unique_sorted(as_indexes(indexes)))]
                released += self._redeliver(part, consumer, pieces)
            self._notify()
            return released

    def release_holder(self, holder: int) -> int:
        """Return every row still leased to `holder` (see `get`) to its consumer's ready set."""
        with self._lock:
            released = 0
            for part in self._parts.values():
                for consumer in part.consumers:
                    pieces = []
                    for seg in part.segments:
                        held = seg.holder.get(consumer)
                        if held is not None:
                            pieces.append((seg, np.flatnonzero((held == holder) & (seg.lease[consumer] > 0))))
                    released += self._redeliver(part, consumer, pieces)
            self._notify()
            return released

    # Internals (called with the lock held) ------------------------------------------------
    def _part(self, name: str) -> Partition:
        part = self._parts.get(name)
        if part is None:
            raise ValueError(f"no partition {name!r}; partitions: {sorted(self._parts)} (wait_partition({name!r}) waits until it is created)")
        return part

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")

    def _cell(self, part: Partition, index: int, column: str) -> Any:
        for seg, local, _ in part.locate(np.asarray([index], dtype=np.int64)):
            cells = seg.columns.get(column)
            chunk_id, offset = cells.cell(int(local[0])) if cells is not None else (-1, 0)
            if chunk_id < 0:  # a sampler reading a column the get did not ask for (ready rows have those)
                raise ValueError(f"row {index} of partition {part.name!r} has no column {column!r}; a sampler that reads a column needs the get to ask for it")
            return part.chunks[chunk_id][offset]
        raise StoreError(f"partition {part.name!r} has no row {index}")

    def _ack_many(self, part: Partition, consumer: str, where: np.ndarray) -> int:
        return ack_rows(part, consumer, where, self._signals.chunk_freed)

    def _redeliver(self, part: Partition, consumer: str, pieces: Iterable[tuple[Segment, np.ndarray]]) -> int:
        count = 0
        self._stamp += 1
        for seg, local in pieces:
            local = local[(seg.lease[consumer][local] > 0) & seg.alive[local] & ~seg.acked[consumer][local]]
            if not len(local):
                continue
            seg.lease[consumer][local] = 0
            seg.redeliveries(consumer)[local] = self._stamp
            if len(local):
                part.wake(seg)
            count += len(local)
        part.consumers[consumer].num_redelivered += count
        return count

    def _expire_leases(self, part: Partition) -> int:
        now, expired = self._clock(), 0
        while part.leases and part.leases[0][0] <= now:
            deadline, _, consumer, indexes = heapq.heappop(part.leases)
            pieces = [(seg, local[seg.lease[consumer][local] == deadline]) for seg, local, _ in part.locate(as_indexes(indexes))]
            expired += self._redeliver(part, consumer, pieces)  # skips rows acked, released or re-leased since
        if expired:
            self._notify()
        return expired

    def _left(self, deadline: float | None) -> float | None:
        """How long a condition wait until `deadline` (store clock) may take; None: no bound."""
        return _bounded(None if deadline is None else max(deadline - self._clock(), 0.0))

    def _wait_time(self, part: Partition, deadline: float | None) -> float | None:
        now = self._clock()
        waits = [deadline - now] if deadline is not None else []
        if part.leases:
            waits.append(max(part.leases[0][0] - now, 0.0))
        return _bounded(min(waits)) if waits else None

    # Introspection ----------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Counts per partition, column and consumer, and each consumer's get wait times."""
        with self._lock:
            out: dict[str, Any] = {"version": self._version, "partitions": {}}
            for part in self._parts.values():
                self._expire_leases(part)
                out["partitions"][part.name] = part.metrics()
            return out

    # Persistence (the work is in `persist`) ----------------------------------------------
    def state_dict(self, *, read_chunk: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """Metadata and every row not yet evicted, as plain data (see `persist.save`;
        `read_chunk` reads the rows a split deployment keeps on storage units).

        Leased rows are saved as not consumed: after a restart they are delivered again.
        """
        with self._lock:
            return state_of(self._version, self._parts.values(), read_chunk)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, clock: Clock = REAL) -> Store:
        store = cls(clock=clock)
        restore(store, state, partition_of=store._part)
        return store

    def wake(self) -> None:
        """Wake every waiter so it rechecks its `cancel` event."""
        with self._lock:
            self._notify()

    def close(self) -> None:
        """Wake every waiter with `StoreError`; later calls fail."""
        with self._lock:
            self._closed = True
            self._notify()


def _bounded(wait: float | None) -> float | None:
    """A condition wait of `wait` seconds as threading takes it: None (until notified) for one
    longer than it can time (an infinite lease or timeout), which would raise OverflowError."""
    return None if wait is not None and wait >= threading.TIMEOUT_MAX else wait
