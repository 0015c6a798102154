"""tidal.flow.store: the streaming data store every stage talks through.

Rows are samples, columns are fields. Producers `put`, consumers `get` rows as soon as
they are ready (event-driven, no polling), leases make delivery at-least-once, samplers
pick batches (sequential, complete groups, staleness-bounded, length-balanced), capacity
applies back-pressure, and `save`/`load` carry in-flight data across a restart.

Between processes, a `StoreServer` serves a store (and/or a `StorageUnit`) over ZeroMQ
and a `RemoteStore` client offers the same API as the in-process `Store` (`StoreApi`; its
coroutine form, `AsyncStore`, is an `AsyncStoreApi`).
"""

from tidal.flow.store.aio import AsyncStore
from tidal.flow.store.cells import Batch
from tidal.flow.store.client import RemoteStore
from tidal.flow.store.protocol import AsyncStoreApi, PutResult, StoreApi
from tidal.flow.store.samplers import Grouped, RowMeta, SampleContext, Sampler, Selection, SeqlenBalanced, Sequential, StalenessFilter, TaggedFirst
from tidal.flow.store.server import StoreServer
from tidal.flow.store.table import Store, StoreError, StoreTimeout
from tidal.flow.store.units import Ref, StorageUnit

__all__ = [
    "AsyncStore",
    "AsyncStoreApi",
    "Batch",
    "Grouped",
    "PutResult",
    "Ref",
    "RemoteStore",
    "RowMeta",
    "SampleContext",
    "Sampler",
    "Selection",
    "SeqlenBalanced",
    "Sequential",
    "StalenessFilter",
    "StorageUnit",
    "Store",
    "StoreApi",
    "StoreError",
    "StoreServer",
    "StoreTimeout",
    "TaggedFirst",
]
