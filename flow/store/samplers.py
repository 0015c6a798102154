"""Samplers choose which ready rows a `get` hands out.

A sampler sees the rows that are ready for the calling consumer (all requested columns
present, not yet consumed, not leased), in readiness order, as `Rows`: a sequence of
`RowMeta` that also offers its indexes and versions as numpy arrays, so built-in samplers
never make a Python object per row. It returns a `Selection`:
the rows to hand out now, and the rows to drop for this consumer (never handed to it,
counted). Returning no rows means "not enough yet": the `get` keeps waiting, woken by the
next put, ack, lease expiry or version change. Samplers are plain objects with one
method; write your own by implementing `select`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, overload

import numpy as np

NO_VERSION = np.iinfo(np.int64).min
"""How `Rows.versions` marks a row put without a version (never stale)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RowMeta:
    """What a sampler knows about one row."""

    index: int
    group: int | str | None
    version: int | None
    tags: dict[str, Any]


class Rows(Sequence[RowMeta]):
    """Ready rows in readiness order: `indexes` and `versions` arrays, `RowMeta` on demand.

    A store hands its usual case - whole runs of consecutive rows - as `runs`, and makes
    the arrays only when a sampler reads them; `head(n)` takes the first n rows without.
    """

    def __init__(self, indexes: np.ndarray | None, versions: np.ndarray | None, meta: Callable[[np.ndarray], list[RowMeta]], *, runs: Sequence[tuple[int, int, np.ndarray]] | None = None) -> None:
        """`runs`: instead of the arrays, (first index, count, versions) of each run."""
        self._indexes = indexes
        self._versions = versions
        self._runs = runs
        self._len = len(indexes) if indexes is not None else sum(n for _, n, _ in runs or ())
        self._meta = meta
        self._metas: list[RowMeta] | None = None

    @property
    def indexes(self) -> np.ndarray:
        if self._indexes is None:
            runs = self._runs or ()
            self._indexes = np.concatenate([np.arange(first, first + n, dtype=np.int64) for first, n, _ in runs]) if runs else np.zeros(0, dtype=np.int64)
        return self._indexes

    @property
    def versions(self) -> np.ndarray:
        if self._versions is None:
            runs = self._runs or ()
            self._versions = np.concatenate([v for _, _, v in runs]) if runs else np.zeros(0, dtype=np.int64)
        return self._versions

    def head(self, n: int) -> range | np.ndarray:
        """The indexes of the first `n` rows (a `range` when they are consecutive)."""
        if self._indexes is None and self._runs and self._runs[0][1] >= n:
            first = self._runs[0][0]
            return range(first, first + n)
        return self.indexes[:n]

    def subset(self, keep: np.ndarray) -> Rows:
        """The rows selected by a boolean mask or positions, in the same order."""
        return Rows(self.indexes[keep], self.versions[keep], self._meta)

    @property
    def metas(self) -> list[RowMeta]:
        if self._metas is None:
            self._metas = self._meta(self.indexes)
        return self._metas

    @property
    def groups(self) -> list[Any]:
        return [m.group for m in self.metas]

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, k: int) -> RowMeta: ...
    @overload
    def __getitem__(self, k: slice) -> list[RowMeta]: ...
    def __getitem__(self, k: int | slice) -> RowMeta | list[RowMeta]:
        return self.metas[k]

    def __iter__(self) -> Iterator[RowMeta]:
        return iter(self.metas)


@dataclasses.dataclass(frozen=True, slots=True)
class SampleContext:
    version: int
    """The store's current policy version (`Store.set_version`)."""
    value: Callable[[int, str], Any]
    """`value(index, column)` reads one cell, e.g. to measure a sequence length."""


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    take: Sequence[int] | np.ndarray | range
    """Rows to hand out now, in batch order (a list, a range or an int array)."""
    drop: Sequence[int] | np.ndarray = dataclasses.field(default_factory=list)
    """Rows never to hand to this consumer (counted as dropped)."""


