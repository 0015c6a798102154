"""Cells, chunks and batches: how column data is held and handed out.

A put keeps each column as it arrived - a batched tensor or array with rows along dim 0,
or a list of cells - as one chunk; a row's cell is (chunk, offset). A `Batch` hands
rows out as blocks of (chunk, row offsets) and makes per-row cells (views) only when
asked, so stacking rows that arrived together is a slice, not a copy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tidal.flow.store.samplers import NO_VERSION

_NUMBERS = frozenset({int, float, bool, type(None)})


def nbytes_of(value: Any) -> int:
    """The bytes a cell holds, for capacity: a tensor's or array's data, a string's length,
    8 per number, and a list's, tuple's or dict's contents (keys included), summed."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(8 if type(v) in _NUMBERS else nbytes_of(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes_of(k) + (8 if type(v) in _NUMBERS else nbytes_of(v)) for k, v in value.items())
    return int(getattr(value, "nbytes", 8))  # e.g. a reference to data held elsewhere


def num_rows_of(item: tuple[str, Any]) -> int:
    name, value = item
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim:
        return int(value.shape[0])
    if isinstance(value, (list, tuple)) or isinstance(getattr(value, "sizes", None), np.ndarray):
        return len(value)
    raise ValueError(f"column {name!r} must be a batched tensor, array or list, got {type(value).__name__}")


def num_rows_of_put(columns: Mapping[str, Any], indexes: Any, num_rows: int | None) -> int:
    """How many rows a put writes: one per index, else `num_rows`, else what a column
    says. A 1-D tensor or array is one value per row only when something else says how
    many rows there are (`indexes`, `num_rows`, a list, a column of rank 2 or more): alone,
    `{"x": torch.zeros(256)}` could be 256 rows of one value or one row of 256, so such a
    put is refused, naming the column (one of 0 or 1 values is that many rows)."""
    if num_rows is not None and (isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < 0):
        raise ValueError(f"num_rows must be a number of rows >= 0, got {num_rows!r}")
    if indexes is not None:
        if num_rows is not None and num_rows != len(indexes):
            raise ValueError(f"num_rows={num_rows} but {len(indexes)} indexes were given")
        return len(indexes)
    if num_rows is not None:
        return int(num_rows)
    flat = None
    for name, value in columns.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 1:
            flat = flat or (name, value)
            continue
        return num_rows_of((name, value))
    name, value = flat  # type: ignore[misc]  # every column is 1-D (a put has at least one)
    n = len(value)
    if n <= 1:
        return n
    kind = "tensor" if isinstance(value, torch.Tensor) else "array"
    raise ValueError(
        f"column {name!r} is a 1-D {kind} of {n} values: {n} rows of one value each, or one row of {n} values? "
        f"Pass num_rows={n} for {n} rows, or {name}[None] (shape [1, {n}]) for one row"
    )


def check_row_meta(num_rows: int, groups: Any, versions: Any, tags: Any) -> None:
    """A put's per-row metadata has one entry per row (each may be None), each group id is
    hashable by value (samplers key groups by it), and each row's tags are a map."""
    for name, per_row in (("groups", groups), ("versions", versions), ("tags", tags)):
        if per_row is not None and len(per_row) != num_rows:
            raise ValueError(f"{name} has {len(per_row)} entries for {num_rows} rows")
    for k, row_tags in enumerate(tags if tags is not None else ()):
        if row_tags is not None and not isinstance(row_tags, Mapping):
            raise ValueError(f"tags[{k}] is {row_tags!r}, not a map of tag names to values (or None)")
    for k, group in enumerate(groups if groups is not None else ()):
        if isinstance(group, torch.Tensor):  # hashed by identity: no two rows would share a group, and a grouped get waits for ever
            raise ValueError(f"groups[{k}] is a tensor ({group!r}); a group id is an int, a str or a tuple of them (pass groups.tolist())")
        try:
            hash(group)
        except TypeError:  # a grouped get would fail on it for ever, never naming the row
            raise ValueError(f"groups[{k}] is {group!r}, which is not hashable; a group id is an int, a str or a tuple of them") from None


