"""Cancellable remote gets and puts: sent once, withdrawn at the server when cancelled."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tidal.flow.store import RemoteStore, StoreError, StoreTimeout, shm
from tidal.flow.store import client as client_module
from tidal.hal import owner

BIG = shm.MIN_BYTES // 4  # float32 elements: a row of this many goes by shared memory where it can



def test_a_cancelled_remote_get_ends_on_wake_and_is_withdrawn_at_the_server(in_thread, served, monkeypatch):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 30.0)  # only wake() can end the wait in time
    store, _, client = served
    client.create_partition("prompts", consumers=["rollout"])
    cancel = threading.Event()
    thread, outcome = in_thread(lambda: client.get("rollout", "prompts", ["x"], 1, cancel=cancel))
    time.sleep(0.3)  # parked at the server
    assert thread.is_alive()
    cancel.set()
    begin = time.monotonic()
    client.wake()
    thread.join(5)
    assert time.monotonic() - begin < 2 and isinstance(outcome[0], StoreError) and "cancelled" in str(outcome[0])
    # withdrawn, not merely abandoned: a row put now is not leased to the waiting thread's
    # connection (still open), so a get from another thread takes it
    store.put("prompts", {"x": torch.ones(1, 1)})
    assert client.get("rollout", "prompts", ["x"], 1, timeout=5).indexes == [0]


def test_a_cancelled_remote_put_into_a_full_partition_ends_on_wake_and_puts_nothing(in_thread, served, monkeypatch):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 30.0)
    store, _, client = served
    client.create_partition("train", consumers=["train"], capacity_rows=1)
    client.put("train", {"x": torch.zeros(1, 1)})
    cancel = threading.Event()
    thread, outcome = in_thread(lambda: client.put("train", {"x": torch.ones(1, 1)}, cancel=cancel))
    time.sleep(0.3)
    cancel.set()
    client.wake()
    thread.join(5)
    assert not thread.is_alive() and isinstance(outcome[0], StoreError)
    batch = store.get("train", "train", ["x"], 1, timeout=1)
    store.ack("train", "train", batch.indexes)
    with pytest.raises(StoreTimeout):  # the cancelled put did not go in once room was made
        store.get("train", "train", ["x"], 1, timeout=0.3)


def test_a_stop_just_before_a_threads_first_cancellable_wait_is_not_missed(in_thread, served, monkeypatch):
    # The stop sets the event and wakes before the thread has subscribed to wakes: that
    # wake reaches nobody, so only a look at the event after subscribing can see the stop.
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 30.0)
    _, _, client = served
    client.create_partition("prompts", consumers=["rollout"])
    cancel = threading.Event()
    subscribe = client._wake_listener

    def stopped_first():
        if not cancel.is_set():
            cancel.set()
            client.wake()
        return subscribe()

    monkeypatch.setattr(client, "_wake_listener", stopped_first)
    begin = time.monotonic()
    thread, outcome = in_thread(lambda: client.get("rollout", "prompts", ["x"], 1, cancel=cancel))
    thread.join(5)
    assert time.monotonic() - begin < 2 and isinstance(outcome[0], StoreError) and "cancelled" in str(outcome[0])


def test_a_wake_without_a_cancel_leaves_waits_alone_and_withdrawing_an_answered_request_says_so(in_thread, served):
    store, _, client = served
    client.create_partition("prompts", consumers=["rollout"])
    cancel = threading.Event()
    thread, outcome = in_thread(lambda: client.get("rollout", "prompts", ["x"], 1, cancel=cancel))
    time.sleep(0.2)
    client.wake()  # nothing to cancel: the get waits on
    time.sleep(0.2)
    assert thread.is_alive()
    store.put("prompts", {"x": torch.ones(1, 1)})
    thread.join(5)
    assert outcome[0].indexes == [0]
    assert client._call("withdraw", {"request": 10**9}) is False  # no such request parked




def _count_puts(client: RemoteStore, monkeypatch) -> dict[str, int]:
    """How many put requests `client` sends, and how many shared-memory segments it writes."""
    counts = {"puts": 0, "segments": 0}
    send, write = client._send, client._writer.write

    def counted_send(address, op, args):
        counts["puts"] += op == "put"
        return send(address, op, args)

    def counted_write(buffers):
        counts["segments"] += 1
        return write(buffers)

    monkeypatch.setattr(client, "_send", counted_send)
    monkeypatch.setattr(client._writer, "write", counted_write)
    return counts


def test_a_cancellable_put_waiting_for_room_is_sent_once_and_keeps_its_place(in_thread, served, monkeypatch, wait_for):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.05)
    store, server, client = served
    client.create_partition("train", consumers=["train"], capacity_rows=1)
    client.put("train", {"x": torch.zeros(1, BIG)})
    counts = _count_puts(client, monkeypatch)
    first, first_out = in_thread(lambda: client.put("train", {"x": torch.ones(1, BIG)}, cancel=threading.Event()))
    wait_for(lambda: len(server._parked) == 1)
    time.sleep(0.5)  # ten cancel checks: none of them sends the put again
    other = RemoteStore(server.address, rpc_timeout_s=10)
    second, second_out = in_thread(lambda: other.put("train", {"x": torch.full((1, 1), 2.0)}))
    wait_for(lambda: len(server._parked) == 2)
    time.sleep(0.3)
    assert first.is_alive() and second.is_alive() and counts["puts"] == 1
    assert counts["segments"] == (1 if client.shares_host() else 0)
    store.ack("train", "train", store.get("train", "train", ["x"], 1, timeout=5).indexes)
    first.join(5)
    assert first_out == [[1]]  # the cancellable put was parked first, so it goes in first
    assert second.is_alive()
    store.ack("train", "train", [1])
    second.join(5)
    assert second_out == [[2]] and counts["puts"] == 1
    other.close()


def test_a_cancelled_put_without_a_wake_is_withdrawn_and_leaves_nothing_behind(in_thread, served, monkeypatch, wait_for):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.05)  # no wake(): the client's own check sees the event
    store, server, client = served
    client.create_partition("train", consumers=["train"], capacity_rows=1)
    client.put("train", {"x": torch.zeros(1, BIG)})
    own = f"@{owner.tag()}"  # this process's segments: the other test worker makes its own meanwhile

    def mine() -> set[str]:
        return {name for name in shm.leftovers() if name.endswith(own)}

    before = mine()
    cancel = threading.Event()
    thread, outcome = in_thread(lambda: client.put("train", {"x": torch.ones(1, BIG)}, cancel=cancel))
    wait_for(lambda: len(server._parked) == 1)
    assert mine() - before  # the waiting put's segment, under this process's name
    cancel.set()
    thread.join(5)
    assert not thread.is_alive() and isinstance(outcome[0], StoreError) and "cancelled" in str(outcome[0])
    assert server._parked == []
    gc.collect()
    assert mine() <= before  # its segment went with it
    store.ack("train", "train", store.get("train", "train", ["x"], 1, timeout=5).indexes)
    with pytest.raises(StoreTimeout):  # room was made, and the cancelled put did not take it
        store.get("train", "train", ["x"], 1, timeout=0.3)
    assert store.metrics()["partitions"]["train"]["rows"] == 0
    assert client.put("train", {"x": torch.ones(1, 1)}, cancel=threading.Event()) == [1]  # no index was taken; the connection serves on


def test_a_cancellable_put_or_get_still_times_out(served, monkeypatch, wait_for):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.05)
    _, server, client = served
    client.create_partition("train", consumers=["train"], capacity_rows=1)
    client.put("train", {"x": torch.zeros(1, 1)})
    with pytest.raises(StoreTimeout):
        client.put("train", {"x": torch.zeros(1, 1)}, timeout=0.3, cancel=threading.Event())
    client.create_partition("prompts", consumers=["rollout"])
    with pytest.raises(StoreTimeout):
        client.get("rollout", "prompts", ["x"], 1, timeout=0.3, cancel=threading.Event())
    wait_for(lambda: server._parked == [])  # the server replies to an expired request before it forgets it


_DOOMED_SERVER = textwrap.dedent(
    """
    import time
    import torch
    from tidal.flow.store import Store, StoreServer
    store = Store()
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["train"], capacity_rows=1)
    store.put("train", {"x": torch.zeros(1, 1)})
    server = StoreServer(store)
    print(server.address, flush=True)
    while not server._parked:
        time.sleep(0.005)
    print("parked", flush=True)
    time.sleep(600)  # killed while the request is parked
    """
)


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("get", lambda client: client.get("rollout", "prompts", ["x"], 1, cancel=threading.Event())),
        ("put", lambda client: client.put("train", {"x": torch.ones(1, 1)}, cancel=threading.Event())),
    ],
)
def test_a_cancellable_wait_without_a_timeout_notices_its_server_died(in_thread, monkeypatch, op, call):
    """Since a cancellable get/put is sent once, one with timeout=None waited for its cancel
    even after its server was killed (the 1 s re-sends it replaced had noticed)."""
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.2)
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_SERVER], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert proc.stdout is not None
        client = RemoteStore(proc.stdout.readline().strip(), rpc_timeout_s=1.0)
        thread, outcome = in_thread(lambda: call(client))
        assert proc.stdout.readline().strip() == "parked"
        proc.kill()
        proc.wait(timeout=10)
        begin = time.monotonic()
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - begin < 4  # a ping after 0.2 s of silence, unanswered for 1 s
        assert isinstance(outcome[0], StoreError)
        assert f"did not answer a ping within 1s while {op!r} waited; is it running?" in str(outcome[0])
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if client is not None:
            client.close()


def test_a_cancellable_wait_on_a_live_server_outlasts_the_rpc_timeout(in_thread, served, monkeypatch):
    monkeypatch.setattr(client_module, "CANCEL_CHECK_S", 0.05)  # pinged every 0.05 s
    store, server, _ = served
    store.create_partition("prompts", consumers=["rollout"])
    client = RemoteStore(server.address, rpc_timeout_s=0.3)
    try:
        thread, outcome = in_thread(lambda: client.get("rollout", "prompts", ["x"], 1, cancel=threading.Event()))
        time.sleep(1.0)  # the wait under test: three rpc timeouts without a reply to the get
        assert thread.is_alive()
        store.put("prompts", {"x": torch.ones(1, 1)})
        thread.join(5)
        assert outcome[0].indexes == [0]
    finally:
        client.close()
