"""tidal.flow.store: the streaming data store every stage talks through.

Rows are samples, columns are fields. Producers `put`, consumers `get` rows as soon as
they are ready (event-driven, no polling), leases make delivery at-least-once, samplers
pick batches (sequential, complete groups, staleness-bounded, length-balanced), capacity
applies back-pressure, and `save`/`load` carry in-flight data across a restart.
"""

from tidal.flow.store.aio import AsyncStore
from tidal.flow.store.samplers import Grouped, RowMeta, SampleContext, Sampler, Selection, SeqlenBalanced, Sequential, StalenessFilter
from tidal.flow.store.table import Batch, Store, StoreError, StoreTimeout

__all__ = [
    "AsyncStore",
    "Batch",
    "Grouped",
    "RowMeta",
    "SampleContext",
    "Sampler",
    "Selection",
    "SeqlenBalanced",
    "Sequential",
    "StalenessFilter",
    "Store",
    "StoreError",
    "StoreTimeout",
]
