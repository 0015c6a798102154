"""Property test: random interleavings of put / add column / get / ack / lease expiry /
consumer death / version bumps across three consumers.

Invariants: no row is handed to the staleness-bounded consumer when older than its bound;
each consumer's acks of a row count once; and after everything is drained, every row
reached every consumer (acked exactly once, or dropped as stale by the bounded one), also
across saves and loads of the store (a load gives leased rows back).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tidal.flow.clock import RealClock
from tidal.flow.store import StalenessFilter, Store, StoreTimeout
from tidal.flow.store.persist import load, save

MAX_STALENESS = 1
COLUMNS = {"rollout": ["prompt"], "reward": ["prompt", "response"], "train": ["prompt", "response"]}


class FakeTime:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class StoreMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.clock = FakeTime()
        self.store = Store(clock=RealClock(now=self.clock))
        self.tmp = tempfile.TemporaryDirectory()
        self.store.create_partition("p", consumers=list(COLUMNS), lease_s=5.0, capacity_rows=64)
        self.num_rows = 0
        self.versions: dict[int, int] = {}
        self.no_response: list[int] = []
        self.leased: dict[str, set[int]] = {c: set() for c in COLUMNS}
        self.acks: dict[str, dict[int, int]] = {c: {} for c in COLUMNS}

    def _sampler(self, consumer):
        return StalenessFilter(MAX_STALENESS) if consumer == "train" else None

    @precondition(lambda self: self.num_rows < 48)
    @rule(n=st.integers(1, 4), lag=st.integers(0, 2))
    def put_rows(self, n, lag):
        version = max(self.store.version - lag, 0)
        idx = self.store.put("p", {"prompt": list(range(n))}, versions=[version] * n, timeout=0)
        self.num_rows += n
        for i in idx:
            self.versions[i] = version
        self.no_response.extend(idx)

    @precondition(lambda self: self.no_response)
    @rule(k=st.integers(1, 4))
    def add_response(self, k):
        rows, self.no_response = self.no_response[:k], self.no_response[k:]
        self.store.put("p", {"response": [0] * len(rows)}, indexes=rows)

    @rule(consumer=st.sampled_from(list(COLUMNS)), size=st.integers(1, 4), partial=st.booleans())
    def get(self, consumer, size, partial):
        try:
            batch = self.store.get(consumer, "p", COLUMNS[consumer], size, sampler=self._sampler(consumer), partial=partial, timeout=0)
        except StoreTimeout:
            return
        assert 1 <= len(batch) <= size and (partial or len(batch) == size)
        if consumer == "train":
            for i in batch.indexes:
                assert self.versions[i] >= self.store.version - MAX_STALENESS, "stale row handed out"
        self.leased[consumer] |= set(batch.indexes)

    @rule(consumer=st.sampled_from(list(COLUMNS)), data=st.data())
    def ack(self, consumer, data):
        if not self.leased[consumer]:
            return
        rows = data.draw(st.lists(st.sampled_from(sorted(self.leased[consumer])), min_size=1, max_size=4, unique=True))
        for i in rows:
            self.acks[consumer][i] = self.acks[consumer].get(i, 0) + self.store.ack(consumer, "p", [i])
        self.leased[consumer] -= set(rows)

    @rule()
    def expire_leases(self):
        self.clock.now += 6.0
        for c in COLUMNS:
            self.leased[c].clear()

    @rule(consumer=st.sampled_from(list(COLUMNS)))
    def consumer_dies(self, consumer):
        self.store.release(consumer)
        self.leased[consumer].clear()

    @rule()
    def save_and_load(self):
        path = Path(self.tmp.name) / "store.bin"
        save(self.store, path)
        self.store = load(path, clock=RealClock(now=self.clock))
        for c in COLUMNS:
            self.leased[c].clear()  # saved as not consumed: delivered again

    @rule()
    def bump_version(self):
        self.store.set_version(self.store.version + 1)

    @invariant()
    def acked_at_most_once(self):
        for counts in self.acks.values():
            assert all(n <= 1 for n in counts.values())

    @invariant()
    def ready_rows_kept_between_gets_agree_with_a_fresh_look(self):
        part = self.store._part("p")
        bounds = {wanted: index.bound for wanted, index in part.ready_index.items()}
        for (consumer, key), bound in bounds.items():
            rows = part.ready(consumer, key)
            kept, part.ready_index = part.ready_index, {}
            fresh = part.ready(consumer, key)  # no index kept: every segment looked at
            part.ready_index = kept
            assert rows.indexes.tolist() == fresh.indexes.tolist() and rows.versions.tolist() == fresh.versions.tolist()
            assert bound is None or len(rows) <= bound, f"{consumer}: {len(rows)} rows ready, bound {bound}"  # a get needing more skips its look
            for limit in (1, 3):  # a sequential get's look: the first rows, and whether there are enough
                first = part.ready(consumer, key, limit)
                assert first.indexes.tolist()[:limit] == rows.indexes.tolist()[:limit] and (len(first) >= limit) == (len(rows) >= limit)
        for wanted, bound in bounds.items():
            part.ready_index[wanted].bound = bound  # as the rules left them: looking must not make the bounds exact

    def teardown(self):
        if not hasattr(self, "store"):
            return
        self.tmp.cleanup()
        if self.no_response:
            self.store.put("p", {"response": [0] * len(self.no_response)}, indexes=self.no_response)
        for c in COLUMNS:
            self.store.release(c)
            for _ in range(self.num_rows + 2):  # bounded: a get handing out leased rows again must fail here, not hang
                try:
                    batch = self.store.get(c, "p", COLUMNS[c], 64, sampler=self._sampler(c), partial=True, timeout=0)
                except StoreTimeout:
                    break
                for i in batch.indexes:
                    self.acks[c][i] = self.acks[c].get(i, 0) + self.store.ack(c, "p", [i])
            else:
                raise AssertionError(f"{c}: gets never ran dry")
        dropped = self.store.metrics()["partitions"]["p"]["consumers"]["train"]["dropped"]
        for c in COLUMNS:
            acked = {i for i, n in self.acks[c].items() if n == 1}
            missing = set(range(self.num_rows)) - acked
            if c == "train":
                assert len(missing) == dropped
                assert all(self.versions[i] < self.store.version - MAX_STALENESS for i in missing)
            else:
                assert not missing, f"{c} never got rows {sorted(missing)}"
        assert self.store.metrics()["partitions"]["p"]["rows"] == 0, "fully consumed rows must be evicted"


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