class Sampler(Protocol):
    def select(self, rows: Rows, batch_size: int, partial: bool, ctx: SampleContext) -> Selection:
        """Rows to hand out (exactly `batch_size`, or 1..batch_size if `partial`) and to drop."""
        ...


@dataclasses.dataclass
class Sequential:
    """Rows in the order they became ready."""

    def select(self, rows: Rows, batch_size: int, partial: bool, ctx: SampleContext) -> Selection:
        if len(rows) >= batch_size or (partial and len(rows)):
            return Selection(rows.head(batch_size))
        return Selection([])


def _check_count(sampler: str, name: str, value: Any) -> None:
    """Raise ValueError unless `value` is an int >= 1 (a batch is cut by it: 0 divided by zero at the first get)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{sampler} needs an integer {name} >= 1, got {value!r}")


@dataclasses.dataclass
class Grouped:
    """Complete groups only (GRPO): a batch holds every row of each group it touches.

    The samplers around a `Grouped` (at any depth of `inner`) keep its groups whole:
    `StalenessFilter` judges, drops and holds whole groups, `SeqlenBalanced` shortens a
    partial batch by whole groups, `TaggedFirst` hands out tagged groups whole.
    """

    group_size: int

    def __post_init__(self) -> None:
        _check_count("Grouped", "group_size", self.group_size)

    def select(self, rows: Rows, batch_size: int, partial: bool, ctx: SampleContext) -> Selection:
        if batch_size % self.group_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of group_size {self.group_size}")
        if not partial and len(rows) < batch_size:  # no batch yet; looking at every row's group would cost a waiting get O(rows) per put
            return Selection([])
        groups: dict[Any, list[int]] = {}
        for index, group in zip(rows.indexes.tolist(), rows.groups):
            if group is None:
                raise ValueError(f"row {index} has no group; Grouped needs put(..., groups=...)")
            groups.setdefault(group, []).append(index)
        take: list[int] = []
        for members in groups.values():
            if len(members) >= self.group_size and len(take) + self.group_size <= batch_size:
                take.extend(members[: self.group_size])
        if len(take) == batch_size or (partial and take):
            return Selection(take)
        return Selection([])


@dataclasses.dataclass
class StalenessFilter:
    """Never hand out a row older than `max_staleness` versions.

    A row produced by version v may be consumed while the store's version is at most
    v + max_staleness. Older rows are dropped for this consumer (`hold=False`, counted as
    dropped) or left in place (`hold=True`). Rows without a version are never stale.
    `at_version` judges rows as if the store were at that version (a trainer taking the
    next step's rows while this step trains), whatever version the store reaches meanwhile.

    Over a `Grouped` sampler the unit is the group: a group with any row too old is never
    handed out, and is dropped as a whole once all `group_size` of its rows are ready (so
    no row of it is left behind, waiting for rows that were dropped).
    """

    max_staleness: int
    inner: Any = dataclasses.field(default_factory=Sequential)
    hold: bool = False
    at_version: int | None = None

    def select(self, rows: Rows, batch_size: int, partial: bool, ctx: SampleContext) -> Selection:
        version = ctx.version if self.at_version is None else self.at_version
        old = (rows.versions != NO_VERSION) & (rows.versions < version - self.max_staleness)
        if not old.any():
            return self.inner.select(rows, batch_size, partial, ctx)
        stale = old
        group_size = group_size_of(self.inner)
        if group_size is not None:
            groups = rows.groups
            old = _whole_groups(groups, old)
            stale = old & _complete_groups(groups, group_size)
        inner = self.inner.select(rows.subset(~old), batch_size, partial, ctx)
        if self.hold:
            return inner
        return Selection(inner.take, [*rows.indexes[stale].tolist(), *inner.drop])


@dataclasses.dataclass
class SeqlenBalanced:
    """Order a batch so that `num_ranks` equal contiguous slices have balanced token counts.

    Rank r takes rows [r * n / num_ranks, (r + 1) * n / num_ranks) of a batch of n rows.
    Rows are assigned longest first to the rank with the fewest tokens that still has
    room. A partial batch is the largest one `inner` gives that every rank can share
    equally (a multiple of `num_ranks`, and of the group size over a `Grouped`); fewer
    ready rows than that wait. Put `TaggedFirst` inside this sampler, not around it.
    """

    num_ranks: int
    length_column: str
    inner: Any = dataclasses.field(default_factory=Sequential)

    def __post_init__(self) -> None:
        _check_count("SeqlenBalanced", "num_ranks", self.num_ranks)

    def select(self, rows: Rows, batch_size: int, partial: bool, ctx: SampleContext) -> Selection:
        if batch_size % self.num_ranks:
            raise ValueError(f"batch_size {batch_size} is not a multiple of num_ranks {self.num_ranks}")
        chosen = self.inner.select(rows, batch_size, partial, ctx)
        if len(chosen.take) % self.num_ranks:  # a partial batch: shorten it to one the ranks share
            unit = math.lcm(self.num_ranks, group_size_of(self.inner) or 1)
            size = len(chosen.take) - len(chosen.take) % unit
            exact = self.inner.select(rows, size, False, ctx) if size else Selection([])
            chosen = Selection(exact.take, np.union1d(np.asarray(chosen.drop, dtype=np.int64), np.asarray(exact.drop, dtype=np.int64)))
        if not len(chosen.take):
            return chosen
        take = np.asarray(chosen.take).tolist()
        per_rank = len(take) // self.num_ranks
        lengths = {i: _length(ctx.value(i, self.length_column)) for i in take}
        ranks: list[list[int]] = [[] for _ in range(self.num_ranks)]
        totals = [0] * self.num_ranks
        for i in sorted(take, key=lambda i: -lengths[i]):
            r = min((r for r in range(self.num_ranks) if len(ranks[r]) < per_rank), key=lambda r: totals[r])
            ranks[r].append(i)
            totals[r] += lengths[i]
        return Selection([i for rank in ranks for i in rank], chosen.drop)


@dataclasses.dataclass
class TaggedFirst:
    """Rows whose `tag` is set (a true value in `put(..., tags=...)`) first, in readiness
    order and not filtered by `inner`; the rest of the batch through `inner`. Reads every
    ready row's tags, so it suits short queues (a rollout's prompts: resumed groups go
    before fresh prompts). Over a `Grouped` sampler a group with a tagged row is tagged
    as a whole and handed out only complete, so a batch still holds whole groups."""

    tag: str
    inner: Any = dataclasses.field(default_factory=Sequential)

    def select(self, rows: Rows, batch_size: int, partial: bool, ctx: SampleContext) -> Selection:
        first = np.fromiter((bool(m.tags.get(self.tag)) for m in rows), dtype=bool, count=len(rows))
        if not first.any():
            return self.inner.select(rows, batch_size, partial, ctx)
        group_size = group_size_of(self.inner)
        if group_size is None:
            take = rows.indexes[first][:batch_size].tolist()
        else:
            first = _whole_groups(rows.groups, first)
            take = np.asarray(Grouped(group_size).select(rows.subset(first), batch_size, True, ctx).take, dtype=np.int64).tolist()
        rest = self.inner.select(rows.subset(~first), batch_size - len(take), True, ctx) if len(take) < batch_size else Selection([])
        take += np.asarray(rest.take, dtype=np.int64).tolist()
        return Selection(take if len(take) == batch_size or partial else [], rest.drop)


def group_size_of(sampler: Any) -> int | None:
    """The group size of the `Grouped` sampler in `sampler`'s chain of `inner`s, if any."""
    while sampler is not None:
        if isinstance(sampler, Grouped):
            return sampler.group_size
        sampler = getattr(sampler, "inner", None)
    return None


