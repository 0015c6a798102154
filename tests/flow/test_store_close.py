"""Closing a remote store client while other threads of it wait, or hold it idle.

ZeroMQ forbids closing a socket that another thread is blocked on: `RemoteStore.close()`
closes only the sockets of threads outside a call, and a waiting thread ends its wait with
`StoreError` and closes its own sockets.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from tidal.flow.store import RemoteStore, StoreError
from tidal.flow.store import client as client_module


def _close_within(in_thread, client: RemoteStore, seconds: float) -> None:
    closer, outcome = in_thread(client.close)
    closer.join(seconds)
    assert not closer.is_alive(), f"close() did not return within {seconds}s"
    assert outcome == [None]


def _waits(client: RemoteStore, store):
    store.create_partition("p", consumers=["c"])
    store.create_partition("full", consumers=["c"], capacity_rows=1)
    store.put("full", {"x": torch.zeros(1, 1)})
    return {
        "get": lambda: client.get("c", "p", ["x"], 1),
        "cancellable get": lambda: client.get("c", "p", ["x"], 1, cancel=threading.Event()),
        "put": lambda: client.put("full", {"x": torch.ones(1, 1)}),
        "cancellable put": lambda: client.put("full", {"x": torch.ones(1, 1)}, cancel=threading.Event()),
    }


@pytest.mark.parametrize("wait", ["get", "cancellable get", "put", "cancellable put"])
def test_closing_a_client_ends_its_threads_waits_with_a_store_error(in_thread, served, monkeypatch, wait):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 30.0)  # only close() can end the wait in time
    store, server, _ = served
    client = RemoteStore(server.address, rpc_timeout_s=30)
    thread, outcome = in_thread(_waits(client, store)[wait])
    time.sleep(0.5)  # parked at the server
    assert thread.is_alive()
    _close_within(in_thread, client, 5)
    thread.join(5)
    assert not thread.is_alive()
    (error,) = outcome
    assert type(error) is StoreError and not isinstance(error, zmq.ZMQError), repr(error)
    assert f"the client of store server {server.address} was closed" in str(error)
    with pytest.raises(StoreError, match="is closed"):
        client.ping()


def test_closing_a_client_whose_threads_waited_leaves_the_server_serving_and_their_rows_unleased(in_thread, served, monkeypatch):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 30.0)
    store, server, other = served
    client = RemoteStore(server.address, rpc_timeout_s=30)
    store.create_partition("p", consumers=["c"])
    thread, outcome = in_thread(lambda: client.get("c", "p", ["x"], 1))
    time.sleep(0.5)
    _close_within(in_thread, client, 5)
    thread.join(5)
    store.put("p", {"x": torch.ones(1, 1)})  # not leased to the closed client's dropped get
    assert other.get("c", "p", ["x"], 1, timeout=5).indexes == [0]


def test_closing_a_client_closes_an_idle_threads_sockets_and_its_leases_return(in_thread, served):
    store, server, _ = served
    client = RemoteStore(server.address, rpc_timeout_s=30)
    store.create_partition("p", consumers=["c"])
    store.put("p", {"x": torch.ones(2, 1)})
    leased, go_on = threading.Event(), threading.Event()

    def take_and_idle() -> list:
        batch = client.get("c", "p", ["x"], 2, timeout=5)
        leased.set()
        go_on.wait(10)  # alive, holding its sockets and lease, not in a call
        with pytest.raises(StoreError, match=f"the client of store server {server.address} is closed"):
            client.ack("c", "p", batch.indexes)
        return batch.indexes

    thread, outcome = in_thread(take_and_idle)
    assert leased.wait(5)
    _close_within(in_thread, client, 5)
    go_on.set()
    thread.join(5)
    assert outcome == [[0, 1]]
    assert store.get("c", "p", ["x"], 2, timeout=5).indexes == [0, 1]  # its connection ended: redelivered


def test_a_pending_put_read_after_close_raises_a_store_error(in_thread, served):
    store, server, _ = served
    client = RemoteStore(server.address, rpc_timeout_s=30)
    store.create_partition("p", consumers=["c"])
    pending = client.submit_put("p", {"x": torch.ones(1, 1)})
    _close_within(in_thread, client, 5)
    with pytest.raises(StoreError, match=f"the client of store server {server.address} is closed"):
        pending.result()