def check_column(name: str, value: Any, num_rows: int) -> Any:
    """The column as a chunk: a batched tensor/array (rows along dim 0) or a list."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0 or value.shape[0] != num_rows:
            raise ValueError(f"column {name!r} has leading dimension {tuple(value.shape)[:1]} for {num_rows} rows")
        return value
    if isinstance(getattr(value, "sizes", None), np.ndarray):  # a chunk held elsewhere
        if len(value) != num_rows:
            raise ValueError(f"column {name!r} has {len(value)} values for {num_rows} rows")
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


def row_nbytes(chunk: Any) -> int:
    """The size every row of `chunk` shares (a batched tensor or array), else -1."""
    if isinstance(chunk, (torch.Tensor, np.ndarray)):
        return chunk.nbytes // max(chunk.shape[0], 1)
    return -1


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

    def __init__(self, blocks: dict[str, list[tuple[Any, np.ndarray | range]]]) -> None:
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
    """Rows handed to a consumer. Cells are the stored objects (tensor views, no copies).

    `batch.stack("x")` is column x as one tensor, rows along dim 0 (a view of the put's
    tensor when the rows arrived together); `batch.columns["x"]` is its list of cells,
    one per row.

    `indexes`, `versions` and `groups` are lists; `index_array` and `version_array` (with
    `NO_VERSION` for rows put without one) are the same as arrays. A batch made by a get
    holds its indexes as a `range` or an array and its versions as one shared value or an
    array, and makes the lists on first use, so no per-row work is done for a consumer (or
    a server) that does not ask for them.
    """

    def __init__(self, partition: str, indexes: Sequence[int] | np.ndarray | range, columns: Mapping[str, list[Any]], groups: list[Any] | None, versions: Sequence[int | None] | np.ndarray | int, *, blocks: dict[str, list[tuple[Any, Any]]] | None = None) -> None:
        """`versions` may be one value (`NO_VERSION`: none) that every row shares."""
        self.partition = partition
        self.columns = columns
        self._blocks = blocks or {}
        self._index_src = indexes if isinstance(indexes, (np.ndarray, range)) else list(indexes)
        self._n = len(self._index_src)
        self._indexes: list[int] | None = self._index_src if isinstance(self._index_src, list) else None
        self._index_array: np.ndarray | None = self._index_src if isinstance(self._index_src, np.ndarray) else None
        self._version_src = versions if isinstance(versions, (np.ndarray, int)) else list(versions)
        self._versions: list[int | None] | None = self._version_src if isinstance(self._version_src, list) else None
        self._version_array: np.ndarray | None = self._version_src if isinstance(self._version_src, np.ndarray) else None
        self._groups = groups  # None: no row has a group

    @classmethod
    def from_chunks(cls, partition: str, indexes: Sequence[int] | np.ndarray | range, chunks: Mapping[str, Any], groups: list[Any] | None, versions: Sequence[int | None] | np.ndarray | int) -> Batch:
        """A batch whose columns are whole chunks (rows along dim 0), e.g. decoded from the wire."""
        everything = range(len(indexes))
        blocks: dict[str, list[tuple[Any, np.ndarray | range]]] = {name: [(chunk, everything)] for name, chunk in chunks.items()}
        return cls(partition, indexes, Cells(blocks), groups, versions, blocks=blocks)

    @property
    def indexes(self) -> list[int]:
        if self._indexes is None:
            src = self._index_src
            self._indexes = src.tolist() if isinstance(src, np.ndarray) else list(src)
        return self._indexes

    @property
    def index_array(self) -> np.ndarray:
        if self._index_array is None:
            src = self._index_src
            self._index_array = np.arange(src.start, src.stop, src.step, dtype=np.int64) if isinstance(src, range) else np.asarray(src, dtype=np.int64)
        return self._index_array

    @property
    def index_range(self) -> range | None:
        """The indexes as a `range` when the batch was made with one (consecutive rows)."""
        return self._index_src if isinstance(self._index_src, range) else None

    @property
    def versions(self) -> list[int | None]:
        if self._versions is None:
            src = self._version_src
            if isinstance(src, int):
                self._versions = [None if src == NO_VERSION else src] * self._n
            else:
                self._versions = [None if v == NO_VERSION else v for v in src.tolist()]  # type: ignore[union-attr]
        return self._versions

    @property
    def version_array(self) -> np.ndarray:
        if self._version_array is None:
            src = self._version_src
            if isinstance(src, int):
                self._version_array = np.full(self._n, src, dtype=np.int64)
            else:
                self._version_array = np.asarray([NO_VERSION if v is None else v for v in src], dtype=np.int64)
        return self._version_array

    @property
    def version_fill(self) -> int | None:
        """The version every row shares (`NO_VERSION`: none) when the batch was made with one."""
        return self._version_src if isinstance(self._version_src, int) else None

    @property
    def groups(self) -> list[Any]:
        if self._groups is None:
            self._groups = [None] * self._n
        return self._groups

    @property
    def has_groups(self) -> bool:
        return self._groups is not None and any(g is not None for g in self._groups)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        """One short line whatever the batch's size: its rows, each column's kind, versions."""
        src = self.index_array
        if not self._n:
            rows = "none"
        elif self._n > 1 and bool((np.diff(src) == 1).all()):
            rows = f"{src[0]}..{src[-1]}"
        else:
            rows = ", ".join(map(str, src[:4].tolist())) + (f", ... ({self._n})" if self._n > 4 else "")
        seen = sorted({self._version_src} if isinstance(self._version_src, int) else set(self.version_array.tolist()) if self._n else set())
        known = [v for v in seen if v != NO_VERSION]
        versions = "none" if not known else str(known[0]) if len(known) == 1 else f"{known[0]}..{known[-1]}"
        versions += " (some none)" if known and len(known) < len(seen) else ""
        columns = ", ".join(f"{name}: {self._kind(name)}" for name in sorted(self.columns))
        return f"Batch({self._n} rows of {self.partition!r}: rows {rows}; versions {versions}; {{{columns}}})"

    def _kind(self, column: str) -> str:
        """A column's kind for `repr`: `float32[64, 256]` when it is tensor chunks of one row shape."""
        blocks = self._blocks.get(column)
        if blocks and all(isinstance(chunk, (torch.Tensor, np.ndarray)) for chunk, _ in blocks) and len({(chunk.dtype, tuple(chunk.shape[1:])) for chunk, _ in blocks}) == 1:
            chunk = blocks[0][0]
            dtype = str(chunk.dtype).removeprefix("torch.")
            return f"{dtype}[{', '.join(map(str, (self._n, *chunk.shape[1:])))}]"
        return f"{self._n} cells"

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


