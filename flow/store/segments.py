"""The store's row state: numpy arrays per segment (the rows one put created).

Per segment: which rows are alive, their groups, versions and tags, where each column's
cell lives (chunk id and offset), when it arrived (readiness order), and per consumer
whether it acked or leased each row. Per partition: the live segments in index order,
the chunks they point into, capacity and the lease heap. `Store` does the bookkeeping.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tidal.flow.store.samplers import NO_VERSION, RowMeta

WAIT_BUCKETS = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, float("inf"))
"""Upper bounds (seconds) of the get wait-time histogram."""


class Column:
    """Where one column's cells of one segment live."""

    __slots__ = ("chunk", "offset", "stamp", "nbytes")

    def __init__(self, n: int) -> None:
        self.chunk = np.full(n, -1, dtype=np.int64)  # chunk id, -1 = absent
        self.offset = np.zeros(n, dtype=np.int64)
        self.stamp = np.zeros(n, dtype=np.int64)  # when the cell arrived (readiness order)
        self.nbytes = np.zeros(n, dtype=np.int64)


class Segment:
    """The rows one put created: indexes start .. start + n - 1."""

    def __init__(self, start: int, n: int, groups: Sequence[Any] | None, versions: Sequence[int | None] | None, tags: Sequence[Mapping[str, Any]] | None, consumers: Iterable[str]) -> None:
        self.start, self.n = start, n
        self.alive = np.ones(n, dtype=bool)
        self.groups = list(groups) if groups is not None else None
        self.versions = np.full(n, NO_VERSION, dtype=np.int64)
        if versions is not None:
            self.versions[:] = [NO_VERSION if v is None else int(v) for v in versions]
        self.tags = [dict(t) for t in tags] if tags is not None else None
        self.columns: dict[str, Column] = {}
        self.idle: set[tuple[str, frozenset[str]]] = set()  # (consumer, columns) with nothing ready here
        self.acked = {c: np.zeros(n, dtype=bool) for c in consumers}
        self.lease = {c: np.zeros(n, dtype=np.float64) for c in self.acked}  # deadline, 0 = not leased
        self.redelivered = {c: np.zeros(n, dtype=np.int64) for c in self.acked}  # stamp of last redelivery

    def meta(self, k: int) -> RowMeta:
        version = int(self.versions[k])
        return RowMeta(
            index=self.start + k,
            group=self.groups[k] if self.groups is not None else None,
            version=None if version == NO_VERSION else version,
            tags=self.tags[k] if self.tags is not None else {},
        )


class ConsumerState:
    def __init__(self, name: str) -> None:
        self.name = name
        self.num_acked = 0
        self.num_dropped = 0
        self.num_redelivered = 0
        self.keys: set[frozenset[str]] = set()
        self.wait_counts = [0] * len(WAIT_BUCKETS)
        self.wait_sum = 0.0


class Partition:
    def __init__(self, name: str, consumers: Iterable[str], capacity_rows: int | None, capacity_bytes: int | None, lease_s: float) -> None:
        self.name = name
        self.consumers = {c: ConsumerState(c) for c in consumers}
        if not self.consumers:
            raise ValueError(f"partition {name!r} needs at least one consumer")
        self.capacity_rows = capacity_rows
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self.segments: list[Segment] = []
        self.start_list: list[int] = []  # segment starts, for bisect
        self.starts = np.zeros(0, dtype=np.int64)  # the same, for vectorised lookups
        self.chunks: dict[int, Any] = {}
        self.chunk_refs: dict[int, int] = {}
        self.next_chunk = 0
        self.next_index = 0
        self.num_rows = 0
        self.nbytes = 0
        self.num_evicted = 0
        self.leases: list[tuple[float, int, str, np.ndarray]] = []  # heap of (deadline, seq, consumer, indexes)

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

    def reindex(self) -> None:
        self.segments = [s for s in self.segments if s.alive.any()]
        self.start_list = [s.start for s in self.segments]
        self.starts = np.asarray(self.start_list, dtype=np.int64)
