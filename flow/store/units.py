"""Storage units: where column data lives when the controller holds only metadata.

In a split deployment the controller is a `Store` whose cells are `Ref`s (which storage
unit holds the cell, its size and shape); the data stays on the unit of the producer
that wrote it. Consumers read cells from the units named in the refs; the controller
tells units to drop rows it evicts. Several units shard the data of one table.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tidal.flow.store.table import nbytes_of


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """A cell held by the storage unit at `unit` (a ZeroMQ address)."""

    unit: str
    nbytes: int
    shape: tuple[int, ...]

    @property
    def wire(self) -> list[Any]:
        return [self.unit, self.nbytes, list(self.shape)]

    @classmethod
    def from_wire(cls, value: Any) -> Ref:
        if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and isinstance(value[1], int)):
            raise ValueError(f"not a cell reference: {value!r}")
        return cls(value[0], value[1], tuple(int(n) for n in value[2]))


class StorageUnit:
    """Column data keyed by (partition, row index, column); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.nbytes = 0

    def write(self, partition: str, indexes: Sequence[int], columns: Mapping[str, Sequence[Any]]) -> None:
        """Store `columns[name][k]` as row `indexes[k]`'s cell `name`."""
        for name, cells in columns.items():
            if len(cells) != len(indexes):
                raise ValueError(f"column {name!r} has {len(cells)} cells for {len(indexes)} rows")
        with self._lock:
            for k, i in enumerate(indexes):
                row = self._rows.setdefault((partition, i), {})
                for name, cells in columns.items():
                    old = row.get(name)
                    if old is not None:
                        self.nbytes -= nbytes_of(old)
                    row[name] = cells[k]
                    self.nbytes += nbytes_of(cells[k])

    def read(self, partition: str, wanted: Mapping[str, Sequence[int]]) -> dict[str, list[Any]]:
        """`{column: [cell of each index]}` for `wanted = {column: indexes}`."""
        with self._lock:
            try:
                return {c: [self._rows[(partition, i)][c] for i in indexes] for c, indexes in wanted.items()}
            except KeyError as e:
                raise KeyError(f"storage unit holds no cell {e.args[0]!r} of partition {partition!r}") from None

    def drop(self, partition: str, indexes: Iterable[int]) -> int:
        dropped = 0
        with self._lock:
            for i in indexes:
                row = self._rows.pop((partition, i), None)
                if row is not None:
                    self.nbytes -= sum(nbytes_of(v) for v in row.values())
                    dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._rows)


def cell_ref(unit: str, value: Any) -> Ref:
    """The reference a controller keeps for `value` stored on `unit`."""
    shape = getattr(value, "shape", None)
    if shape is None:
        shape = (len(value),) if isinstance(value, (str, bytes, list, tuple)) else ()
    return Ref(unit, nbytes_of(value), tuple(int(n) for n in shape))