def as_indexes(indexes: Any) -> np.ndarray:
    """Row indexes as an int64 array (no per-row work for an array)."""
    if isinstance(indexes, np.ndarray):
        return indexes.astype(np.int64, copy=False).reshape(-1)
    if isinstance(indexes, range):
        return np.arange(indexes.start, indexes.stop, indexes.step, dtype=np.int64)
    return np.asarray(indexes if isinstance(indexes, (list, tuple)) else list(indexes), dtype=np.int64).reshape(-1)


def distinct_rows(partition: str, indexes: Any) -> np.ndarray:
    """A put's existing rows as an index array, each named once: a row named twice would
    count one cell's chunk twice (and free it while another row still used it)."""
    where = as_indexes(indexes)
    unique, counts = np.unique(where, return_counts=True)
    if len(unique) != len(where):
        raise ValueError(f"a put to partition {partition!r} names rows more than once: {unique[counts > 1][:8].tolist()}")
    return where


def unique_sorted(indexes: np.ndarray) -> np.ndarray:
    """Sorted unique indexes; skips the sort for the usual already-increasing batch."""
    if len(indexes) < 2 or (np.diff(indexes) > 0).all():
        return indexes
    return np.unique(indexes)


def rows_of(chunk: torch.Tensor, offsets: np.ndarray | range) -> torch.Tensor:
    if isinstance(offsets, range) and offsets.step == 1:
        return chunk if offsets.start == 0 and offsets.stop == chunk.shape[0] else chunk[offsets.start : offsets.stop]
    first, last = int(offsets[0]), int(offsets[-1])
    if last - first + 1 == len(offsets) and (len(offsets) < 3 or (np.diff(offsets) == 1).all()):
        return chunk[first : last + 1]
    return chunk[torch.from_numpy(offsets)]
