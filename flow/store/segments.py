"""The store's row state: numpy arrays per segment (the rows one put created).

Per segment: which rows are alive, their groups, versions and tags, where each column's
cell lives (chunk id and offset), when it arrived (readiness order), and per consumer
whether it acked or leased each row. Per partition: the live segments in index order,
the chunks they point into, capacity and the lease heap, and the reads a get makes of
them (`Partition.ready`: the ready rows; `lease_blocks` / `column_block`: lease rows and
cut their cells into chunk blocks). `Store` does the rest of the bookkeeping, under its lock.

The usual life of a segment - one put of batched tensors, read whole by each consumer,
acked, evicted - needs almost no per-row state: a column that is row k of one chunk for
every row is kept as that summary (`Column.whole`) and gets per-row arrays only if a later
put changes some of its rows, and a segment no row of which a consumer has touched yet is
`fresh` for it (every row ready). `Store` takes those shortcuts; everything else works on
the arrays.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tidal.flow.store.cells import as_indexes
from tidal.flow.store.errors import StoreError
from tidal.flow.store.ready import ReadyIndex
from tidal.flow.store.samplers import NO_VERSION, RowMeta, Rows

_lease_seq = itertools.count(1)
"""Orders leases with the same deadline on a partition's heap."""

WAIT_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, float("inf"))
"""Upper bounds (seconds) of the get wait-time histogram."""
LEASES_COMPACT_MIN = 1024
"""A partition's lease heap is never compacted below this many entries."""


class Column:
    """Where one column's cells of one segment live.

    Summaries that let the usual case skip per-row work: `whole` is the chunk id when
    the cell of every live row k is row k of that one chunk, else -1 (so contiguous rows
    are a slice of it); `full` says every live row has a cell; `same_stamp` is the arrival
    stamp shared by every present cell, else -1; `row_nbytes` is the size shared by every
    present cell, else -1. A column made `lazy` (a put of new rows whose chunk has a fixed
    row size) holds only these and makes its per-row arrays (`chunk`, `offset`, `stamp`,
    `nbytes`) on first use; a dead row's cell is absent (chunk -1) there.
    """

    __slots__ = ("_alive", "_chunk", "_nbytes", "_offset", "_stamp", "full", "row_nbytes", "same_stamp", "whole")

    def __init__(self, alive: np.ndarray) -> None:
        n = len(alive)
        self._alive = alive  # the segment's (mutated in place, never replaced)
        self._chunk: np.ndarray | None = np.full(n, -1, dtype=np.int64)  # chunk id, -1 = absent
        self._offset: np.ndarray | None = np.zeros(n, dtype=np.int64)
        self._stamp: np.ndarray | None = np.zeros(n, dtype=np.int64)  # when the cell arrived (readiness order)
        self._nbytes: np.ndarray | None = np.zeros(n, dtype=np.int64)
        self.whole, self.full, self.same_stamp, self.row_nbytes = -1, False, -1, -1

    @property
    def uniform(self) -> bool:
        """Every live row k has a cell, row k of chunk `whole`, `row_nbytes` bytes each."""
        return self.full and self.whole >= 0 and self.row_nbytes >= 0

    @classmethod
    def lazy(cls, alive: np.ndarray, chunk_id: int, stamp: int, row_nbytes: int) -> Column:
        """Every row k is row k of chunk `chunk_id`, `row_nbytes` each (a put of new rows)."""
        column = cls.__new__(cls)
        column._alive = alive
        column._chunk = column._offset = column._stamp = column._nbytes = None
        column.whole, column.full, column.same_stamp, column.row_nbytes = chunk_id, True, stamp, row_nbytes
        return column

    @classmethod
    def of_chunk(cls, alive: np.ndarray, chunk_id: int, stamp: int, nbytes: np.ndarray) -> Column:
        """Every row k is row k of chunk `chunk_id` (a list chunk: sizes per row)."""
        column = cls(alive)
        column._chunk[:] = chunk_id  # type: ignore[index]
        column._offset = np.arange(len(alive), dtype=np.int64)
        column._stamp[:] = stamp  # type: ignore[index]
        column._nbytes = nbytes
        column.whole, column.full, column.same_stamp = chunk_id, True, stamp
        return column

    @property
    def is_lazy(self) -> bool:
        return self._chunk is None

    def _materialize(self) -> None:
        n = len(self._alive)
        self._chunk = np.where(self._alive, self.whole, -1).astype(np.int64)
        self._offset = np.arange(n, dtype=np.int64)
        self._stamp = np.full(n, self.same_stamp, dtype=np.int64)
        self._nbytes = np.full(n, self.row_nbytes, dtype=np.int64)

    @property
    def chunk(self) -> np.ndarray:
        if self._chunk is None:
            self._materialize()
        return self._chunk  # type: ignore[return-value]

    @property
    def offset(self) -> np.ndarray:
        if self._offset is None:
            self._materialize()
        return self._offset  # type: ignore[return-value]

    @property
    def stamp(self) -> np.ndarray:
        if self._stamp is None:
            self._materialize()
        return self._stamp  # type: ignore[return-value]

    @property
    def nbytes(self) -> np.ndarray:
        if self._nbytes is None:
            self._materialize()
        return self._nbytes  # type: ignore[return-value]

    def cell(self, k: int) -> tuple[int, int]:
        """(chunk id, offset) of row k's cell; chunk id -1 when absent."""
        if self._chunk is None:
            return (self.whole, k) if self._alive[k] else (-1, 0)
        return int(self._chunk[k]), int(self._offset[k])  # type: ignore[index]

    def num_present(self) -> int:
        return int(np.count_nonzero(self._alive)) if self._chunk is None else int(np.count_nonzero(self._chunk >= 0))


