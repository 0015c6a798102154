"""What a waiting get costs while rows trickle in: one-row puts into a partition whose
consumer waits for a batch must not each look at every row ready so far (that made
filling a batch of n one-row puts cost n^2 segment visits, and a put's reply 13x slower
after 2,000 of them), nor describe a timeout nobody reached. Counted, not timed."""

from __future__ import annotations

import threading

import pytest

from tidal.flow.store import RemoteStore, Store, StoreServer, StoreTimeout
from tidal.flow.store.ready import ReadyIndex
from tidal.flow.store.segments import Partition

NUM_PUTS = 40


@pytest.fixture
def counted(monkeypatch):
    """Counts of `Partition.ready` (a look at every segment that may have rows) and
    `Partition.column_names` (the timeout's description: a look at every segment)."""
    calls = {"ready": 0, "column_names": 0}
    for name in calls:
        original = getattr(Partition, name)

        def counting(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(Partition, name, counting)
    return calls


def test_a_remote_get_waiting_for_a_batch_looks_at_the_rows_a_constant_number_of_times(counted):
    store = Store()
    store.create_partition("p", consumers=["c"])
    with StoreServer(store) as server, RemoteStore(server.address, rpc_timeout_s=10) as producer, RemoteStore(server.address, rpc_timeout_s=10) as consumer:
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(consumer.get("c", "p", ["x"], NUM_PUTS, timeout=30)))
        waiter.start()
        while not server._parked:  # the get has arrived and waits
            threading.Event().wait(0.01)
        before = dict(counted)
        for i in range(NUM_PUTS):
            producer.put("p", {"x": [i]})
        waiter.join(30)
        assert got and got[0].columns["x"] == list(range(NUM_PUTS))
        # without the bound, every put retried the get through `ready` (40 looks), and
        # described its timeout (40 more): now the last put's retry looks once
        assert counted["ready"] - before["ready"] <= 2, counted
        assert counted["column_names"] == 0, counted


def test_a_local_get_waiting_for_a_batch_looks_at_the_rows_a_constant_number_of_times(counted):
    store = Store()
    store.create_partition("p", consumers=["c"])
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(store.get("c", "p", ["x"], NUM_PUTS, timeout=30)))
    waiter.start()
    while counted["ready"] == 0:  # it looked once, found nothing, and waits
        threading.Event().wait(0.01)
    for i in range(NUM_PUTS):
        store.put("p", {"x": [i]})
        threading.Event().wait(0.001)  # let the waiter wake between puts, as it would between processes
    waiter.join(30)
    assert got and got[0].columns["x"] == list(range(NUM_PUTS))
    assert counted["ready"] <= 3, counted
    assert counted["column_names"] == 0, counted


def test_a_get_that_times_out_over_the_wire_still_says_what_it_waited_for(counted):
    store = Store()
    store.create_partition("p", consumers=["c"])
    with StoreServer(store) as server, RemoteStore(server.address, rpc_timeout_s=10) as client:
        client.put("p", {"x": [1, 2]})
        with pytest.raises(StoreTimeout, match=r"timed out after 0.3s: 2 of 5 rows were ready; waited for columns \['x'\], the partition's rows have \['x'\]"):
            client.get("c", "p", ["x"], 5, timeout=0.3)
    assert counted["column_names"] == 1  # once, when the deadline passed


def test_rows_given_back_count_for_a_waiting_get():
    """A lease given back (released, or expired) makes rows ready again without a put:
    the bound a waiting get checks grows with them."""
    store = Store()
    store.create_partition("p", consumers=["c"], lease_s=60)
    store.put("p", {"x": [0, 1, 2]})
    first = store.get("c", "p", ["x"], 3, timeout=0)
    with pytest.raises(StoreTimeout):
        store.get("c", "p", ["x"], 3, timeout=0)
    store.release("c", "p", first.indexes)
    assert store.get("c", "p", ["x"], 3, timeout=0).indexes == [0, 1, 2]


def test_a_get_from_a_long_backlog_looks_at_the_rows_it_takes_not_at_every_waiting_one(monkeypatch):
    """A producer ahead of its consumer: 300 one-row segments wait. After the first get
    has found them all, a get of 4 rows reads 4 segments' worth (it took 10 ms a get with
    8,000 waiting, in a pass over all of them, against 0.05 ms now)."""
    store = Store()
    store.create_partition("p", consumers=["c"])
    for i in range(300):
        store.put("p", {"x": [i]})
    runs_read: list[int] = []
    original = ReadyIndex.runs

    def counting(self, limit):
        out = original(self, limit)
        runs_read.append(len(out))
        return out

    monkeypatch.setattr(ReadyIndex, "runs", counting)
    index = None
    taken = []
    for _ in range(20):
        batch = store.get("c", "p", ["x"], 4, timeout=0)
        taken += batch.columns["x"]
        store.ack("c", "p", batch.indexes)
        index = store._parts["p"].ready_index[("c", frozenset({"x"}))]
        assert len(index.unsettled) <= 4  # only those the get touched are looked at again
    assert taken == list(range(80))  # in the order they were put
    assert max(runs_read) == 4 and index.settled_rows == 220
