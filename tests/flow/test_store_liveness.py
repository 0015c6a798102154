"""A remote get/put waiting on a server that died, or that restarted on the same address
(its parked request gone with the old process), ends with an error instead of waiting for ever."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import zmq

from tidal.flow.store import RemoteStore, Store, StoreError, StoreServer
from tidal.flow.store import client as client_module
from tidal.flow.store.units import RemoteChunk
from tidal.flow.store.wire import pack, unpack


def _a_store() -> Store:
    """A store where a get for 'prompts' and a put into 'train' both wait (no row; full)."""
    store = Store()
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["train"], capacity_rows=1)
    store.put("train", {"x": torch.zeros(1, 1)})
    return store


_CALLS = {
    "get": lambda client, cancel: client.get("rollout", "prompts", ["x"], 1, cancel=cancel),
    "put": lambda client, cancel: client.put("train", {"x": torch.ones(1, 1)}, cancel=cancel),
}
_WAITS = [(op, cancellable) for op in _CALLS for cancellable in (True, False)]


@pytest.mark.parametrize(("op", "cancellable"), _WAITS)
def test_a_wait_without_a_timeout_ends_when_its_server_restarts_on_the_same_address(in_thread, monkeypatch, wait_for, op, cancellable):
    """The restarted server answers every liveness check, but it never heard of the
    parked request: the client waited for ever (cancellable) or blocked for ever (not)."""
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.2)
    old = StoreServer(_a_store())
    client = RemoteStore(old.address, rpc_timeout_s=1.0)
    new = None
    try:
        thread, outcome = in_thread(lambda: _CALLS[op](client, threading.Event() if cancellable else None))
        wait_for(lambda: len(old._parked) == 1)
        old.close()
        new = StoreServer(_a_store(), address=old.address)
        begin = time.monotonic()
        thread.join(8)
        assert not thread.is_alive(), "the wait outlived its server's restart"
        assert time.monotonic() - begin < 3  # the next check (0.2 s of silence) learns the request is gone
        assert isinstance(outcome[0], StoreError)
        assert f"store server {old.address} no longer holds this {op!r}" in str(outcome[0])
        assert new._parked == []  # nothing was sent again behind the caller's back
    finally:
        client.close()
        if new is not None:
            new.close()


@pytest.mark.parametrize("op", list(_CALLS))
def test_a_wait_without_a_timeout_or_a_cancel_ends_when_its_server_dies(in_thread, monkeypatch, wait_for, op):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.2)
    server = StoreServer(_a_store())
    client = RemoteStore(server.address, rpc_timeout_s=1.0)
    try:
        thread, outcome = in_thread(lambda: _CALLS[op](client, None))
        wait_for(lambda: len(server._parked) == 1)
        server.close()
        begin = time.monotonic()
        thread.join(8)
        assert not thread.is_alive(), "a get/put without a timeout blocked for ever on a dead server"
        assert time.monotonic() - begin < 4  # a check after 0.2 s of silence, unanswered for 1 s
        assert isinstance(outcome[0], StoreError)
        assert f"store server {server.address} did not answer a ping within 1s while {op!r} waited; is it running?" in str(outcome[0])
    finally:
        client.close()


@pytest.mark.parametrize("cancellable", [True, False])
def test_a_wait_on_a_live_server_outlasts_the_rpc_timeout_and_checks_on_its_own_connection(in_thread, served, monkeypatch, cancellable):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.05)  # checked every 0.05 s
    store, server, _ = served
    store.create_partition("prompts", consumers=["rollout"])
    client = RemoteStore(server.address, rpc_timeout_s=0.3)
    try:
        thread, outcome = in_thread(lambda: _CALLS["get"](client, threading.Event() if cancellable else None))
        time.sleep(1.0)  # the wait under test: three rpc timeouts without a reply to the get
        assert thread.is_alive()
        assert len(server._peers) == 1  # no second connection per waiting thread
        store.put("prompts", {"x": torch.ones(1, 1)})
        thread.join(5)
        assert outcome[0].indexes == [0]
        assert client.ping()["store"]  # the checks' late answers, if any, are not taken for the ping's
    finally:
        client.close()


def test_a_get_cancelled_after_its_server_restarted_ends_at_once(in_thread, monkeypatch, wait_for):
    """The withdraw reaches the new server, which has nothing parked for this connection:
    the request is gone, so the cancel is done (it waited `rpc_timeout_s` for a reply no
    server would send, and then blamed the server for not running)."""
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 30.0)  # only the cancel ends it
    old = StoreServer(_a_store())
    client = RemoteStore(old.address, rpc_timeout_s=10.0)
    new = None
    try:
        cancel = threading.Event()
        thread, outcome = in_thread(lambda: _CALLS["get"](client, cancel))
        wait_for(lambda: len(old._parked) == 1)
        old.close()
        new = StoreServer(_a_store(), address=old.address)
        other = RemoteStore(old.address, rpc_timeout_s=10.0)
        assert other.ping()["store"]  # the new server is up and serving
        other.close()
        time.sleep(0.3)  # the waiting thread's connection reconnects too
        cancel.set()
        begin = time.monotonic()
        client.wake()
        thread.join(15)
        assert not thread.is_alive() and time.monotonic() - begin < 2
        assert isinstance(outcome[0], StoreError) and "cancelled" in str(outcome[0])
    finally:
        client.close()
        if new is not None:
            new.close()


@pytest.mark.parametrize("question", ["withdraw", "parked"])
def test_the_answer_about_a_request_comes_after_that_requests_own_reply(in_thread, served, question):
    """A put that goes in at once while other requests are parked has its reply sent after
    their retries. A withdraw (or a liveness check) about it read in the same round must
    not overtake that reply: the client takes "not parked" with no reply before it to
    mean the server lost the request."""
    store, server, client = served
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["train"])
    waiting, _ = in_thread(lambda: client.get("rollout", "prompts", ["x"], 1, timeout=5))  # parked: replies to puts are deferred
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        sock.send_multipart(pack({"op": "ping", "id": 1, "token": None, "args": {}}))
        assert unpack(sock.recv_multipart())["ok"]
        deadline = time.monotonic() + 5
        while not server._parked:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with server._lock:  # the server thread waits here: it reads both in one round
            sock.send_multipart(pack({"op": "put", "id": 2, "token": None, "args": {"partition": "train", "columns": {"x": torch.ones(1, 1)}}}))
            sock.send_multipart(pack({"op": question, "id": 3, "token": None, "args": {"request": 2}}))
            time.sleep(0.2)
        assert sock.poll(5000)
        first = unpack(sock.recv_multipart())
        assert sock.poll(5000)
        second = unpack(sock.recv_multipart())
        assert (first["id"], list(first["result"])) == (2, [0])
        assert (second["id"], second["result"]) == (3, False)
    finally:
        ctx.destroy(linger=0)
        store.put("prompts", {"x": torch.ones(1, 1)})
        waiting.join(5)


def test_the_server_says_whether_it_holds_a_request(served):
    _, _, client = served
    assert client._call("parked", {"request": 10**9}) is False
    with pytest.raises(ValueError, match="'request'"):
        client._call("parked", {})


def test_a_dead_storage_unit_never_stalls_its_controller(wait_for):
    """The controller tells a unit to drop each chunk it lets go of, without waiting for
    an answer. To a unit that died, those notes queued up until ZeroMQ's high-water mark
    (1000 messages), and then the server thread blocked in its send for ever: every
    client of the store hung."""
    dead = "tcp://127.0.0.1:1"  # nothing listens there
    store = Store()
    store.create_partition("p", consumers=["c"])
    with StoreServer(store) as server:
        client = RemoteStore(server.address, rpc_timeout_s=5)
        try:
            for k in range(1100):  # one chunk per put, each acked alone: one note per server round
                (index,) = client._call("put", {"partition": "p", "remote": {"x": RemoteChunk(dead, f"k{k}", np.array([4])).wire}})
                assert store.get("c", "p", ["x"], 1, timeout=5).indexes == [index]
                assert client.ack("c", "p", [index]) == 1  # every consumer acked: the chunk is let go of
            assert client.ping()["store"]  # the server still serves
            assert store.metrics()["partitions"]["p"]["rows"] == 0
        finally:
            client.close()


def test_a_closed_client_says_so_and_names_its_server(served):
    """A thread that had used the client got ZeroMQ's 'Socket operation on non-socket'."""
    _, server, _ = served
    client = RemoteStore(server.address)
    assert client.ping()["store"]
    client.close()
    for call in (client.ping, lambda: client.get("c", "p", ["x"], 1, timeout=0), lambda: client.put("p", {"x": torch.ones(1, 1)})):
        with pytest.raises(StoreError, match=f"the client of store server {server.address} is closed"):
            call()
    with pytest.raises(StoreError, match=f"the client of store server {server.address} is closed"):
        client.get("c", "p", ["x"], 1, cancel=threading.Event())


