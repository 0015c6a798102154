"""What a partition knows, between gets, of the rows ready for one (consumer, columns).

`Partition.ready` keeps a `ReadyIndex` per (consumer, columns) it was asked for, so that a
get looks at the segments that changed since the last one, and takes the first rows in
readiness order without a pass over every ready segment (with thousands of segments
waiting - a producer ahead of its consumer, one-row puts - that pass made each get cost
milliseconds, and draining the backlog quadratic):

- `unsettled`: live segments, by start, that may have ready rows and are looked at by the
  next `ready`: new ones, woken ones (a column filled, a lease given back), and settled ones
  a lease or an ack touched. A segment found with none ready leaves until woken.
- settled: segments every row of which is ready since one stamp (all columns whole, and
  no row leased, acked or dropped by the consumer: `Segment.fresh`), in readiness order.
  They stay so until a change moves them back (`wake`, `touch`) or they die (`forget`).
- `bound`: at most how many rows are ready now: what `ready` found last, plus the rows of
  every segment woken since (rows become ready only by a wake).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import numpy as np


class PutRows(Protocol):
    """What the index reads of a `segments.Segment`: the rows one put created."""

    start: int
    n: int
    versions: np.ndarray


Segment = TypeVar("Segment", bound=PutRows)


class ReadyIndex(Generic[Segment]):
    __slots__ = ("_order", "_settled", "bound", "settled_rows", "unsettled")

    def __init__(self, segments: Iterable[Segment]) -> None:
        self.unsettled: dict[int, Segment] = {s.start: s for s in segments}
        self._settled: dict[int, tuple[int, Segment]] = {}  # start -> (ready since, segment)
        self._order: list[tuple[int, int]] = []  # (ready since, start) of settled segments, sorted
        self.settled_rows = 0
        self.bound: int | None = None  # None until `ready` has counted

    def settle(self, segment: Segment, since: int) -> None:
        """Every row of `segment` is ready since stamp `since` (it leaves `unsettled`)."""
        del self.unsettled[segment.start]
        self._settled[segment.start] = (since, segment)
        bisect.insort(self._order, (since, segment.start))
        self.settled_rows += segment.n

    def _unsettle(self, start: int) -> Segment | None:
        entry = self._settled.pop(start, None)
        if entry is None:
            return None
        since, segment = entry
        del self._order[bisect.bisect_left(self._order, (since, start))]
        self.settled_rows -= segment.n
        return segment

    def wake(self, segment: Segment) -> None:
        """Rows of `segment` may have become ready: looked at again, counted in `bound`."""
        self._unsettle(segment.start)
        self.unsettled[segment.start] = segment
        if self.bound is not None:
            self.bound += segment.n

    def touch(self, segment: Segment) -> None:
        """Rows of `segment` were leased, acked or dropped: a settled one is looked at again."""
        if self._unsettle(segment.start) is not None:
            self.unsettled[segment.start] = segment

    def forget(self, segment: Segment) -> None:
        """`segment` died (every row evicted)."""
        self._unsettle(segment.start)
        self.unsettled.pop(segment.start, None)

    def runs(self, limit: int | None) -> list[tuple[int, int, np.ndarray, int]]:
        """(first index, count, versions, ready since) of settled segments in readiness
        order: the first ones holding at least `limit` rows, or all (None)."""
        out, num_rows = [], 0
        for since, start in self._order:
            if limit is not None and num_rows >= limit:
                break
            segment = self._settled[start][1]
            out.append((start, segment.n, segment.versions, since))
            num_rows += segment.n
        return out