class Segment:
    """The rows one put created: indexes start .. start + n - 1."""

    def __init__(self, start: int, n: int, groups: Sequence[Any] | None, versions: Sequence[int | None] | None, tags: Sequence[Mapping[str, Any]] | None, consumers: Iterable[str]) -> None:
        self.start, self.n = start, n
        self.alive = np.ones(n, dtype=bool)
        self.num_alive = n
        self.groups = list(groups) if groups is not None else None
        self.versions = _versions(n, versions)
        self.versions.flags.writeable = False  # set once; batches and samplers share it
        self.same_version: int | None = NO_VERSION if versions is None else (int(self.versions[0]) if n and bool((self.versions == self.versions[0]).all()) else None)
        self.tags = [dict(t) if t is not None else {} for t in tags] if tags is not None else None
        self.columns: dict[str, Column] = {}
        self.whole_since: dict[frozenset[str], int] = {}  # columns every live row has, all from one put each: the newest stamp
        self.acked = {c: np.zeros(n, dtype=bool) for c in consumers}
        self.lease = {c: np.zeros(n, dtype=np.float64) for c in self.acked}  # deadline, 0 = not leased
        self.fresh = dict.fromkeys(self.acked, True)  # per consumer: no row acked, leased or dropped yet
        self.redelivered: dict[str, np.ndarray] = {}  # per consumer, stamp of each row's last redelivery (made on first use)
        self.holder: dict[str, np.ndarray] = {}  # per consumer, who holds each lease (0: nobody named; made on first use)

    def add_consumer(self, consumer: str) -> None:
        """Rows for a new consumer (`Partition.add_consumer`, which looks at them again)."""
        self.acked[consumer] = np.zeros(self.n, dtype=bool)
        self.lease[consumer] = np.zeros(self.n, dtype=np.float64)
        self.fresh[consumer] = self.num_alive == self.n  # every row ready for it, if every row still lives

    def holders(self, consumer: str) -> np.ndarray:
        held = self.holder.get(consumer)
        if held is None:
            held = self.holder[consumer] = np.zeros(self.n, dtype=np.int64)
        return held

    def redeliveries(self, consumer: str) -> np.ndarray:
        stamps = self.redelivered.get(consumer)
        if stamps is None:
            stamps = self.redelivered[consumer] = np.zeros(self.n, dtype=np.int64)
        return stamps

    def meta(self, k: int) -> RowMeta:
        version = int(self.versions[k])
        return RowMeta(
            index=self.start + k,
            group=self.groups[k] if self.groups is not None else None,
            version=None if version == NO_VERSION else version,
            tags=self.tags[k] if self.tags is not None else {},
        )