def _whole_groups(groups: Sequence[Any], marked: np.ndarray) -> np.ndarray:
    """`marked` widened to every row of each group that has a marked row (rows without a
    group stay as they are)."""
    hit = {g for g, m in zip(groups, marked.tolist()) if m and g is not None}
    return marked | np.fromiter((g in hit for g in groups), dtype=bool, count=len(groups))


def _complete_groups(groups: Sequence[Any], group_size: int) -> np.ndarray:
    """Which rows belong to a group with at least `group_size` rows among `groups`."""
    counts: dict[Any, int] = {}
    for g in groups:
        counts[g] = counts.get(g, 0) + 1
    return np.fromiter((g is not None and counts[g] >= group_size for g in groups), dtype=bool, count=len(groups))


def _length(value: Any) -> int:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    return len(value)


def to_spec(sampler: Sampler) -> dict[str, Any]:
    """A built-in sampler as plain data, to send to a store server (nothing is pickled).

    A subclass is refused: the server would run the built-in, not the subclass's `select`.
    """
    if type(sampler) is Sequential:
        return {"kind": "sequential"}
    if type(sampler) is Grouped:
        return {"kind": "grouped", "group_size": sampler.group_size}
    if type(sampler) is StalenessFilter:
        return {"kind": "staleness", "max_staleness": sampler.max_staleness, "hold": sampler.hold, "at_version": sampler.at_version, "inner": to_spec(sampler.inner)}
    if type(sampler) is SeqlenBalanced:
        return {"kind": "seqlen", "num_ranks": sampler.num_ranks, "length_column": sampler.length_column, "inner": to_spec(sampler.inner)}
    if type(sampler) is TaggedFirst:
        return {"kind": "tagged_first", "tag": sampler.tag, "inner": to_spec(sampler.inner)}
    raise ValueError(
        f"sampler {type(sampler).__name__} cannot be sent to a store server; remote gets take "
        "Sequential, Grouped, StalenessFilter, SeqlenBalanced or TaggedFirst (custom samplers run with an in-process Store)"
    )


