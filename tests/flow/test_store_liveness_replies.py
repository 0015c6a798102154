"""Each reply goes to the request it answers: an error about a message whose header named
its request is that request's, on the server's side and on the client's."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal.flow.store import StoreError, shm

pytestmark = pytest.mark.skipif(shm.host_id() is None or not shm.has_room(64 << 20), reason="needs a writable /dev/shm with room beyond the store's reserve")

BIG = shm.MIN_BYTES // 4  # float32 elements: a row of this many goes by shared memory


def _fail_once_in(thread_name: str, monkeypatch, where=None, what: str = "mmap") -> None:
    """The next call of `where.what` (a server mapping a segment, by default; a client
    reads one with `os.preadv`) in the thread named `thread_name` fails as when memory runs out."""
    where = shm.mmap if where is None else where
    real, failed = getattr(where, what), []

    def fail_once(*args, **kwargs):
        if not failed and threading.current_thread().name == thread_name:
            failed.append(True)
            raise OSError(12, "Cannot allocate memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(where, what, fail_once)


def test_a_put_the_server_cannot_map_fails_itself_not_the_put_read_first(served, monkeypatch):
    """The server's error reply to a put whose segment it could not map had no id, so a
    client reading a later pipelined put's result first took it as that put's answer:
    the put that went in raised, and the one that failed waited for a reply that had come."""
    store, _, client = served
    store.create_partition("train", consumers=["train"])
    assert client.shares_host()
    _fail_once_in("tidal-store-server", monkeypatch)
    failing = client.submit_put("train", {"x": torch.randn(1, BIG)})
    going_in = client.submit_put("train", {"x": torch.ones(1, 1)}, timeout=5)
    assert going_in.result() == [0]
    with pytest.raises(StoreError, match="cannot map segment"):
        failing.result()
    assert store.metrics()["partitions"]["train"]["rows"] == 1


def test_a_reply_the_client_cannot_read_fails_that_get_and_names_the_server(served, monkeypatch):
    store, _, client = served
    store.create_partition("train", consumers=["train"])
    assert client.shares_host()
    client.put("train", {"x": torch.randn(1, BIG)})  # by shared memory: the get's reply names the segment
    thread_name = threading.current_thread().name
    _fail_once_in(thread_name, monkeypatch, shm.os, "preadv")
    with pytest.raises(StoreError, match=f"malformed reply from store server {client.address}: cannot read segment"):
        client.get("train", "train", ["x"], 1, timeout=5)
    assert client.ping()["store"]  # the connection serves on

