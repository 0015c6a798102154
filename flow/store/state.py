"""A store's state as plain data and back (`Store.state_dict`, `Store.from_state_dict`):
what `persist` writes to a file and a checkpoint holds. Apart from `persist` so that the
store imports this without `persist` (which builds stores) importing the store back."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tidal.flow.store.errors import StoreError
from tidal.flow.store.protocol import StoreApi
from tidal.flow.store.segments import Partition, Segment
from tidal.flow.store.units import RemoteChunk


def state_of(version: int, parts: Iterable[Partition], read_chunk: Callable[[RemoteChunk], Any] | None = None) -> dict[str, Any]:
    """`Store.state_dict`'s plain data (called under the store's lock): per partition its
    settings, every live row's (index, group, version, tags), cells and acks, and each
    consumer's counts (acked, dropped, redelivered). Chunks on storage units are read
    with `read_chunk`."""
    out = {}
    for part in parts:
        rows: list[list[Any]] = []
        columns: dict[str, list[list[Any]]] = {}  # column -> [index, cell] of each row that has it
        acked: dict[str, list[int]] = {c: [] for c in part.consumers}
        read: dict[int, Any] = {}  # chunk id -> the rows of a chunk on a storage unit

        def local(name: str, chunk_id: int, part: Partition = part, read: dict[int, Any] = read) -> Any:
            chunk = part.chunks[chunk_id]
            if not isinstance(chunk, RemoteChunk):
                return chunk
            if read_chunk is None:
                raise StoreError(
                    f"cannot save partition {part.name!r}: its column {name!r} is held on storage unit {chunk.unit} "
                    "(a split deployment); save through the store's server (StoreServer.save, RemoteStore.save), which reads the units"
                )
            if chunk_id not in read:
                read[chunk_id] = read_chunk(chunk)
            return read[chunk_id]

        for seg in part.segments:
            for k in np.flatnonzero(seg.alive).tolist():
                meta = seg.meta(k)
                rows.append([meta.index, meta.group, meta.version, meta.tags])
                for name, column in seg.columns.items():
                    chunk_id, offset = column.cell(k)
                    if chunk_id >= 0:
                        columns.setdefault(name, []).append([meta.index, local(name, chunk_id)[offset]])
                for c in part.consumers:
                    if seg.acked[c][k]:
                        acked[c].append(meta.index)
        out[part.name] = {
            "capacity_rows": part.capacity_rows,
            "capacity_bytes": part.capacity_bytes,
            "lease_s": part.lease_s,
            "next_index": part.next_index,
            "num_evicted": part.num_evicted,
            "rows": rows,
            "consumers": acked,
            "acked_counts": {c: s.num_acked for c, s in part.consumers.items()},
            "dropped_counts": {c: s.num_dropped for c, s in part.consumers.items()},
            "redelivered_counts": {c: s.num_redelivered for c, s in part.consumers.items()},
            "columns": columns,
        }
    return {"format": 1, "version": version, "partitions": out}


def restore(store: StoreApi, state: Mapping[str, Any], *, partition_of: Callable[[str], Partition]) -> None:
    """Fill a new, empty `store` (a `table.Store`) from `state_of`'s data (`Store.from_state_dict`);
    `partition_of(name)` is the store's own partition `name`, whose rows it makes in place."""
    if state.get("format") != 1:
        raise StoreError(f"unknown store state format {state.get('format')!r}")
    store.set_version(int(state["version"]))
    for name, p in state["partitions"].items():
        store.create_partition(name, consumers=list(p["consumers"]), capacity_rows=p["capacity_rows"], capacity_bytes=p["capacity_bytes"], lease_s=p["lease_s"])
        part = partition_of(name)
        for run in _consecutive(p["rows"]):  # a segment per run of consecutive rows keeps indexes as they were
            _, groups, versions, tags = zip(*run)
            part.add_segment(Segment(run[0][0], len(run), groups, versions, tags, part.consumers))
            part.num_rows += len(run)
        part.next_index = p["next_index"]
        for column, cells in p["columns"].items():
            if cells:
                store.put(name, {column: [v for _, v in cells]}, indexes=[i for i, _ in cells])
        for consumer, acked in p["consumers"].items():
            for seg, local, _ in part.locate(np.asarray(acked, dtype=np.int64)):
                seg.acked[consumer][local] = True
                part.touch(seg, consumer)
            counts = part.consumers[consumer]
            counts.num_acked = p.get("acked_counts", {}).get(consumer, len(acked) + p["num_evicted"])
            counts.num_dropped = p.get("dropped_counts", {}).get(consumer, 0)  # files from before 2026-11-25 lack these
            counts.num_redelivered = p.get("redelivered_counts", {}).get(consumer, 0)
        part.num_evicted = p["num_evicted"]


def _consecutive(rows: Sequence[Sequence[Any]]) -> Iterator[Sequence[Sequence[Any]]]:
    """Saved rows ([index, group, version, tags], in index order) in runs of consecutive
    indexes: a resumed store gets one segment per run, as few as the saved store had
    (one per row made every get walk every row in Python)."""
    start = 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or int(rows[k][0]) != int(rows[k - 1][0]) + 1:
            yield rows[start:k]
            start = k