def from_spec(spec: Any) -> Sampler:
    """Inverse of `to_spec`; raises ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"sampler spec must be a map, got {spec!r}")
    kind = spec.get("kind")

    def integer(key: str, minimum: int) -> int:
        value = spec.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"sampler {kind!r} needs integer {key} >= {minimum}, got {value!r}")
        return value

    def inner() -> Sampler:
        value = spec.get("inner")
        if value is None:
            raise ValueError(f"sampler {kind!r} spec lacks inner, the sampler it wraps (e.g. {{'kind': 'sequential'}})")
        if not isinstance(value, dict):
            raise ValueError(f"sampler {kind!r} needs inner to be a sampler spec (a map), got {value!r}")
        return from_spec(value)

    if kind == "sequential":
        return Sequential()
    if kind == "grouped":
        return Grouped(integer("group_size", 1))
    if kind == "staleness":
        at_version = spec.get("at_version")
        if at_version is not None and (not isinstance(at_version, int) or isinstance(at_version, bool)):
            raise ValueError(f"sampler 'staleness' needs an integer at_version or none, got {at_version!r}")
        hold = spec.get("hold", False)
        if not isinstance(hold, bool):
            raise ValueError(f"sampler 'staleness' needs a boolean hold, got {hold!r}")
        return StalenessFilter(integer("max_staleness", 0), inner(), hold, at_version)
    if kind == "seqlen":
        column = spec.get("length_column")
        if not isinstance(column, str):
            raise ValueError(f"sampler 'seqlen' needs a length_column name, got {column!r}")
        return SeqlenBalanced(integer("num_ranks", 1), column, inner())
    if kind == "tagged_first":
        tag = spec.get("tag")
        if not isinstance(tag, str):
            raise ValueError(f"sampler 'tagged_first' needs a tag name, got {tag!r}")
        return TaggedFirst(tag, inner())
    raise ValueError(f"unknown sampler kind {kind!r}; kinds: grouped, seqlen, sequential, staleness, tagged_first")