def _versions(n: int, versions: Sequence[int | None] | np.ndarray | None) -> np.ndarray:
    if versions is None:
        return np.full(n, NO_VERSION, dtype=np.int64)
    if isinstance(versions, np.ndarray) and versions.dtype.kind in "iu":
        return versions.astype(np.int64).reshape(n)  # a copy: the caller keeps its array
    try:
        return np.asarray(versions, dtype=np.int64).reshape(n)
    except TypeError:  # some rows have no version
        return np.asarray([NO_VERSION if v is None else int(v) for v in versions], dtype=np.int64).reshape(n)


class ConsumerState:
    def __init__(self, name: str) -> None:
        self.name = name
        self.num_acked = 0
        self.num_dropped = 0
        self.num_redelivered = 0
        self.keys: set[frozenset[str]] = set()
        self.wait_counts = [0] * len(WAIT_BUCKETS)
        self.wait_sum = 0.0


def check_partition_settings(name: str, *, capacity_rows: int | None = None, capacity_bytes: int | None = None, lease_s: float | None = None) -> None:
    """A partition's settings, those given: capacities of at least 1 (0 would make every
    put wait for ever) and a lease of more than 0 seconds (infinite: rows are never handed
    out again)."""
    for key, value in (("capacity_rows", capacity_rows), ("capacity_bytes", capacity_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"partition {name!r}: {key} must be an int >= 1 or None, got {value!r}")
    if lease_s is not None and (isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s > 0):
        raise ValueError(f"partition {name!r}: lease_s must be a number of seconds > 0, got {lease_s!r}")


class Partition:
    def __init__(self, name: str, consumers: Iterable[str], capacity_rows: int | None, capacity_bytes: int | None, lease_s: float) -> None:
        check_partition_settings(name, capacity_rows=capacity_rows, capacity_bytes=capacity_bytes, lease_s=lease_s)
        self.name = name
        self.consumers = {c: ConsumerState(c) for c in consumers}
        if not self.consumers:
            raise ValueError(f"partition {name!r} needs at least one consumer")
        self.capacity_rows = capacity_rows
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self.segments: list[Segment] = []
        self.start_list: list[int] = []  # segment starts, for bisect
        self._starts: np.ndarray | None = None  # the same, for vectorised lookups (made when needed)
        self.chunks: dict[int, Any] = {}
        self.chunk_refs: dict[int, int] = {}
        self.next_chunk = 0
        self.next_index = 0
        self.num_rows = 0
        self.nbytes = 0
        self.num_evicted = 0
        self.ready_index: dict[tuple[str, frozenset[str]], ReadyIndex[Segment]] = {}
        """Per (consumer, columns) that `ready` was asked for: which segments to look at
        again, which have every row ready (in readiness order), and at most how many rows
        are ready (`ReadyIndex`). A get looks at the segments that changed since the last,
        not at every segment of a partition holding thousands."""
        self.leases: list[tuple[float, int, str, np.ndarray]] = []  # heap of (deadline, seq, consumer, indexes)
        self.leases_compact_at = LEASES_COMPACT_MIN
        """Heap size at which the entries of leases acked since are dropped (`add_lease`)."""

    def add_lease(self, entry: tuple[float, int, str, Any]) -> None:
        """Push a get's (deadline, seq, consumer, indexes) onto the lease heap. Once the heap
        has doubled, entries whose rows were all acked or released since are dropped: each
        otherwise stayed until its deadline (`lease_s`, an hour in the workflow), hundreds of
        thousands in a run taking many batches a second. Each entry is looked at a constant
        number of times."""
        heapq.heappush(self.leases, entry)
        if len(self.leases) < self.leases_compact_at:
            return
        live = [(deadline, seq, consumer, indexes) for deadline, seq, consumer, indexes in self.leases if any(bool((seg.lease[consumer][local] == deadline).any()) for seg, local, _ in self.locate(as_indexes(indexes)))]
        heapq.heapify(live)
        self.leases = live
        self.leases_compact_at = max(2 * len(live), LEASES_COMPACT_MIN)

    @property
    def starts(self) -> np.ndarray:
        if self._starts is None:
            self._starts = np.asarray(self.start_list, dtype=np.int64)
        return self._starts

    def add_segment(self, segment: Segment) -> None:
        self.segments.append(segment)
        self.start_list.append(segment.start)
        self._starts = None
        self.wake(segment)

    def wake(self, segment: Segment) -> None:
        """Rows of `segment` may have become ready for any consumer (a column filled, a lease
        given back): `ready` looks at it again."""
        for index in self.ready_index.values():
            index.wake(segment)

    def touch(self, segment: Segment, consumer: str) -> None:
        """`consumer` leased, acked or dropped rows of `segment`: not every row is ready for
        it any more (`Segment.fresh`)."""
        segment.fresh[consumer] = False
        for (c, _), index in self.ready_index.items():
            if c == consumer:
                index.touch(segment)

    def could_take(self, consumer: str, key: frozenset[str], num_rows: int) -> bool:
        """False when fewer than `num_rows` rows can be ready for `consumer` with columns
        `key` (`ReadyIndex.bound`, without looking at a segment): without this, each
        one-row put retried a waiting get over every segment ready so far, so filling a
        batch of n one-row puts cost n^2 segment visits. True when they may be."""
        index = self.ready_index.get((consumer, key))
        return index is None or index.bound is None or index.bound >= num_rows

    def add_consumer(self, consumer: str) -> None:
        """A new consumer: it sees every live row, so every segment is looked at again."""
        self.consumers[consumer] = ConsumerState(consumer)
        for seg in self.segments:
            seg.add_consumer(consumer)
        self.ready_index.clear()

    def span(self, first: int, count: int) -> tuple[Segment, int] | None:
        """(segment, local offset of `first`) when rows first .. first + count - 1 all lie in
        one live segment, else None."""
        k = bisect.bisect_right(self.start_list, first) - 1
        if k < 0:
            return None
        segment = self.segments[k]
        local = first - segment.start
        return (segment, local) if local + count <= segment.n else None

    def freed_by_ack(self, consumer: str, indexes: np.ndarray) -> tuple[int, int]:
        """(rows, bytes) that `consumer` acking `indexes` (sorted, unique) would evict: its
        live rows every other consumer has acked, counted as `Store._evict` counts them."""
        num_rows = nbytes = 0
        for seg, local, _ in self.locate(indexes):
            local = local[seg.alive[local] & ~seg.acked[consumer][local]]
            for other in (c for c in self.consumers if c != consumer):
                local = local[seg.acked[other][local]]
            num_rows += len(local)
            for column in seg.columns.values():
                if column.uniform:
                    nbytes += len(local) * column.row_nbytes
                else:
                    nbytes += int(column.nbytes[local][column.chunk[local] >= 0].sum())
        return num_rows, nbytes

    def locate(self, indexes: np.ndarray) -> Iterator[tuple[Segment, np.ndarray, np.ndarray]]:
        """(segment, local offsets, positions in `indexes`) for every index in a live segment."""
        if not self.segments or not len(indexes):
            return
        lo, hi = (int(indexes[0]),) * 2 if len(indexes) == 1 else (int(indexes.min()), int(indexes.max()))
        k = bisect.bisect_right(self.start_list, lo) - 1
        if k >= 0 and hi < self.segments[k].start + self.segments[k].n:  # the usual case: one segment
            segment = self.segments[k]
            yield segment, indexes - segment.start, np.arange(len(indexes))
            return
        seg = np.searchsorted(self.starts, indexes, side="right") - 1
        order = np.argsort(seg, kind="stable")
        ids, first = np.unique(seg[order], return_index=True)
        bounds = [*first.tolist(), len(indexes)]
        for k, s in enumerate(ids.tolist()):
            if s < 0:
                continue
            segment = self.segments[s]
            positions = order[bounds[k] : bounds[k + 1]]
            local = indexes[positions] - segment.start
            inside = local < segment.n
            yield segment, local[inside], positions[inside]

    def reindex(self, touched: Iterable[Segment] | None = None) -> None:
        """Forget segments with no live row left (only `touched` ones can have emptied)."""
        if touched is None:
            dead = [s for s in self.segments if not s.num_alive]
        else:
            dead = [s for s in {id(s): s for s in touched}.values() if s.num_alive == 0]
        for segment in dead:  # by position (segments are in start order): no pass over every live one
            k = bisect.bisect_left(self.start_list, segment.start)
            if k < len(self.segments) and self.segments[k] is segment:
                del self.segments[k], self.start_list[k]
            for index in self.ready_index.values():
                index.forget(segment)
        if dead:
            self._starts = None

    # Reading rows (the store's get, under its lock) -----------------------------------
    def ready(self, consumer: str, key: frozenset[str], limit: int | None = None) -> Rows:
        """Rows ready for `consumer` with every column of `key`, in the order they became
        ready: all of them, or (`limit`) at least the first `limit`, when there are."""
        wanted = (consumer, key)
        kept = self.ready_index.get(wanted)
        if kept is None:  # first asked: every segment may have some
            kept = self.ready_index[wanted] = ReadyIndex(self.segments)
        unsettled = kept.unsettled
        pieces = []  # (indexes, versions, stamps) of segments with some rows ready
        for start in sorted(unsettled):  # segment order (a woken one may have come back last)
            seg = unsettled[start]
            whole = seg.whole_since.get(key)
            if whole is not None and seg.fresh[consumer]:  # every row is ready, all since `whole`
                kept.settle(seg, whole)
                continue
            found = [seg.columns.get(c) for c in key]
            columns = [c for c in found if c is not None]
            if len(columns) < len(found):
                del unsettled[start]
                continue
            latest = 0  # the newest stamp shared by whole columns
            partial = []
            for column in columns:
                if column.full and column.same_stamp >= 0:  # every live row has it, all from one put
                    latest = max(latest, column.same_stamp)
                else:
                    partial.append(column)
            if not partial:
                seg.whole_since[key] = latest
                if seg.fresh[consumer]:
                    kept.settle(seg, latest)
                    continue
            mask = seg.alive & ~seg.acked[consumer]
            mask &= seg.lease[consumer] == 0
            stamp = seg.redelivered.get(consumer)
            for column in partial:
                mask &= column.chunk >= 0
                stamp = column.stamp if stamp is None else np.maximum(stamp, column.stamp)
            local = np.flatnonzero(mask)
            if not len(local):
                del unsettled[start]
            else:
                pieces.append((local + seg.start, seg.versions[local], np.full(len(local), latest, dtype=np.int64) if stamp is None else np.maximum(stamp[local], latest)))
        kept.bound = kept.settled_rows + sum(len(p[0]) for p in pieces)
        runs = kept.runs(limit)  # those settled, in readiness order: all, or the first `limit` rows' worth
        meta = self.metas
        if not pieces:  # the usual case: whole segments
            return Rows(None, None, meta, runs=[(first, n, versions) for first, n, versions, _ in runs])
        for first, n, versions, since in runs:
            pieces.append((np.arange(first, first + n, dtype=np.int64), versions, np.full(n, since, dtype=np.int64)))
        index, version, stamp = (np.concatenate(a) for a in zip(*pieces)) if len(pieces) > 1 else pieces[0]
        if len(stamp) > 1 and (np.diff(stamp) < 0).any():
            order = np.argsort(stamp, kind="stable")
            index, version = index[order], version[order]
        return Rows(index, version, meta)

    def metas(self, indexes: np.ndarray) -> list[RowMeta]:
        out: list[RowMeta | None] = [None] * len(indexes)
        for seg, local, positions in self.locate(indexes):
            for k, p in zip(local.tolist(), positions.tolist()):
                out[p] = seg.meta(k)
        return out  # type: ignore[return-value]

    def column_block(self, column: Column, first: int, n: int) -> list[tuple[Any, Any]]:
        """Rows first .. first + n - 1 of one segment's column as (chunk, offsets) blocks."""
        if column.whole >= 0:  # row k is row k of one chunk: a slice of it
            return [(self.chunks[column.whole], range(first, first + n))]
        return self.cut(column.chunk[first : first + n], column.offset[first : first + n])

    def lease(self, consumer: str, take: Any, columns: Sequence[str], expiry: float, holder: int) -> tuple[Any, Any, list[Any] | None, dict[str, list[tuple[Any, Any]]]]:
        """Lease rows `take` (a range or an index array) to `consumer` until `expiry`;
        return (indexes, versions, groups, blocks of each column) for its `Batch`. Rows
        consecutive in one segment, the usual case, take a slice of everything."""
        self.add_lease((expiry, next(_lease_seq), consumer, take))
        span = self.span(take[0], len(take)) if isinstance(take, range) or contiguous(take) else None
        if span is None:
            versions, groups, blocks = self.lease_blocks(consumer, list(self.locate(as_indexes(take))), len(take), columns, expiry, holder)
            return take, versions, groups, blocks
        seg, first = span
        rows = slice(first, first + len(take))
        self.touch(seg, consumer)
        seg.lease[consumer][rows] = expiry
        if holder or consumer in seg.holder:
            seg.holders(consumer)[rows] = holder
        shared_versions: np.ndarray | int = seg.versions[rows] if seg.same_version is None else seg.same_version
        groups = None if seg.groups is None else seg.groups[rows]
        blocks = {c: self.column_block(seg.columns[c], first, len(take)) for c in columns}
        return range(int(take[0]), int(take[0]) + len(take)), shared_versions, groups, blocks

    def had(self, where: np.ndarray) -> np.ndarray:
        """`where`, once every index in it is a row this partition has had (acked or evicted
        is fine: acks are idempotent); raise StoreError naming the first that never was."""
        bad = where[(where < 0) | (where >= self.next_index)]
        if len(bad):
            raise StoreError(f"partition {self.name!r} never had row {int(bad[0])}")
        return where

    def column_names(self) -> list[str]:
        """The columns some live row of this partition has, sorted."""
        return sorted({name for seg in self.segments if seg.alive.any() for name, column in seg.columns.items() if column.num_present()})

    def timed_out(self, consumer: str, key: frozenset[str], batch_size: int, timeout: float | None) -> str:
        """A get's timeout: how many rows were ready, the columns it waited for and those the
        partition's rows have (a misspelt or not yet written column shows). A look at every
        segment: made once, for the timeout a caller gives up on."""
        columns, have = sorted(key), self.column_names()
        missing = [c for c in columns if c not in have]
        return (
            f"get({consumer!r}, {self.name!r}, {columns}) timed out after {timeout}s: {len(self.ready(consumer, key))} of {batch_size} rows were ready; "
            f"waited for columns {columns}, the partition's rows have {have}" + (f" (none has {missing})" if missing else "")
        )

    def check_same(self, consumers: Iterable[str], capacity_rows: int | None, capacity_bytes: int | None, lease_s: float) -> None:
        """Raise ValueError naming each setting in which this partition differs from those
        given (a second `create_partition(..., exist_ok=True)`)."""
        given = {"consumers": sorted(consumers), "capacity_rows": capacity_rows, "capacity_bytes": capacity_bytes, "lease_s": lease_s}
        has = {"consumers": sorted(self.consumers), "capacity_rows": self.capacity_rows, "capacity_bytes": self.capacity_bytes, "lease_s": self.lease_s}
        differ = [f"{key}={given[key]!r} (it has {has[key]!r})" for key in given if given[key] != has[key]]
        if differ:
            raise ValueError(f"partition {self.name!r} already exists with other settings: {', '.join(differ)}; create it with the same settings, or wait for it with wait_partition")

    def lease_blocks(self, consumer: str, located: list[tuple[Segment, np.ndarray, np.ndarray]], n: int, columns: Sequence[str], expiry: float, holder: int) -> tuple[np.ndarray, list[Any] | None, dict[str, list[tuple[Any, Any]]]]:
        groups: list[Any] | None = None
        versions = np.full(n, NO_VERSION, dtype=np.int64)
        cell_chunk = {c: np.empty(n, dtype=np.int64) for c in columns}
        cell_offset = {c: np.empty(n, dtype=np.int64) for c in columns}
        for seg, local, positions in located:
            self.touch(seg, consumer)
            seg.lease[consumer][local] = expiry
            if holder or consumer in seg.holder:
                seg.holders(consumer)[local] = holder
            versions[positions] = seg.versions[local]
            if seg.groups is not None:
                if groups is None:
                    groups = [None] * n
                for k, p in zip(local.tolist(), positions.tolist()):
                    groups[p] = seg.groups[k]
            for c in columns:
                column = seg.columns[c]
                if column.whole >= 0:
                    cell_chunk[c][positions] = column.whole
                    cell_offset[c][positions] = local
                else:
                    cell_chunk[c][positions] = column.chunk[local]
                    cell_offset[c][positions] = column.offset[local]
        return versions, groups, {c: self.cut(cell_chunk[c], cell_offset[c]) for c in columns}

    def metrics(self) -> dict[str, Any]:
        """Rows, bytes, present cells per column, and per consumer its counts and get waits."""
        by_column: dict[str, int] = {}
        for seg in self.segments:
            for name, column in seg.columns.items():
                by_column[name] = by_column.get(name, 0) + column.num_present()
        return {
            "rows": self.num_rows,
            "bytes": self.nbytes,
            "evicted": self.num_evicted,
            "ready_by_column": by_column,
            "consumers": {
                s.name: {
                    "acked": s.num_acked,
                    "leased": sum(int((seg.lease[s.name] > 0).sum()) for seg in self.segments),
                    "dropped": s.num_dropped,
                    "redelivered": s.num_redelivered,
                    "ready": {",".join(sorted(k)): len(self.ready(s.name, k)) for k in s.keys},
                    "wait_s": {"count": sum(s.wait_counts), "sum": s.wait_sum, "buckets": dict(zip(map(str, WAIT_BUCKETS), s.wait_counts))},
                }
                for s in self.consumers.values()
            },
        }

    def cut(self, ids: np.ndarray, offsets: np.ndarray) -> list[tuple[Any, Any]]:
        """Cells (chunk ids, offsets) in batch order as blocks of consecutive cells of one chunk."""
        if len(ids) < 2 or (ids[0] == ids[-1] and (ids == ids[0]).all()):
            return [(self.chunks[int(ids[0])], offsets)]
        cuts = (np.flatnonzero(np.diff(ids)) + 1).tolist()
        return [(self.chunks[int(ids[a])], offsets[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]


def contiguous(indexes: np.ndarray) -> bool:
    """True when `indexes` is first, first + 1, ..., in that order."""
    n = len(indexes)
    if n < 2:
        return True
    if int(indexes[-1]) - int(indexes[0]) != n - 1:
        return False
    return n == 2 or bool((np.diff(indexes) == 1).all())