def test_a_late_reply_to_a_call_that_timed_out_is_never_taken_for_the_next_ones(served):
    store, server, _ = served
    store.create_partition("p", consumers=["c"])
    store.set_version(7)
    client = RemoteStore(server.address, rpc_timeout_s=0.3)
    try:
        assert client.ping()["store"]
        with server._lock:  # the server thread waits here before it reads the next request
            with pytest.raises(StoreError, match=f"store server {server.address} did not answer 'metrics' within 0.3s"):
                client.metrics()
        assert client.version == 7  # not the metrics that came late
        assert client.put("p", {"x": torch.ones(1, 1)}) == [0]
        assert client.ping()["store"]
    finally:
        client.close()


def test_a_remote_save_runs_beside_the_server_and_outlasts_the_rpc_timeout(in_thread, monkeypatch, tmp_path):
    """The server thread itself saved: every other client waited for the whole save, and a
    save longer than `rpc_timeout_s` failed its own client and the other clients' waits.
    It saves on a thread of its own now, and says it is still saving while it does."""
    from tidal.flow.store import persist

    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.2)
    write, writing = persist.write, threading.Event()

    def slow_write(state, path):
        writing.set()
        time.sleep(1.5)  # a large store, a slow disk
        write(state, path)

    monkeypatch.setattr(persist, "write", slow_write)
    store = _a_store()
    with StoreServer(store, persist_dir=tmp_path) as server:
        saver, other = RemoteStore(server.address, rpc_timeout_s=0.5), RemoteStore(server.address, rpc_timeout_s=0.5)
        try:
            thread, outcome = in_thread(lambda: saver.save(str(tmp_path / "store.bin")))
            assert writing.wait(5)
            begin = time.monotonic()
            other.create_partition("more", consumers=["c"])
            other.put("more", {"y": torch.ones(2, 1)})
            assert other.get("c", "more", ["y"], 2, timeout=1).indexes == [0, 1]
            assert time.monotonic() - begin < 0.5 and thread.is_alive()  # served while the save goes on
            thread.join(10)
            assert outcome == [None]  # 1.5 s, three times the rpc timeout
            assert persist.load(tmp_path / "store.bin").metrics()["partitions"]["train"]["rows"] == 1
            with pytest.raises(StoreError, match="FileNotFoundError"):  # the save's own error reaches its client
                saver.save(str(tmp_path / "no-such-dir" / "store.bin"))
            assert other.ping()["store"] is True
        finally:
            saver.close()
            other.close()
