"""The store across processes: ZeroMQ server and client, storage units, dying consumers, fuzzed frames."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.flow.clock import RealClock
from tidal.flow.store import Grouped, RemoteStore, StalenessFilter, StorageUnit, Store, StoreError, StoreServer, StoreTimeout, TaggedFirst
from tidal.flow.store.samplers import Sampler, Selection


def test_remote_round_trip_matches_local(served):
    store, server, client = served
    client.create_partition("train", consumers=["reward", "train"])
    indexes = client.put("train", {"response": [torch.arange(3), torch.arange(5)], "prompt": ["1+1", "2+2"]}, groups=[7, 7], versions=[0, 1])
    assert indexes == [0, 1]
    client.put("train", {"reward": torch.tensor([1.0, 0.0])}, indexes)
    batch = client.get("train", "train", ["response", "reward"], 2, timeout=5)
    assert batch.indexes == [0, 1] and batch.groups == [7, 7] and batch.versions == [0, 1]
    assert [r.tolist() for r in batch.columns["response"]] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    assert batch.stack("reward").tolist() == [1.0, 0.0]
    assert client.ack("train", "train", batch.indexes) == 2
    assert client.ack("train", "train", batch.indexes) == 0  # idempotent over the wire too
    other = client.get("reward", "train", ["prompt"], 2, timeout=5)
    assert other.columns["prompt"] == ["1+1", "2+2"]
    client.ack("reward", "train", other.indexes)
    assert store.metrics()["partitions"]["train"]["rows"] == 0  # evicted once both consumers acked
    client.set_version(4)
    assert client.version == 4 == store.version


def test_remote_errors_name_the_problem(served):
    _, _, client = served
    client.create_partition("train", consumers=["train"])
    with pytest.raises(ValueError, match="'nobody' is not a consumer"):
        client.get("nobody", "train", ["x"], 1, timeout=1)
    with pytest.raises(ValueError, match="no partition 'val'"):
        client.put("val", {"x": torch.zeros(1)})
    client.put("train", {"x": torch.zeros(1, 2)})
    with pytest.raises(StoreTimeout, match="1 of 3 rows were ready"):
        client.get("train", "train", ["x"], 3, timeout=0.2)

    class Custom(Sampler):
        def select(self, rows, batch_size, partial, ctx):
            return Selection([])

    with pytest.raises(ValueError, match="Custom cannot be sent"):
        client.get("train", "train", ["x"], 1, sampler=Custom(), timeout=1)


def test_bad_timeouts_get_an_error_and_the_server_keeps_serving(served):
    _, server, client = served
    client.create_partition("train", consumers=["train"])
    for timeout in ("soon", -1, True, float("nan")):  # NaN passed the check, was parked, and its deadline ended the server thread
        with pytest.raises(ValueError, match="timeout must be a number"):
            client._call("get", {"consumer": "train", "partition": "train", "columns": ["x"], "batch_size": 1, "timeout": timeout})
    assert client.ping()["store"]


def test_remote_samplers_run_on_the_server(served):
    store, _, client = served
    client.create_partition("train", consumers=["train"])
    client.put("train", {"x": torch.zeros(4, 1)}, groups=["a", "b", "a", "b"], versions=[0, 2, 0, 0])
    client.set_version(2)
    with pytest.raises(StoreTimeout):
        client.get("train", "train", ["x"], 2, sampler=StalenessFilter(1, Grouped(2)), timeout=0.2)
    assert store.metrics()["partitions"]["train"]["consumers"]["train"]["dropped"] == 4  # b has a fresh row, but goes whole
    client.put("train", {"x": torch.ones(2, 1)}, tags=[{}, {"resume": True}])
    assert client.get("train", "train", ["x"], 2, sampler=TaggedFirst("resume"), timeout=0.2).indexes == [5, 4]


def test_blocking_get_is_woken_by_another_clients_put(served):
    _, server, client = served
    client.create_partition("train", consumers=["train"])
    result: dict[str, object] = {}

    def consume() -> None:
        consumer = RemoteStore(server.address)
        start = time.monotonic()
        result["batch"] = consumer.get("train", "train", ["x"], 2, timeout=10)
        result["waited"] = time.monotonic() - start
        consumer.close()

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.3)
    assert "batch" not in result
    client.put("train", {"x": torch.ones(2, 3)})
    thread.join(timeout=10)
    assert result["batch"].indexes == [0, 1]  # type: ignore[union-attr]
    assert 0.3 <= result["waited"] < 5  # type: ignore[operator]


def test_capacity_bound_producer_blocks_and_resumes_over_the_wire(served):
    _, server, client = served
    client.create_partition("train", consumers=["train"], capacity_rows=2)
    client.put("train", {"x": torch.zeros(2, 1)})
    with pytest.raises(StoreTimeout, match="is full"):
        client.put("train", {"x": torch.zeros(1, 1)}, timeout=0.2)
    done = threading.Event()

    def produce() -> None:
        producer = RemoteStore(server.address)
        producer.put("train", {"x": torch.zeros(1, 1)}, timeout=10)
        producer.close()
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    assert not done.wait(0.3)  # blocked: the partition is full
    batch = client.get("train", "train", ["x"], 2, timeout=5)
    client.ack("train", "train", batch.indexes)
    assert done.wait(5)
    thread.join()


_DOOMED_CONSUMER = textwrap.dedent(
    """
    import sys
    from tidal.flow.store import RemoteStore
    store = RemoteStore(sys.argv[1])
    batch = store.get("train", "train", ["x"], 2, timeout=30)
    print("got", batch.indexes, flush=True)
    store.get("train", "train", ["x"], 1, timeout=30)  # killed while waiting here
    print("unexpected", flush=True)
    """
)


def test_consumer_process_killed_mid_get_loses_nothing(served):
    store, server, client = served
    client.create_partition("train", consumers=["train"])
    client.put("train", {"x": torch.arange(2).reshape(2, 1)})
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_CONSUMER, server.address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "got [0, 1]"
        time.sleep(0.3)  # its second get is now parked on the server
        assert store.metrics()["partitions"]["train"]["consumers"]["train"]["leased"] == 2
    finally:
        proc.kill()
        proc.wait(timeout=10)
    batch = client.get("train", "train", ["x"], 2, timeout=10)  # released when its connection died
    assert batch.indexes == [0, 1]
    client.put("train", {"x": torch.tensor([[2]])})  # not swallowed by the dead process's get
    assert client.get("train", "train", ["x"], 1, timeout=10).indexes == [2]
    consumer = store.metrics()["partitions"]["train"]["consumers"]["train"]
    assert consumer["redelivered"] == 2 and consumer["leased"] == 3


def test_a_closed_connection_returns_only_the_leases_it_still_holds(wait_for):
    now = [0.0]
    store = Store(clock=RealClock(now=lambda: now[0]))
    store.create_partition("train", consumers=["train"], lease_s=10)
    store.put("train", {"x": torch.arange(2).reshape(2, 1)})
    with StoreServer(store) as server:
        first, second = RemoteStore(server.address), RemoteStore(server.address)
        try:
            assert first.get("train", "train", ["x"], 2, timeout=5).indexes == [0, 1]
            now[0] = 11.0  # first's lease expires; the rows go to second
            assert second.get("train", "train", ["x"], 2, timeout=5).indexes == [0, 1]
            first.close()  # its connection ends: the rows are second's now, nothing comes back
            time.sleep(0.3)
            consumer = store.metrics()["partitions"]["train"]["consumers"]["train"]
            assert consumer["leased"] == 2 and consumer["redelivered"] == 2
            second.close()  # this one held them: they come back
            wait_for(lambda: store.metrics()["partitions"]["train"]["consumers"]["train"]["leased"] == 0)
            assert store.metrics()["partitions"]["train"]["consumers"]["train"]["redelivered"] == 4
        finally:
            first.close()
            second.close()


def test_in_process_puts_answer_parked_remote_gets_from_the_putting_thread(wait_for):
    store = Store()
    store.create_partition("train", consumers=["train"])
    with StoreServer(store) as server:
        wakes = []
        wake = server._wake
        server._wake = lambda: (wakes.append(threading.current_thread().name), wake())  # type: ignore[method-assign]
        consumer = RemoteStore(server.address)
        got: list[int] = []
        thread = threading.Thread(target=lambda: got.extend(consumer.get("train", "train", ["x"], 1, timeout=10).indexes))
        thread.start()
        wait_for(lambda: bool(server._parked))
        store.put("train", {"x": torch.ones(1, 2)})  # answers the parked get here, in this thread
        thread.join(timeout=10)
        assert got == [0] and wakes == []  # the server thread was not needed
        consumer.close()


def test_many_in_process_producers_and_remote_consumers_deliver_every_row_once():
    store = Store()
    store.create_partition("train", consumers=["train"], capacity_rows=64)
    num_producers, per_producer = 4, 60
    with StoreServer(store) as server:
        seen: list[int] = []
        lock = threading.Lock()

        def produce(k: int) -> None:
            for i in range(per_producer):
                store.put("train", {"x": torch.full((1, 1), k * 1000 + i)}, timeout=30)

        def consume() -> None:
            client = RemoteStore(server.address)
            previous: list[int] = []
            try:
                while True:
                    try:
                        batch = client.get("train", "train", ["x"], 3, partial=True, timeout=1.0, ack=previous)
                    except StoreTimeout:
                        client.ack("train", "train", previous)
                        return
                    with lock:
                        seen.extend(int(v) for v in batch.stack("x").flatten())
                    previous = batch.indexes
            finally:
                client.close()

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(num_producers)]
        threads += [threading.Thread(target=consume) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(seen) == sorted(k * 1000 + i for k in range(num_producers) for i in range(per_producer))
        assert store.metrics()["partitions"]["train"]["rows"] == 0


def test_non_local_bind_requires_a_token():
    with pytest.raises(ValueError, match="reachable from other machines"):
        StoreServer(Store(), address="tcp://0.0.0.0:0")
    with StoreServer(Store(), address="tcp://0.0.0.0:0", token="s3cret") as server:
        address = server.address.replace("0.0.0.0", "127.0.0.1")
        anonymous, wrong, right = RemoteStore(address, token=""), RemoteStore(address, token="nope"), RemoteStore(address, token="s3cret")
        try:
            for client in (anonymous, wrong):
                with pytest.raises(StoreError, match="wrong store token"):
                    client.metrics()
            assert right.metrics()["version"] == 0
        finally:
            for client in (anonymous, wrong, right):
                client.close()


def _raw_call(sock: zmq.Socket, frames: list[bytes]) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(5000), "the server did not answer"
    reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False)
    assert isinstance(reply, dict) and "ok" in reply
    return reply


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["__", "d", "s", "b", "op", "id", "args", "x"]), inner, max_size=4),
    max_leaves=12,
)
_ops = st.sampled_from(["get", "put", "ack", "release", "create_partition", "metrics", "unit_read", "unit_write", "unit_drop", "bogus"])
_args = st.dictionaries(st.sampled_from(["partition", "consumer", "columns", "batch_size", "indexes", "name", "consumers", "remote", "key", "offsets", "keys", "chunk", "sampler"]), _plain, max_size=6)
# timeout 0: a fuzzed request that happens to be a valid get must answer now, not wait for rows
_segment_names = st.sampled_from(["tidal-000000000000-0", "tidal-weights-1-0", "../../etc/passwd", ""]) | st.text(max_size=8)
_shm_entries = _plain | st.lists(st.lists(st.integers(-1, 3) | _segment_names, min_size=4, max_size=4) | st.tuples(st.integers(-1, 3), _segment_names, st.integers(-5, 1 << 40), st.integers(-5, 1 << 20)).map(list), max_size=3)
_requests = st.fixed_dictionaries(
    {"op": _ops, "id": st.integers(0, 10) | st.text(max_size=2), "args": _args.map(lambda a: {**a, "timeout": 0})},
    optional={"shm": _shm_entries, "host": st.text(max_size=4)},  # shared-memory buffers that are not there
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),
    st.tuples(_requests, st.lists(st.binary(max_size=32), max_size=3)).map(lambda m: [msgpack.packb(m[0]), *m[1]]),
))
def test_fuzzed_frames_get_replies_and_never_stop_the_server(fuzz_server, frames):
    server, sock = fuzz_server
    reply = _raw_call(sock, frames)
    if not reply["ok"]:
        assert reply["error"] and isinstance(reply["message"], str)
    ping = _raw_call(sock, [msgpack.packb({"op": "ping", "id": 1, "args": {}})])
    assert ping["ok"] and ping["result"]["store"] is True and ping["result"]["unit"] is True


@pytest.mark.parametrize("value", [
    {"__": "a", "d": "S0", "s": [1], "x": b""},  # a zero-size dtype
    {"__": "a", "d": "<f4", "s": [0, 2**62], "x": b""},  # empty, and too big for NumPy
    {"__": "t", "d": "float32", "s": [0, 2**64 - 1], "x": b""},  # empty, and too big for torch
    {"__": "t", "d": ["float32"], "s": [1], "x": b"1234"},  # an unhashable dtype name
], ids=["zero-itemsize", "np-too-big", "torch-too-big", "unhashable-dtype"])
def test_a_descriptor_numpy_or_torch_refuses_gets_an_error_reply(fuzz_server, value):
    """Such descriptors raised ValueError / TypeError out of the codec, past the server's
    error reply: the request was never answered."""
    server, sock = fuzz_server
    reply = _raw_call(sock, [msgpack.packb({"op": "ping", "id": 7, "args": {"x": value}})])
    assert not reply["ok"] and reply["id"] == 7 and reply["error"] == "WireError"


def test_a_request_that_decodes_to_something_but_a_map_gets_an_error_reply(fuzz_server):
    """A header map that is itself a codec descriptor decoded to a range or a tuple, which
    the server then read as a map: AttributeError, and the request was never answered."""
    server, sock = fuzz_server
    for header in ({"__": "r", "r": [0, 1, 1], "id": 4}, {"__": "u", "v": [1], "id": 5}):
        reply = _raw_call(sock, [msgpack.packb(header)])
        assert not reply["ok"] and reply["id"] == header["id"] and reply["error"] == "WireError"


@pytest.fixture(scope="module")
def fuzz_server():
    store = Store()
    store.create_partition("train", consumers=["c"])
    with StoreServer(store, unit=StorageUnit()) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        yield server, sock
        sock.close(linger=0)
        ctx.term()
        assert server._thread.is_alive()


def test_get_can_ack_the_previous_batch(served):
    store, _, client = served
    client.create_partition("train", consumers=["train"], capacity_rows=4)
    client.put("train", {"x": torch.arange(4).reshape(4, 1)})
    first = client.get("train", "train", ["x"], 2, timeout=5)
    second = client.get("train", "train", ["x"], 2, timeout=5, ack=first.indexes)
    assert second.indexes == [2, 3]
    assert store.metrics()["partitions"]["train"]["rows"] == 2  # the first batch was acked and evicted
    client.put("train", {"x": torch.zeros(2, 1)}, timeout=5)  # room freed by that ack
    with pytest.raises(StoreError, match="never had row 99"):
        client.get("train", "train", ["x"], 1, timeout=5, ack=[99])


def test_put_acks_its_prompts_atomically_even_when_it_waits_for_room(served):
    store, server, client = served
    client.create_partition("prompts", consumers=["rollout"])
    client.create_partition("train", consumers=["train"], capacity_rows=1)
    prompts = client.put("prompts", {"prompt": ["1+1", "2+2"]})
    worker = RemoteStore(server.address, rpc_timeout_s=10)
    assert worker.get("rollout", "prompts", ["prompt"], 2, timeout=5).indexes == prompts
    client.put("train", {"x": torch.zeros(1, 1)})  # the partition is full
    with pytest.raises(StoreTimeout, match="is full"):
        worker.put("train", {"x": torch.zeros(1, 1)}, ack=("rollout", "prompts", prompts), timeout=0.2)
    assert store.metrics()["partitions"]["prompts"]["consumers"]["rollout"]["leased"] == 2  # not acked without the put
    done = threading.Event()
    thread = threading.Thread(target=lambda: (worker.put("train", {"x": torch.ones(1, 1)}, ack=("rollout", "prompts", prompts), timeout=10), done.set()))
    thread.start()
    assert not done.wait(0.3)  # parked on the server, its ack with it
    batch = client.get("train", "train", ["x"], 1, timeout=5)
    client.ack("train", "train", batch.indexes)
    assert done.wait(5)
    thread.join()
    assert store.metrics()["partitions"]["prompts"]["rows"] == 0  # put and ack landed together
    worker.close()  # its connection ends: nothing was leased any more, nothing comes back
    time.sleep(0.3)
    assert store.metrics()["partitions"]["prompts"]["consumers"]["rollout"]["redelivered"] == 0


def test_a_store_that_outlives_its_server_stops_calling_it():
    store = Store()
    store.create_partition("train", consumers=["c"])
    for _ in range(2):  # a run that restarts its server keeps one store
        with StoreServer(store) as server:
            client = RemoteStore(server.address)
            client.put("train", {"x": torch.zeros(1, 2)})
            assert len(store._signals.change_listeners) == 1
            client.close()
    assert store._signals.change_listeners == [] and store._signals.free_listeners == []
    store.put("train", {"x": torch.ones(1, 2)})
    assert store.get("c", "train", ["x"], 3, timeout=0).indexes == [0, 1, 2]


def test_pipelined_puts_and_a_waiting_consumer_never_stall_the_server():
    """Replies the server sends after reading its socket dry can take the edge of its file
    descriptor for a request that arrived meanwhile; the server must look again."""
    store = Store()
    with StoreServer(store) as server:
        for round_ in range(40):
            store.create_partition(f"p{round_}", consumers=["c"])
            producer, consumer = RemoteStore(server.address, rpc_timeout_s=5), RemoteStore(server.address, rpc_timeout_s=5)
            got: list[int] = []

            def consume() -> None:
                previous: list[int] = []
                while len(got) < 64:
                    batch = consumer.get("c", f"p{round_}", ["x"], 8, timeout=5, partial=True, ack=previous)
                    got.extend(batch.indexes)
                    previous = batch.indexes
                consumer.ack("c", f"p{round_}", previous)

            thread = threading.Thread(target=consume)
            thread.start()
            pending = [producer.submit_put(f"p{round_}", {"x": torch.zeros(4, 8)}, timeout=5) for _ in range(16)]
            assert [p.result() for p in pending] == [[4 * k + j for j in range(4)] for k in range(16)]
            thread.join(30)
            assert not thread.is_alive() and sorted(got) == list(range(64)), round_
            producer.close()
            consumer.close()


def test_a_get_queued_by_a_client_that_then_died_leases_nothing(served):
    """The server is busy when a client sends a get and dies: by the time the server reads
    the get, the disconnect is handled. The get is dropped, not served to a client that is
    gone (its rows stayed leased to nobody until the lease ran out)."""
    from tidal.flow.store.wire import pack, unpack

    store, server, client = served
    store.create_partition("p", consumers=["c"], lease_s=3600)
    store.put("p", {"x": torch.arange(4)}, num_rows=4)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(server.address)
        sock.send_multipart(pack({"op": "ping", "id": 1, "token": None, "args": {}}))
        assert unpack(sock.recv_multipart())["ok"]
        with server._lock:  # the server thread waits here before it reads the next request
            sock.send_multipart(pack({"op": "get", "id": 2, "token": None, "args": {"consumer": "c", "partition": "p", "columns": ["x"], "batch_size": 2, "timeout": 5}}))
            time.sleep(0.3)
            sock.close()  # dies with its get queued
            time.sleep(0.5)
        assert sorted(client.get("c", "p", ["x"], 4, timeout=5).indexes) == [0, 1, 2, 3]
    finally:
        ctx.term()


def test_a_parked_request_whose_reply_cannot_be_sent_gets_an_error_and_the_server_serves_on(served, monkeypatch):
    import tidal.flow.store.server as server_module

    store, server, client = served
    store.create_partition("p", consumers=["c"])
    real_pack = server_module.pack
    failing = [True]

    def pack(message, **kwargs):
        if failing[0] and message.get("ok") and isinstance(message.get("result"), dict) and "indexes" in message["result"]:
            raise TypeError("cannot encode this batch")
        return real_pack(message, **kwargs)

    monkeypatch.setattr(server_module, "pack", pack)
    got: list = []
    consumer = RemoteStore(server.address, rpc_timeout_s=10)
    waiter = threading.Thread(target=lambda: _capture_call(got, lambda: consumer.get("c", "p", ["x"], 2, timeout=5)))
    waiter.start()
    time.sleep(0.3)  # parked
    client.put("p", {"x": torch.arange(2)}, num_rows=2)
    waiter.join(10)
    assert len(got) == 1 and isinstance(got[0], TypeError) and "cannot encode this batch" in str(got[0])  # the error, as the server saw it
    assert client.ping() is not None and server._thread.is_alive()
    with pytest.raises(TypeError, match="cannot encode"):  # served at once, not parked: the same
        consumer.get("c", "p", ["x"], 2, timeout=5)
    failing[0] = False
    assert sorted(consumer.get("c", "p", ["x"], 2, timeout=5).indexes) == [0, 1]  # the rows came back, on the same connection
    consumer.close()


def test_a_get_whose_columns_cannot_be_encoded_gives_its_rows_back(served, monkeypatch):
    import tidal.flow.store.wire as server_module  # the server encodes a get's columns there

    store, server, client = served
    store.create_partition("p", consumers=["c"], lease_s=3600)
    client.put("p", {"x": torch.arange(3)}, num_rows=3)
    real = server_module.encode_batch_column
    monkeypatch.setattr(server_module, "encode_batch_column", lambda batch, name: (_ for _ in ()).throw(ValueError("bad column")))
    with pytest.raises(ValueError, match="bad column"):
        client.get("c", "p", ["x"], 3, timeout=5)
    monkeypatch.setattr(server_module, "encode_batch_column", real)
    assert sorted(client.get("c", "p", ["x"], 3, timeout=0).indexes) == [0, 1, 2]


def _capture_call(out: list, fn) -> None:
    try:
        out.append(fn())
    except Exception as e:  # the test looks at it
        out.append(e)


def test_numpy_columns_keep_their_dtype_and_values_over_the_wire(served):
    store, server, client = served
    store.create_partition("p", consumers=["c"])
    client.put("p", {"x": np.array([0.1, 0.2, 1e-300]), "i": np.array([1, 2, 3], dtype=np.int32)}, num_rows=3)
    remote = client.get("c", "p", ["x", "i"], 3)
    assert remote.stack("x").dtype == torch.float64 and remote.stack("i").dtype == torch.int32
    assert remote.stack("x").tolist() == [0.1, 0.2, 1e-300]  # were float32 / int64 / 0.0: cell by cell, as Python scalars


def test_a_thread_that_ends_holding_rows_gives_them_back(served):
    """Leases belong to the connection that took them, and each thread has its own: when a
    thread ends (here without acking), its sockets close and the server releases its rows."""
    store, server, client = served
    store.create_partition("p", consumers=["c"], lease_s=3600)
    store.put("p", {"x": torch.arange(2)}, num_rows=2)
    taken: list = []
    worker = threading.Thread(target=lambda: taken.append(client.get("c", "p", ["x"], 2, timeout=5, cancel=threading.Event()).indexes))
    worker.start()
    worker.join()
    assert taken == [[0, 1]]
    assert sorted(client.get("c", "p", ["x"], 2, timeout=5).indexes) == [0, 1]


def test_a_server_whose_port_is_taken_leaks_nothing(wait_for):
    """The failed bind left the server's context (its I/O threads) and router open, five
    descriptors a try, for as long as the error lived (and unclosed-socket warnings after)."""
    with StoreServer(Store()) as taken:
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            StoreServer(Store(), address=taken.address)  # once first: what the first failure opens for good is not counted
        before = len(os.listdir("/proc/self/fd"))
        errors = []
        for _ in range(3):
            with pytest.raises(zmq.ZMQError, match="Address already in use") as info:
                StoreServer(Store(), address=taken.address)
            errors.append(info)  # held, as a caller that reports it does (its traceback holds the half-built server)
        wait_for(lambda: len(os.listdir("/proc/self/fd")) <= before, timeout=10)


def test_a_remote_get_of_columns_given_as_one_string_is_refused_not_left_waiting(served):
    """The client split "reward" into columns 'r', 'e', ... before the store could name it."""
    _, _, client = served
    client.create_partition("p", consumers=["c"])
    client.put("p", {"reward": [1.0]})
    with pytest.raises(ValueError, match=r"columns must be a list of column names, got the string 'reward'; pass \['reward'\]"):
        client.get("c", "p", "reward", 1, timeout=0)
    assert client.get("c", "p", ["reward"], 1, timeout=0).indexes == [0]
