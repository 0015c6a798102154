"""Cells, chunks and batches: how column data is held and handed out.

A put keeps each column as it arrived - a batched tensor or array with rows along dim 0,
or a list of cells - as one chunk; a row's cell is (chunk, offset). A `Batch` hands
rows out as blocks of (chunk, row offsets) and makes per-row cells (views) only when
asked, so stacking rows that arrived together is a slice, not a copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch


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
    if isinstance(value, (list, tuple)) or isinstance(getattr(value, "sizes", None), np.ndarray):
        return len(value)
    raise ValueError(f"column {name!r} must be a batched tensor, array or list, got {type(value).__name__}")


def check_column(name: str, value: Any, num_rows: int) -> Any:
    """The column as a chunk: a batched tensor/array (rows along dim 0) or a list."""
    if isinstance(getattr(value, "sizes", None), np.ndarray):  # a chunk held elsewhere
        if len(value) != num_rows:
            raise ValueError(f"column {name!r} has {len(value)} values for {num_rows} rows")
        return value
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0 or value.shape[0] != num_rows:
            raise ValueError(f"column {name!r} has leading dimension {tuple(value.shape)[:1]} for {num_rows} rows")
        return value
    if isinstance(value, (list, tuple)):
        if len(value) != num_rows:
            raise ValueError(f"column {name!r} has {len(value)} values for {num_rows} rows")
        return list(value)
    raise ValueError(f"column {name!r} must be a batched tensor, array or list, got {type(value).__name__}")


def split_rows(name: str, value: Any, num_rows: int) -> list[Any]:
    """One cell per row: a batched tensor/array splits along dim 0 into views."""
    chunk = check_column(name, value, num_rows)
    return list(chunk.unbind(0)) if isinstance(chunk, torch.Tensor) else list(chunk)


def cell_sizes(chunk: Any) -> np.ndarray:
    sizes = getattr(chunk, "sizes", None)  # a chunk held elsewhere knows its rows' sizes
    if isinstance(sizes, np.ndarray):
        return sizes
    if isinstance(chunk, (torch.Tensor, np.ndarray)):
        per_row = nbytes_of(chunk) // max(len(chunk), 1)
        return np.full(len(chunk), per_row, dtype=np.int64)
    return np.fromiter((nbytes_of(v) for v in chunk), dtype=np.int64, count=len(chunk))


class Cells(Mapping[str, list[Any]]):
    """A batch's columns; each column's per-row cells are made (as views) on first access."""

    def __init__(self, blocks: dict[str, list[tuple[Any, np.ndarray]]]) -> None:
        self._blocks = blocks
        self._made: dict[str, list[Any]] = {}

    def __getitem__(self, name: str) -> list[Any]:
        cells = self._made.get(name)
        if cells is None:
            cells = self._made[name] = [chunk[int(k)] for chunk, offsets in self._blocks[name] for k in offsets]
        return cells

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return repr(dict(self))


class Batch:
    """Rows handed to a consumer. Cells are the stored objects (tensor views, no copies)."""

    def __init__(self, partition: str, indexes: list[int], columns: Mapping[str, list[Any]], groups: list[Any], versions: list[int | None], *, blocks: dict[str, list[tuple[Any, np.ndarray]]] | None = None) -> None:
        self.partition = partition
        self.indexes = indexes
        self.columns = columns
        self.groups = groups
        self.versions = versions
        self._blocks = blocks or {}

    @classmethod
    def from_chunks(cls, partition: str, indexes: list[int], chunks: Mapping[str, Any], groups: list[Any], versions: list[int | None]) -> Batch:
        """A batch whose columns are whole chunks (rows along dim 0), e.g. decoded from the wire."""
        everything = np.arange(len(indexes))
        blocks = {name: [(chunk, everything)] for name, chunk in chunks.items()}
        return cls(partition, indexes, Cells(blocks), groups, versions, blocks=blocks)

    def __len__(self) -> int:
        return len(self.indexes)

    def __repr__(self) -> str:
        return f"Batch(partition={self.partition!r}, indexes={self.indexes}, columns={sorted(self.columns)}, versions={self.versions})"

    def blocks(self, column: str) -> list[tuple[Any, np.ndarray]]:
        """The column as (chunk, row offsets) pieces in batch order (empty if not chunked)."""
        return self._blocks.get(column, [])

    def chunked(self, column: str) -> torch.Tensor | None:
        """`stack(column)` when the column is made of tensor chunks of one dtype and row
        shape (so stacking is a view or one gather), else None."""
        blocks = self._blocks.get(column)
        if not blocks or not all(isinstance(chunk, torch.Tensor) for chunk, _ in blocks):
            return None
        if len({(chunk.dtype, tuple(chunk.shape[1:])) for chunk, _ in blocks}) != 1:
            return None
        return self.stack(column)

    def stack(self, column: str) -> torch.Tensor:
        """The column's cells stacked into one tensor (they must share a shape).

        Rows that arrived in one put, in order, come back as a view of that put's tensor.
        """
        blocks = self._blocks.get(column)
        if blocks and all(isinstance(chunk, (torch.Tensor, np.ndarray)) for chunk, _ in blocks):
            parts = [rows_of(torch.as_tensor(chunk), offsets) for chunk, offsets in blocks]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        return torch.stack([torch.as_tensor(v) for v in self.columns[column]])


def unique_sorted(indexes: np.ndarray) -> np.ndarray:
    """Sorted unique indexes; skips the sort for the usual already-increasing batch."""
    if len(indexes) < 2 or (np.diff(indexes) > 0).all():
        return indexes
    return np.unique(indexes)


def rows_of(chunk: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    first, last = int(offsets[0]), int(offsets[-1])
    if last - first + 1 == len(offsets) and (len(offsets) < 3 or (np.diff(offsets) == 1).all()):
        return chunk[first : last + 1]
    return chunk[torch.from_numpy(offsets)]
