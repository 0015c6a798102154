"""Acks, eviction, replaced cells and chunk references of a partition's rows (the store's
lock held).

A row leaves once every consumer has acked it; a put to existing rows replaces their
cells; a chunk (the object one put handed over) is freed once no live row uses it, and
`on_free(partition, chunk)` hears of it (a controller whose chunks live on storage units
frees them there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tidal.flow.store.cells import row_nbytes, unique_sorted
from tidal.flow.store.segments import Column, Partition, Segment, contiguous

OnFree = Callable[[str, Any], None]


def ack_rows(part: Partition, consumer: str, where: np.ndarray, on_free: OnFree) -> int:
    """Mark rows `where` of `part` acked by `consumer`; evict those every consumer has
    acked. Returns how many were newly acked."""
    span = part.span(int(where[0]), len(where)) if len(where) and contiguous(where) else None
    if span is not None:  # the usual case: a batch of consecutive rows of one segment
        seg, first = span
        pieces: Iterable[tuple[Segment, Any]] = [(seg, slice(first, first + len(where)))]
    else:
        pieces = ((seg, local) for seg, local, _ in part.locate(unique_sorted(where)))
    newly, evicted = 0, []
    only = len(part.consumers) == 1
    for seg, rows in pieces:
        acked = seg.acked[consumer]
        new = seg.alive[rows] & ~acked[rows]
        if isinstance(rows, slice) and new.all():
            local: Any = rows
            count = rows.stop - rows.start
        else:
            local = np.flatnonzero(new) + rows.start if isinstance(rows, slice) else rows[new]
            count = len(local)
            if not count:
                continue
        part.touch(seg, consumer)
        acked[local] = True
        seg.lease[consumer][local] = 0
        newly += count
        if only:
            done = local
        else:
            both = np.logical_and.reduce([seg.acked[c][local] for c in part.consumers])
            done = local if both.all() else (np.flatnonzero(both) + local.start if isinstance(local, slice) else local[both])
        evict(part, seg, done, on_free)
        if seg.num_alive == 0:
            evicted.append(seg)
    part.consumers[consumer].num_acked += newly
    if evicted:
        part.reindex(evicted)
    return newly


def evict(part: Partition, seg: Segment, local: Any, on_free: OnFree) -> None:
    """Rows `local` (a slice or offsets) of `seg` leave: every consumer has acked them."""
    count = local.stop - local.start if isinstance(local, slice) else len(local)
    if not count:
        return
    seg.alive[local] = False
    seg.num_alive -= count
    part.num_rows -= count
    part.num_evicted += count
    for column in seg.columns.values():
        if column.uniform:
            unref_chunk(part, column.whole, count, on_free)
            part.nbytes -= count * column.row_nbytes
            if not column.is_lazy:
                column.chunk[local] = -1
        else:
            ids = column.chunk[local]
            present = ids >= 0
            unref(part, ids[present], on_free)
            part.nbytes -= int(column.nbytes[local][present].sum())
            column.chunk[local] = -1


def unref(part: Partition, ids: np.ndarray, on_free: OnFree) -> None:
    """Drop one reference per id in `ids` (chunk ids, repeats allowed)."""
    if not len(ids):
        return
    if ids[0] == ids[-1] and (len(ids) < 3 or (ids == ids[0]).all()):
        pairs = [(int(ids[0]), len(ids))]
    else:
        unique, counts = np.unique(ids, return_counts=True)
        pairs = list(zip(unique.tolist(), counts.tolist()))
    for chunk_id, n in pairs:
        unref_chunk(part, chunk_id, n, on_free)


def unref_chunk(part: Partition, chunk_id: int, n: int, on_free: OnFree) -> None:
    """Drop `n` references to a chunk; a chunk left with none is freed (`on_free`)."""
    part.chunk_refs[chunk_id] -= n
    if part.chunk_refs[chunk_id] == 0:
        del part.chunk_refs[chunk_id]
        chunk = part.chunks.pop(chunk_id)
        on_free(part.name, chunk)


def replace_cells(part: Partition, name: str, chunk: Any, sizes: np.ndarray, where: np.ndarray, *, stamp: int, on_free: OnFree) -> None:
    """Column `name` of existing rows `where` becomes rows 0.. of `chunk` (arrived at
    `stamp`); the cells it replaces drop their chunk references."""
    chunk_id = part.next_chunk
    part.next_chunk += 1
    part.chunks[chunk_id], part.chunk_refs[chunk_id] = chunk, len(where)
    for seg, local, positions in part.locate(where):
        part.wake(seg)
        seg.whole_since.clear()
        column = seg.columns.get(name)
        if column is None:
            column = seg.columns[name] = Column(seg.alive)
        old = column.chunk[local]
        replaced = old >= 0
        if replaced.any():
            unref(part, old[replaced], on_free)
            part.nbytes -= int(column.nbytes[local][replaced].sum())
        column.chunk[local] = chunk_id
        column.offset[local] = positions
        column.stamp[local] = stamp
        column.nbytes[local] = sizes[positions]
        part.nbytes += int(sizes[positions].sum())
        present = column.chunk >= 0
        covers = len(local) == seg.n and bool((column.chunk == chunk_id).all() and (column.offset == np.arange(seg.n)).all())
        column.whole = chunk_id if covers else -1
        column.full = bool((present | ~seg.alive).all())
        column.same_stamp = stamp if bool((column.stamp[present] == stamp).all()) else -1
        size = row_nbytes(chunk)
        column.row_nbytes = size if size >= 0 and bool((column.nbytes[present] == size).all()) else -1
