"""What a newcomer to the store runs into: start order, 1-D columns, timeouts, reprs, and a
store server that runs on its own (`tidal store serve`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from tidal.flow.store import AsyncStore, Batch, RemoteStore, Store, StoreServer, StoreTimeout


@pytest.fixture
def served():
    store = Store()
    with StoreServer(store) as server:
        clients: list[RemoteStore] = []

        def client() -> RemoteStore:
            clients.append(RemoteStore(server.address, rpc_timeout_s=5.0))
            return clients[-1]

        yield store, server, client
        for c in clients:
            c.close()


def test_create_partition_with_exist_ok_takes_the_same_partition_in_either_order(served):
    store, _, client = served
    producer, consumer = client(), client()
    consumer.create_partition("train", consumers=["trainer"], capacity_rows=64, exist_ok=True)  # the consumer came first
    producer.create_partition("train", consumers=["trainer"], capacity_rows=64, exist_ok=True)
    producer.put("train", {"x": torch.ones(2, 3)})
    assert consumer.get("trainer", "train", ["x"], 2, timeout=5).stack("x").shape == (2, 3)
    with pytest.raises(ValueError, match=r"partition 'train' already exists; create_partition\(\.\.\., exist_ok=True\)"):
        producer.create_partition("train", consumers=["trainer"], capacity_rows=64)
    with pytest.raises(ValueError, match=r"other settings: consumers=\['reward', 'trainer'\] \(it has \['trainer'\]\), capacity_rows=None \(it has 64\)"):
        store.create_partition("train", consumers=["trainer", "reward"], exist_ok=True)


def test_wait_partition_returns_once_the_producer_creates_it(in_thread):
    store = Store()
    waiter, outcome = in_thread(lambda: store.wait_partition("train", timeout=10))
    assert waiter.is_alive()  # no such partition yet
    store.create_partition("train", consumers=["c"])
    waiter.join(timeout=5)
    assert not waiter.is_alive() and outcome == [None]
    store.wait_partition("train", timeout=0)  # at once when it exists
    with pytest.raises(StoreTimeout, match=r"wait_partition\('val'\) timed out after 0.05s: no partition 'val'; partitions: \['train'\]"):
        store.wait_partition("val", timeout=0.05)
    with pytest.raises(ValueError, match=r"no partition 'val'; partitions: \['train'\] \(wait_partition\('val'\) waits until it is created\)"):
        store.get("c", "val", ["x"], 1)


def test_a_remote_consumer_that_starts_before_the_producer_waits_for_its_partition(served, in_thread):
    store, _, client = served
    consumer = client()
    waiter, outcome = in_thread(lambda: consumer.wait_partition("train", timeout=20))
    assert waiter.is_alive()
    client().create_partition("train", consumers=["c"])  # another process's client
    waiter.join(timeout=10)
    assert outcome == [None]
    consumer.wait_partition("train", timeout=0)
    waiter, outcome = in_thread(lambda: consumer.wait_partition("val", timeout=20))
    store.create_partition("val", consumers=["c"])  # in the server's process: its change retries the parked wait
    waiter.join(timeout=10)
    assert outcome == [None]
    with pytest.raises(StoreTimeout, match=r"wait_partition\('nope'\) timed out after 0.1s: no partition 'nope'; partitions: \['train', 'val'\]"):
        consumer.wait_partition("nope", timeout=0.1)


def test_wait_partition_ends_when_cancelled(served, in_thread):
    _, _, client = served
    consumer, cancel = client(), threading.Event()
    waiter, outcome = in_thread(lambda: consumer.wait_partition("train", cancel=cancel))
    cancel.set()
    consumer.wake()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "was cancelled" in str(outcome[0])


def test_async_store_waits_for_a_partition():
    import asyncio

    store = Store()

    async def main() -> None:
        waiting = asyncio.ensure_future(AsyncStore(store).wait_partition("p", timeout=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        store.create_partition("p", consumers=["c"])
        await asyncio.wait_for(waiting, timeout=5)

    asyncio.run(main())


@pytest.mark.parametrize("remote", [False, True])
def test_a_lone_1d_column_is_refused_by_name_and_num_rows_makes_it_rows(served, remote):
    store, _, client = served
    target = client() if remote else store
    target.create_partition("p", consumers=["c"])
    with pytest.raises(ValueError, match=r"column 'x' is a 1-D tensor of 256 values: 256 rows of one value each, or one row of 256 values\? Pass num_rows=256 for 256 rows, or x\[None\] \(shape \[1, 256\]\) for one row"):
        target.put("p", {"x": torch.zeros(256)})
    with pytest.raises(ValueError, match="column 'r' is a 1-D array of 3 values"):
        target.put("p", {"r": np.zeros(3)})
    assert list(target.put("p", {"x": torch.zeros(256)[None]})) == [0]  # one row of 256
    assert list(target.put("p", {"x": torch.arange(3.0)}, num_rows=3)) == [1, 2, 3]  # three rows of one
    assert list(target.put("p", {"x": torch.arange(2.0), "meta": [{}, {}]})) == [4, 5]  # the list says how many rows
    assert list(target.put("p", {"x": torch.arange(2.0), "y": torch.zeros(2, 4)})) == [6, 7]  # so does a 2-D column
    assert list(target.put("p", {"x": torch.ones(2)}, [1, 2])) == [1, 2]  # indexes too
    assert list(target.put("p", {"x": torch.ones(1)})) == [8]  # one value: one row either way
    with pytest.raises(ValueError, match="num_rows=3 but 2 indexes were given"):
        target.put("p", {"x": torch.ones(2)}, [1, 2], num_rows=3)
    with pytest.raises(ValueError, match="num_rows must be a number of rows >= 0"):
        target.put("p", {"x": torch.ones(2)}, num_rows=-1)
    with pytest.raises(ValueError, match=r"column 'x' has leading dimension \(2,\) for 3 rows"):
        target.put("p", {"x": torch.ones(2)}, num_rows=3)


@pytest.mark.parametrize("remote", [False, True])
def test_a_get_that_times_out_names_the_columns_it_waited_for_and_those_there_are(served, remote):
    store, _, client = served
    target = client() if remote else store
    target.create_partition("p", consumers=["c"])
    target.put("p", {"tokens": torch.zeros(2, 3), "meta": [{}, {}]})
    with pytest.raises(StoreTimeout) as raised:
        target.get("c", "p", ["tokens", "reward"], 2, timeout=0.05)
    assert str(raised.value) == (
        "get('c', 'p', ['reward', 'tokens']) timed out after 0.05s: 0 of 2 rows were ready; "
        "waited for columns ['reward', 'tokens'], the partition's rows have ['meta', 'tokens'] (none has ['reward'])"
    )
    with pytest.raises(StoreTimeout, match=r"1 of 2 rows were ready; waited for columns \['tokens'\], the partition's rows have \['meta', 'tokens'\]$"):
        target.get("c", "p", ["tokens"], 1, timeout=0) and target.get("c", "p", ["tokens"], 2, timeout=0.05)


def test_a_batch_repr_is_one_short_line_however_many_rows_it_has():
    store = Store()
    store.create_partition("p", consumers=["c"])
    store.put("p", {"x": torch.zeros(5000, 256), "meta": [{}] * 5000}, versions=[3] * 5000)
    batch = store.get("c", "p", ["x", "meta"], 5000)
    assert repr(batch) == "Batch(5000 rows of 'p': rows 0..4999; versions 3; {meta: 5000 cells, x: float32[5000, 256]})"
    assert batch.stack("x").shape == (5000, 256)  # the column as one tensor (a view of the put's)
    assert repr(Batch("p", [7, 3, 9, 1, 2], {}, None, [1, None, 2, 2, 2])) == "Batch(5 rows of 'p': rows 7, 3, 9, 1, ... (5); versions 1..2 (some none); {})"
    assert 'batch.stack("x")' in Batch.__doc__


def test_a_put_is_answered_before_the_get_it_wakes(served, in_thread, wait_for):
    """The producer waits for its put's reply; a consumer the put wakes is answered right after
    (before the server reads its next request), not before."""
    _, server, client = served
    producer, consumer = client(), client()
    producer.create_partition("p", consumers=["c"])
    replies: list[str] = []
    reply = server._reply

    def record(peer, request_id, result, taken=None):
        replies.append("get" if isinstance(result, dict) and "columns" in result else type(result).__name__)
        reply(peer, request_id, result, taken)

    server._reply = record
    getter, got = in_thread(lambda: consumer.get("c", "p", ["x"], 1, timeout=20))
    wait_for(lambda: len(server._parked) == 1)
    assert list(producer.put("p", {"x": torch.ones(1, 4)})) == [0]
    getter.join(timeout=10)
    assert got[0].stack("x").tolist() == [[1.0] * 4]
    assert replies[-2:] == ["range", "get"]


def test_serve_forever_returns_once_the_server_is_closed(in_thread):
    server = StoreServer(Store())
    serving, outcome = in_thread(server.serve_forever)
    assert serving.is_alive()
    server.close()
    serving.join(timeout=10)
    assert not serving.is_alive() and outcome == [None]


def test_tidal_store_serve_runs_a_server_on_its_own_until_sigterm(tmp_path):
    env = {**os.environ, "TIDAL_STORE_TOKEN": "s3cret"}
    cmd = [sys.executable, "-m", "tidal.tools.cli", "store", "serve", "--partition", "train:reward,trainer", "--capacity-rows", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else address
        with RemoteStore(address, token="s3cret", rpc_timeout_s=10) as store:
            store.wait_partition("train", timeout=0)
            store.create_partition("train", consumers=["reward", "trainer"], capacity_rows=8, exist_ok=True)
            store.put("train", {"x": torch.ones(2, 2)})
            assert store.get("trainer", "train", ["x"], 2, timeout=10).indexes == [0, 1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_store_server_process_leaves_its_start_up_objects_out_of_garbage_collections(monkeypatch, capsys):
    code = "from tidal.flow.store.memory import freeze_startup_objects; import gc; n = freeze_startup_objects(); print(n, gc.get_freeze_count())"
    frozen, count = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert int(frozen) == int(count) > 10_000  # torch's and NumPy's modules, at least
    from tidal.flow.store import serve

    calls = []

    class Server:
        address = "tcp://127.0.0.1:1"

        def __init__(self, store, **kw):
            calls.append("server")

        def serve_forever(self):
            calls.append("serving")

    monkeypatch.setattr(serve, "StoreServer", Server)
    monkeypatch.setattr(serve, "freeze_startup_objects", lambda: calls.append("frozen"))
    monkeypatch.setattr(serve.signal, "signal", lambda *a: None)
    assert serve.main([]) == 0 and calls == ["server", "frozen", "serving"]  # once it is set up, before it serves
    assert capsys.readouterr().out == "tcp://127.0.0.1:1\n"


def test_tidal_store_serve_refuses_a_public_address_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_STORE_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "tidal.tools.cli", "store", "serve", "--host", "0.0.0.0"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "token" in done.stderr and done.stdout == ""
    done = subprocess.run([sys.executable, "-m", "tidal.tools.cli", "store", "serve", "--partition", "train"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--partition takes NAME:CONSUMER[,CONSUMER...], got 'train'" in done.stderr
