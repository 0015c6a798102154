"""What every form of the store offers: `StoreApi` (the in-process `Store`, the `RemoteStore`
client of a store server) and `AsyncStoreApi` (`AsyncStore`, the same calls as coroutines).

A stage that only puts, gets and acks rows (rollout workers, `rows.put_trajectories`, the
benchmark's producers and consumers) takes a `StoreApi` and runs the same in the trainer's
process or in another one. What only the in-process store does (listeners, its lock, saving
its state, per-consumer counters, partition settings changed in place) is not here: code that
needs it takes a `Store`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from tidal.flow.clock import ClockEvent
from tidal.flow.store.cells import Batch
from tidal.flow.store.samplers import Sampler


class PutResult(Protocol):
    """A put handed in with `submit_put`: in process it is done already, a remote one is
    still on its way."""

    def result(self) -> list[int]:
        """The new (or written) rows' indexes, once the put is in; raises its error."""
        ...


@runtime_checkable
class StoreApi(Protocol):
    """A streaming store of partitions of rows (samples) and columns (fields).

    Design choices every implementation keeps:

    - Event-driven: a `get` waits until `batch_size` rows have every column it asks for
      (`partial=True`: at least one), a `put` of new rows waits for room (back-pressure).
      Nobody polls.
    - Every blocking call is bounded and can be ended: `timeout` (seconds; `StoreTimeout`
      after it) and a `cancel` event, which ends the wait with `StoreError` once set and
      `wake()` is called (a stopping stage sets its event and wakes the store).
    - Delivery is at least once: a row got is leased to its consumer until acked (`ack`,
      idempotent) or given back (`release`, or its lease expires); a put's `ack=` acks the
      rows it was made from in the same step, so a stage's hand-off is exactly once.
    - Staleness travels on the data: each row carries the policy version it came from
      (`put(versions=)`, `Batch.versions`), and samplers compare it with the store's
      version (`set_version`).

    The store's version is not part of this protocol: a remote read is a round trip, and
    before Python 3.12 an `isinstance` check reads every member of a runtime protocol.
    `isinstance` sees the names only, not their signatures (tests compare those).
    """

    def create_partition(self, name: str, *, consumers: Sequence[str], capacity_rows: int | None = None, capacity_bytes: int | None = None, lease_s: float = 300.0, exist_ok: bool = False) -> None:
        """A partition whose rows stay until each of `consumers` acked them; `exist_ok`
        takes one with the same settings as it is."""
        ...

    def wait_partition(self, name: str, *, timeout: float | None = None, cancel: ClockEvent | None = None) -> None:
        """Return once partition `name` exists."""
        ...

    def add_consumer(self, partition: str, consumer: str) -> None:
        """A new consumer of `partition`; it sees every row not yet evicted."""
        ...

    def set_version(self, version: int) -> None:
        """The current policy version, read by staleness-aware samplers."""
        ...

    def put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        *,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
        cancel: ClockEvent | None = None,
        ack: tuple[str, str, Sequence[int]] | None = None,
        num_rows: int | None = None,
    ) -> list[int]:
        """Add rows (`indexes=None`) or columns to existing rows; return their indexes.
        `ack=(consumer, partition, indexes)` acks those rows in the same step."""
        ...

    def submit_put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        *,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
        ack: tuple[str, str, Sequence[int]] | None = None,
        num_rows: int | None = None,
    ) -> PutResult:
        """`put` without waiting for it: several may be in flight; the columns must not
        change until `result()` returned."""
        ...

    def get(
        self,
        consumer: str,
        partition: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        partial: bool = False,
        ack: Iterable[int] | None = None,
        cancel: ClockEvent | None = None,
    ) -> Batch:
        """Wait until `batch_size` rows with `columns` are ready for `consumer` and lease
        them to it; `ack` acks the previous batch first."""
        ...

    def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        """Mark rows done for `consumer`; return how many were newly acked."""
        ...

    def release(self, consumer: str, partition: str | None = None, indexes: Iterable[int] | None = None) -> int:
        """Give rows leased to `consumer` back to its ready set; return how many came back."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Counts per partition, column and consumer."""
        ...

    def wake(self) -> None:
        """End the waits whose `cancel` event is set now."""
        ...

    def close(self) -> None:
        """End every wait with `StoreError`; later calls fail."""
        ...


@runtime_checkable
class AsyncStoreApi(Protocol):
    """The store's waiting calls as coroutines, for an event loop (`AsyncStore`).

    There is no `cancel` event: cancelling the task that awaits a call ends it, and a get
    cancelled after it leased rows gives them back. `isinstance` cannot tell a coroutine
    from a plain method: it only says the names are there.
    """

    async def put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        *,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
        ack: tuple[str, str, Sequence[int]] | None = None,
        num_rows: int | None = None,
    ) -> list[int]:
        """As `StoreApi.put`."""
        ...

    async def get(
        self,
        consumer: str,
        partition: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        partial: bool = False,
        ack: Iterable[int] | None = None,
    ) -> Batch:
        """As `StoreApi.get`."""
        ...

    async def wait_partition(self, name: str, *, timeout: float | None = None) -> None:
        """As `StoreApi.wait_partition`."""
        ...

    async def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        """As `StoreApi.ack`."""
        ...
