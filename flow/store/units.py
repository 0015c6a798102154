"""Storage units: where column data lives when the controller holds only metadata.

In a split deployment a producer writes each column it puts, as one chunk, into a
storage unit (its own, in process, zero copy), then tells the controller about the rows
with a `RemoteChunk` per column: which unit holds the chunk, under which key, and the
size of each row's cell. The controller tracks readiness, leases and acks exactly as for
local data; consumers read the rows they were given straight from the units; when the
controller lets go of a chunk (every row using it evicted), it tells the unit to drop it.
Several units shard the data of one table.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from tidal.flow.store.cells import cell_sizes, rows_of


@dataclasses.dataclass(frozen=True, slots=True)
class Ref:
    """One row's cell of a remote chunk (what a controller-side cell looks like)."""

    unit: str
    key: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class RemoteChunk:
    """A column chunk held by the storage unit at `unit` under `key`; rows along dim 0."""

    unit: str
    key: str
    sizes: np.ndarray
    """Bytes of each row's cell."""

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, k: int) -> Ref:
        return Ref(self.unit, self.key, int(k), int(self.sizes[k]))

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def wire(self) -> dict[str, Any]:
        return {"unit": self.unit, "key": self.key, "sizes": self.sizes}

    @classmethod
    def from_wire(cls, value: Any) -> RemoteChunk:
        if not isinstance(value, dict) or not isinstance(value.get("unit"), str) or not isinstance(value.get("key"), str):
            raise ValueError(f"not a remote chunk descriptor: {value!r}")
        sizes = np.asarray(value.get("sizes"), dtype=np.int64)
        if sizes.ndim != 1 or (sizes < 0).any():
            raise ValueError("remote chunk sizes must be a 1-D array of byte counts")
        return cls(value["unit"], value["key"], sizes)


class StorageUnit:
    """Column chunks keyed by the producer's chunk key; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: dict[str, Any] = {}
        self.nbytes = 0

    def write(self, key: str, chunk: Any) -> None:
        """Keep `chunk` (a batched tensor/array with rows along dim 0, or a list of cells)."""
        with self._lock:
            if key in self._chunks:
                raise ValueError(f"storage unit already holds chunk {key!r}")
            self._chunks[key] = chunk
            self.nbytes += int(cell_sizes(chunk).sum())

    def read(self, key: str, offsets: np.ndarray) -> Any:
        """The rows `offsets` of chunk `key`: a tensor (a view when contiguous), an array or a list."""
        with self._lock:
            chunk = self._chunks.get(key)
        if chunk is None:
            raise KeyError(f"storage unit holds no chunk {key!r} (never written, or dropped)")
        offsets = np.asarray(offsets, dtype=np.int64)
        if len(offsets) and (offsets.min() < 0 or offsets.max() >= len(chunk)):
            raise IndexError(f"chunk {key!r} has {len(chunk)} rows; asked for rows up to {int(offsets.max())}")
        if isinstance(chunk, torch.Tensor):
            return rows_of(chunk, offsets) if len(offsets) else chunk[:0]
        if isinstance(chunk, np.ndarray):  # stays NumPy, as an in-process store gives it (strings too)
            return chunk[offsets]
        return [chunk[int(k)] for k in offsets]

    def drop(self, keys: Iterable[str]) -> int:
        dropped = 0
        with self._lock:
            for key in keys:
                chunk = self._chunks.pop(key, None)
                if chunk is not None:
                    self.nbytes -= int(cell_sizes(chunk).sum())
                    dropped += 1
        return dropped

    def __len__(self) -> int:
        """How many chunks it holds."""
        return len(self._chunks)
