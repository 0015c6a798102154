"""Large buffers through shared memory between a store server and clients on one host,
and pipelined puts (`submit_put`)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import msgpack
import numpy as np
import pytest
import torch
import zmq

from tidal.flow.store import RemoteStore, Store, StoreError, StoreServer, StoreTimeout, shm
from tidal.flow.store.codec import CodecError
from tidal.flow.store.wire import pack
from tidal.hal import owner

pytestmark = pytest.mark.skipif(shm.host_id() is None or not shm.has_room(64 << 20), reason="needs a writable /dev/shm with room beyond the store's reserve")

BIG = shm.MIN_BYTES // 4  # float32 elements: one row of this many is exactly MIN_BYTES


def _ours(client: RemoteStore) -> list[str]:
    """The segment files this client wrote that still exist."""
    prefix = client._writer._prefix
    return [name for name in shm.leftovers() if name.startswith(prefix)]


def _held(client: RemoteStore) -> list[str]:
    """Those of `_ours` that the client or a store holds (not the ones handed back to it)."""
    return [name for name in _ours(client) if shm.FREE not in name]


@pytest.fixture
def served():
    store = Store()
    store.create_partition("train", consumers=["a", "b"])
    with StoreServer(store) as server:
        clients = [RemoteStore(server.address, rpc_timeout_s=10) for _ in range(3)]
        yield store, server, clients
        for client in clients:
            client.close()


def test_large_rows_go_through_one_segment_and_it_goes_when_every_consumer_acked(served):
    store, server, (producer, a, b) = served
    x, small = torch.randn(4, BIG), torch.arange(4)
    producer.put("train", {"x": x, "small": small})
    assert producer.shares_host() and len(_ours(producer)) == 1  # x went by shared memory, small by the socket
    assert len(server.segments) == 1
    got_a = a.get("a", "train", ["x", "small"], 4, timeout=5)
    assert torch.equal(got_a.stack("x"), x) and torch.equal(got_a.stack("small"), small)
    assert server.segments.num_referred == 1  # the reply named the segment, it did not resend the rows
    got_a.stack("x")[0, 0] = 1234.0  # a consumer writing into its rows changes only its own pages
    got_b = b.get("b", "train", ["x"], 4, timeout=5)
    assert torch.equal(got_b.stack("x"), x)  # b mapped the same segment and sees the rows as put
    a.ack("a", "train", got_a.indexes)
    assert len(_held(producer)) == 1  # b has not acked: the segment stays
    b.ack("b", "train", got_b.indexes)
    gc.collect()
    assert _held(producer) == [] and len(server.segments) == 0
    (back,) = _ours(producer)  # handed back to its sender, for its next put
    assert back.endswith(f"{shm.FREE}@{owner.tag()}") and server.segments.num_returned == 1
    y = torch.randn(4, BIG)
    producer.put("train", {"x": y})
    assert producer._writer.num_reused == 1 and _ours(producer) == [back.replace(shm.FREE, "")]
    assert torch.equal(got_b.stack("x"), x)  # consumers read their rows out: the next put's bytes do not reach them
    assert torch.equal(a.get("a", "train", ["x"], 4, timeout=5).stack("x"), y)


def test_a_segment_handed_back_goes_when_its_client_closes_or_fits_no_more(served):
    store, server, (producer, a, b) = served
    producer.put("train", {"x": torch.randn(2, BIG)})
    for consumer, name in ((a, "a"), (b, "b")):
        consumer.ack(name, "train", consumer.get(name, "train", ["x"], 2, timeout=5).indexes)
    gc.collect()
    (back,) = _ours(producer)
    producer.put("train", {"x": torch.randn(8, BIG)})  # four times the size: not reused, unlinked, a new one made
    assert producer._writer.num_reused == 0 and back not in _ours(producer) and len(_held(producer)) == 1
    for consumer, name in ((a, "a"), (b, "b")):
        consumer.ack(name, "train", consumer.get(name, "train", ["x"], 8, timeout=5).indexes)
    gc.collect()
    assert len(_ours(producer)) == 1 and _held(producer) == []
    producer.close()
    assert _ours(producer) == []  # what came back and was not used again goes with the client


def test_a_writer_forgets_its_oldest_segments_beyond_its_pool(served, wait_for, monkeypatch):
    store, server, (producer, a, b) = served
    monkeypatch.setattr(shm, "POOL_SEGMENTS", 1)
    monkeypatch.setattr(shm, "RECLAIM_TRIES", 0)  # every put makes a new segment

    def drain(n):
        for consumer, name in ((a, "a"), (b, "b")):
            consumer.ack(name, "train", consumer.get(name, "train", ["x"], n, timeout=5).indexes)
        gc.collect()

    producer.put("train", {"x": torch.randn(1, BIG)})
    drain(1)
    (first,) = _ours(producer)  # back
    producer.put("train", {"x": torch.randn(1, BIG)})
    assert first not in _ours(producer) and len(_held(producer)) == 1  # forgotten while back: the writer unlinked it
    producer.put("train", {"x": torch.randn(1, BIG)})  # forgets the second while the store holds it
    drain(2)
    assert len(_ours(producer)) == 2 and _held(producer) == []  # both back, one of them forgotten by the writer
    producer.close()
    wait_for(lambda: _ours(producer) == [], timeout=10)  # the writer unlinks the one it knows, the server the other once the client's connections close


def test_a_segment_handed_back_to_a_connection_that_closes_is_unlinked(served, wait_for):
    store, server, (producer, a, b) = served
    writer = shm.Writer()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.address)
    try:
        message = {"op": "put", "id": 1, "token": None, "host": shm.host_id(), "args": {"partition": "nope", "columns": {"x": torch.randn(1, BIG)}}}
        sock.send_multipart(pack(message, writer=writer))
        assert sock.poll(5000)
        assert not msgpack.unpackb(sock.recv_multipart()[0], raw=False)["ok"]  # mapped, then refused: no such partition
        gc.collect()
        # handed back to that connection once the server lets go of its mapping, which may come
        # just after the reply (CI saw it not there yet, on a loaded machine)
        wait_for(lambda: any(shm.FREE in n for n in shm.leftovers() if n.startswith(writer._prefix)), timeout=10)
        (back,) = [n for n in shm.leftovers() if n.startswith(writer._prefix)]
        assert shm.FREE in back
    finally:
        sock.close(linger=0)
    wait_for(lambda: not [n for n in shm.leftovers() if n.startswith(writer._prefix)], timeout=10)  # a sender gone without closing its writer


def test_a_consumer_in_another_process_reads_the_rows_from_the_segment():
    store = Store()
    store.create_partition("train", consumers=["c"])
    script = textwrap.dedent("""
        import sys
        from tidal.flow.store import RemoteStore
        client = RemoteStore(sys.argv[1])
        batch = client.get("c", "train", ["x"], 3, timeout=30)
        print(client.shares_host(), float(batch.stack("x").sum()), client._segments.num_read)
        client.ack("c", "train", batch.indexes)
        client.close()
    """)
    with StoreServer(store) as server:
        producer = RemoteStore(server.address)
        x = torch.randn(3, BIG, dtype=torch.float64)
        producer.put("train", {"x": x})
        out = subprocess.run([sys.executable, "-c", script, server.address], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        shared, total, read = out.stdout.split()
        assert shared == "True" and float(total) == pytest.approx(float(x.sum())) and int(read) == 1
        assert server.segments.num_referred == 1
        gc.collect()
        assert _held(producer) == []
        producer.close()


def test_shm_off_or_another_host_keeps_every_byte_on_the_socket(served, monkeypatch):
    store, server, (producer, a, b) = served
    off = RemoteStore(server.address, shm=False)
    elsewhere = RemoteStore(server.address)
    elsewhere._host = "another-boot:1:2"  # a client whose /dev/shm is not the server's
    try:
        x = torch.randn(2, BIG)
        for client in (off, elsewhere):
            client.put("train", {"x": x})
            assert not client.shares_host() and _ours(client) == []
        assert server.segments.num_mapped == 0
        batch = elsewhere.get("a", "train", ["x"], 4, timeout=5)  # rows that came by socket go back by socket
        assert torch.equal(batch.stack("x"), torch.cat([x, x])) and elsewhere._segments.num_read == 0
    finally:
        off.close()
        elsewhere.close()


def test_the_environment_variable_turns_shared_memory_off(served, monkeypatch):
    store, server, _ = served
    monkeypatch.setattr(shm, "_host_id", [])
    monkeypatch.setenv(shm.ENV_VAR, "0")
    client = RemoteStore(server.address)
    try:
        client.put("train", {"x": torch.randn(1, BIG)})
        assert not client.shares_host() and _ours(client) == [] and server.segments.num_mapped == 0
    finally:
        client.close()
    monkeypatch.setattr(shm, "_host_id", [])  # a server started with it set takes no segments either
    with StoreServer(Store()) as off:
        assert off.host is None and off.segments is None


def test_rows_in_a_segment_go_by_socket_to_a_consumer_on_another_host(served):
    store, server, (producer, a, b) = served
    x = torch.randn(2, BIG)
    producer.put("train", {"x": x})
    a._shared[server.address] = False  # as if its ping had found another /dev/shm
    got = a.get("a", "train", ["x"], 2, timeout=5)
    assert torch.equal(got.stack("x"), x) and a._segments.num_read == 0 and server.segments.num_referred == 0


def test_a_full_dev_shm_falls_back_to_the_socket_and_leaves_nothing(served, monkeypatch):
    store, server, (producer, a, b) = served

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "pwrite", full)
    x = torch.randn(2, BIG)
    producer.put("train", {"x": x})
    assert _ours(producer) == [] and server.segments.num_mapped == 0
    assert torch.equal(a.get("a", "train", ["x"], 2, timeout=5).stack("x"), x)


def test_a_small_or_nearly_full_dev_shm_is_left_alone(served, monkeypatch):
    """The reserve: a 64 MB /dev/shm (Docker's default) is never used; a large one is used
    until a segment would leave less than a quarter of it free, and again once there is room."""
    store, server, (producer, a, b) = served
    real = os.statvfs(shm.DIR)
    sizes = {"total": 64 << 20, "free": 64 << 20}
    fake = lambda path: os.statvfs_result((4096, 4096, sizes["total"] // 4096, sizes["free"] // 4096, sizes["free"] // 4096, *real[5:]))
    monkeypatch.setattr(shm.os, "statvfs", fake)
    x = torch.randn(2, BIG)
    producer.put("train", {"x": x})
    assert _ours(producer) == [] and producer._writer.num_by_socket == 1
    sizes.update(total=8 << 30, free=(2 << 30) + 100)  # 8 GB with just over a quarter free: this put would cross it
    producer.put("train", {"x": x})
    assert _ours(producer) == [] and producer._writer.num_by_socket == 2
    sizes["free"] = 4 << 30
    producer.put("train", {"x": x})
    assert len(_ours(producer)) == 1 and producer._writer.num_by_socket == 2
    assert torch.equal(a.get("a", "train", ["x"], 6, timeout=5).stack("x"), torch.cat([x, x, x]))


def test_failed_and_timed_out_puts_leave_no_segment():
    store = Store()
    store.create_partition("train", consumers=["c"], capacity_rows=1)
    with StoreServer(store) as server:
        producer = RemoteStore(server.address, rpc_timeout_s=10)
        try:
            with pytest.raises(ValueError, match="no partition 'val'"):
                producer.put("val", {"x": torch.randn(1, BIG)})
            producer.put("train", {"x": torch.randn(1, BIG)})
            with pytest.raises(StoreTimeout):  # full: parked, then given up
                producer.put("train", {"x": torch.randn(1, BIG)}, timeout=0.2)
            with pytest.raises(CodecError, match="groups row 0"):  # its header cannot be packed, after its rows were written
                producer.put("train", {"x": torch.randn(1, BIG)}, groups=[2**64])
            gc.collect()
            assert len(_held(producer)) == 1 and len(server.segments) == 1  # only the row the store holds; others were handed back or unlinked
        finally:
            producer.close()
    gc.collect()
    assert _ours(producer) == []  # closing the server unlinks what it still held


def test_leftovers_skip_a_file_deleted_while_they_list(monkeypatch):
    class Entry:
        def __init__(self, name, size):
            self.name, self._size = name, size

        def is_file(self, follow_symlinks=True):
            return True

        def stat(self, follow_symlinks=True):
            if self._size is None:
                raise FileNotFoundError(self.name)  # its holder unlinked it after the listing
            return os.stat_result((0o600, 0, 0, 1, 0, 0, self._size, 0, 0, 0))

    entries = [Entry("tidal-a-0", 10), Entry("tidal-b-0", None), Entry("other", 1), Entry("tidal-c-0", 30)]
    monkeypatch.setattr(shm.os, "scandir", lambda directory: contextlib.nullcontext(iter(entries)))
    assert shm.leftovers() == {"tidal-a-0": 10, "tidal-c-0": 30}  # before: {"tidal-a-0": 10}, the rest lost


def test_segments_need_the_token_and_a_tidal_name():
    with StoreServer(Store(), address="tcp://0.0.0.0:0", token="s3cret") as server:
        address = server.address.replace("0.0.0.0", "127.0.0.1")
        writer = shm.Writer()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.plain_username, sock.plain_password = b"tidal", b"s3cret"  # past the handshake: the header's token is checked too
        sock.connect(address)
        try:
            x = torch.randn(1, BIG)
            for token in ("nope", "s3cret"):
                message = {"op": "put", "id": 1, "token": token, "host": shm.host_id(), "args": {"partition": "nope", "columns": {"x": x}}}
                sock.send_multipart(pack(message, writer=writer))
                assert sock.poll(5000)
                answer = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
                if token == "nope":
                    assert not answer["ok"] and "token" in answer["message"]
                    assert len([n for n in shm.leftovers() if n.startswith(writer._prefix)]) == 1  # never mapped, never unlinked
                else:
                    assert not answer["ok"] and "no partition 'nope'" in answer["message"]
            gc.collect()
            refused, handed_back = sorted(n for n in shm.leftovers() if n.startswith(writer._prefix))
            assert shm.SENT in refused and shm.FREE in handed_back  # the refused one is still the sender's; the one mapped went back to it
        finally:
            for name in shm.leftovers():
                if name.startswith(writer._prefix):
                    os.unlink(os.path.join(shm.DIR, name))
            sock.close(linger=0)
    segments = shm.Segments(own=True)
    for name in ("../etc/passwd", "tidal-weights-1-0", "tidal-xyz-0", ""):
        with pytest.raises(shm.ShmError, match="not a tidal shared-memory segment name"):
            segments.map(name, 0, 1, {})


def test_submitted_puts_are_pipelined_and_each_reads_its_own_outcome(served):
    store, server, (producer, a, b) = served
    pending = [producer.submit_put("train", {"x": torch.full((2, BIG), float(k))}) for k in range(4)]
    bad = producer.submit_put("val", {"x": torch.zeros(1, 1)})
    late = producer.submit_put("train", {"x": torch.full((1, 1), 9.0)})
    assert late.result() == [8]  # read out of order: the others' replies are kept for them
    with pytest.raises(ValueError, match="no partition 'val'"):
        bad.result()
    assert [p.result() for p in pending] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="no partition 'val'"):
        bad.result()  # the outcome is kept
    got = a.get("a", "train", ["x"], 8, timeout=5)
    assert [float(row[0]) for row in got.columns["x"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    other = producer.submit_put("train", {"x": torch.zeros(1, 1)})
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, other.result).value))
    thread.start()
    thread.join()
    assert "thread that submitted it" in str(errors[0])
    assert other.result() == [9]
    assert Store.submit_put(store, "train", {"x": torch.zeros(1, 1)}).result() == [10]  # in process: done already
    assert not producer._tls.submitted and not producer._tls.stash


def test_an_unread_submitted_put_leaves_nothing_behind(served):
    store, server, (producer, a, b) = served
    producer.submit_put("train", {"x": torch.zeros(1, 1)})  # dropped unread
    gc.collect()
    assert producer.put("train", {"x": torch.zeros(1, 1)}) == [1]
    assert not producer._tls.submitted and not producer._tls.stash
    with pytest.raises(StoreError, match="closed"):
        closed = RemoteStore(server.address)
        closed.close()
        closed.submit_put("train", {"x": torch.zeros(1, 1)})


def test_a_client_closed_before_the_server_read_its_submitted_put_leaves_no_segment(served, wait_for):
    store, server, (producer, a, b) = served
    assert producer.shares_host()  # asked before the server is held up: the answer needs the server
    with server._lock:  # the server thread waits here before it reads the next request
        producer.submit_put("train", {"x": torch.randn(1, BIG)})
        assert len(_ours(producer)) == 1
        producer.close()
        assert _ours(producer) == []  # not the server's yet: the client that wrote it unlinks it
    assert a.ping()["store"] and store.metrics()["partitions"]["train"]["rows"] == 0  # the server serves on; nothing went in
    producer.close()  # closing twice is harmless


def test_a_segment_is_the_senders_until_the_server_takes_it_under_another_name(served):
    store, server, (producer, a, b) = served
    assert producer.shares_host()
    with server._lock:
        pending = producer.submit_put("train", {"x": torch.randn(1, BIG)})
        (sent,) = _ours(producer)
    assert pending.result() == [0]
    (held,) = _ours(producer)
    assert held != sent and sent.endswith(f".sent@{owner.tag()}") and held.endswith("@" + owner.tag())  # taken by a rename even within one process
    producer._writer.unlink([sent, held])  # a sender unlinks only what it still holds
    assert _ours(producer) == [held]


def test_a_real_segment_named_with_a_bad_range_gets_an_error_reply(served):
    store, server, (producer, a, b) = served
    writer = shm.Writer()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.address)
    try:
        frames = pack({"op": "put", "id": 3, "token": None, "host": shm.host_id(), "args": {"partition": "train", "columns": {"x": torch.randn(2, BIG)}}}, writer=writer)
        header = msgpack.unpackb(frames[0], raw=False)
        header["shm"][0][3] *= 4  # more bytes than the segment holds
        sock.send_multipart([msgpack.packb(header), *frames[1:]])
        assert sock.poll(5000)
        answer = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        assert not answer["ok"] and answer["error"] == "WireError" and "holds" in answer["message"]
        gc.collect()
        assert [shm.FREE in n for n in shm.leftovers() if n.startswith(writer._prefix)] == [True]  # mapped, refused, handed back
        assert producer.ping()["store"] is True and store.metrics()["partitions"]["train"]["rows"] == 0
    finally:
        sock.close(linger=0)


def test_a_client_reads_a_messages_buffers_through_one_descriptor_per_segment_and_closes_it(monkeypatch):
    writer, segments = shm.Writer(), shm.Segments(own=False)
    buffers = [np.full(shm.MIN_BYTES, k, np.uint8) for k in (1, 2, 3)]
    name, offsets = writer.write(buffers)
    opened, real_open = [], os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1])
    try:
        cache: dict = {}
        got = [np.frombuffer(segments.map(name, offset, b.nbytes, cache), np.uint8) for b, offset in zip(buffers, offsets)]
        assert [int(g[0]) for g in got] == [1, 2, 3] and len(opened) == 1
        segments.done(cache)
        with pytest.raises(OSError):
            os.fstat(opened[0])  # closed
        with pytest.raises(shm.ShmError, match="holds"):
            segments.map(name, offsets[-1], 4 * shm.MIN_BYTES, cache)
        segments.done(cache)
        with pytest.raises(OSError):
            os.fstat(opened[1])  # closed after a failed read too
    finally:
        writer.close()


def test_a_segment_the_server_cannot_map_fails_that_put_with_an_error_reply(served, monkeypatch):
    store, server, (producer, a, b) = served

    def no_more_mappings(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(shm.mmap, "mmap", no_more_mappings)  # as when vm.max_map_count is reached
    with pytest.raises(StoreError, match="cannot map segment"):
        producer.put("train", {"x": torch.randn(1, BIG)})
    monkeypatch.undo()
    assert _ours(producer) == []  # the server unlinked the segment it could not take
    assert producer.put("train", {"x": torch.ones(1, BIG)}) == [0]  # and kept serving
    assert torch.equal(a.get("a", "train", ["x"], 1, timeout=5).stack("x"), torch.ones(1, BIG))


def test_a_late_finalizer_leaves_a_new_mapping_at_the_same_address_alone():
    """CPython unmaps a dying mmap (GIL released) before its finalizer runs, so a new
    segment can be mapped at that address first: the old finalizer must not drop the new
    entry, and a dying mapping must never be named in a reply."""
    segments, writer = shm.Segments(own=True), shm.Writer()
    name, _ = writer.write([np.ones(shm.MIN_BYTES, np.uint8)])
    arr = np.frombuffer(segments.map(name, 0, shm.MIN_BYTES, {}), np.uint8)
    base = arr.__array_interface__["data"][0]
    name = name.replace(shm.SENT, "")  # taken: renamed
    assert segments.find(arr) == (name, 0)

    class Gone:
        pass

    gone = Gone()
    dead = weakref.ref(gone)
    del gone
    segments._unmapped(base, os.path.join(shm.DIR, "tidal-000000000000-999999"), dead, None, None)  # the previous mapping's finalizer, late
    assert segments.find(arr) == (name, 0) and len(segments) == 1
    size, _, alive = segments._spans[base]
    segments._spans[base] = (size, name, dead)  # as while this mapping is being unmapped
    assert segments.find(arr) is None
    segments._spans[base] = (size, name, alive)
    del arr
    gc.collect()
    assert len(segments) == 0 and name not in shm.leftovers()


def test_a_server_that_is_not_there_is_named_with_the_call_that_found_out():
    with StoreServer(Store()) as server:
        address = server.address
    client = RemoteStore(address, rpc_timeout_s=0.3)  # its first request asks whether the server shares /dev/shm
    try:
        with pytest.raises(StoreError, match=r"did not answer 'ping \(before put\)' within 0.3s; is it running"):
            client.put("train", {"x": torch.zeros(1, 1)})
    finally:
        client.close()


def test_the_server_holds_a_segment_under_its_own_name_and_a_killed_servers_are_deleted_by_the_next(served):
    store, server, (producer, a, b) = served
    producer.put("train", {"x": torch.randn(2, BIG)})
    (held,) = _ours(producer)
    assert held.endswith("@" + owner.tag())  # renamed to the server's tag (here, this process)
    script = textwrap.dedent("""
        import os, signal, sys, torch
        from tidal.flow.store import RemoteStore, Store, StoreServer
        store = Store()
        store.create_partition("train", consumers=["c"])
        server = StoreServer(store)
        client = RemoteStore(server.address)
        client.put("train", {"x": torch.randn(2, int(sys.argv[1]))})
        print(client._writer._prefix, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # as Ray stops an actor: no exit handler runs
    """)
    out = subprocess.run([sys.executable, "-c", script, str(BIG)], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    prefix = out.stdout.strip()
    (left,) = [name for name in shm.leftovers() if name.startswith(prefix)]
    assert owner.is_orphan(left)
    with StoreServer(Store()):
        assert not [name for name in shm.leftovers() if name.startswith(prefix)]
    assert held in shm.leftovers()  # a live server's segment is never swept


def test_a_sender_killed_before_the_server_mapped_its_segment_leaves_a_file_the_next_server_deletes():
    """The sender writes a segment and is killed (SIGKILL: no cleanup runs) before any server
    mapped it. While it lives its file is kept; once it is dead the next server to start deletes
    it. (Under `pytest -n` another worker's server may start first and delete it: the same.)"""
    script = textwrap.dedent("""
        import sys, numpy as np
        from tidal.flow.store import shm
        name, _ = shm.Writer().write([np.ones(shm.MIN_BYTES, dtype=np.uint8)])
        print(name, flush=True)
        sys.stdin.read()  # until killed
    """)
    sender = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None
        left = sender.stdout.readline().strip()
        assert left.startswith("tidal-") and left in shm.leftovers()  # a live sender's segment is never swept
    finally:
        sender.kill()  # only the process this test started
        sender.wait(timeout=60)
    assert sender.returncode == -9
    with StoreServer(Store()):
        assert left not in shm.leftovers()


def test_rows_replaced_while_their_reply_is_on_its_way_stay_mappable(served, monkeypatch):
    """A put that replaces a column of leased rows lets go of the old chunk; the reply that
    named its segment must still map on the consumer's side, however late it reads it.
    The consumer here reads its reply only after the replacing put (and a collection)."""
    import tidal.flow.store.client as client_module

    store, server, (producer, a, _) = served
    old, new = torch.randn(2, BIG), torch.randn(2, BIG)
    producer.put("train", {"x": old})
    real_unpack, late, armed = client_module.unpack, [], threading.Event()

    def unpack(frames, **kwargs):
        if armed.is_set() and threading.current_thread().name == "late-reader":
            armed.clear()
            late.append(producer.put("train", {"x": new}, indexes=[0, 1]))  # the old chunk's last reference goes
            gc.collect()
        return real_unpack(frames, **kwargs)

    def read() -> None:
        a.ping()  # this thread's connection and its host handshake, before the get
        armed.set()
        got.append(a.get("a", "train", ["x"], 2, timeout=5))

    monkeypatch.setattr(client_module, "unpack", unpack)
    got: list = []
    reader = threading.Thread(target=read, name="late-reader")
    reader.start()
    reader.join(10)
    assert late == [[0, 1]] and len(got) == 1, got  # the get mapped its segment (it raised WireError when unlinked)
    assert torch.equal(got[0].stack("x"), old)  # what was leased, as it was
    assert torch.equal(a.get("b", "train", ["x"], 2, timeout=5).stack("x"), new)  # others read the new cells


def test_a_segment_whose_buffer_fails_to_write_is_not_left_behind():
    """Only an OSError closed and unlinked the new segment: any other error writing a
    buffer into it (one without the buffer protocol) left the file in `/dev/shm`."""

    class NoBuffer:
        nbytes = shm.MIN_BYTES

    writer = shm.Writer()
    with pytest.raises(TypeError):
        writer.write([np.zeros(shm.MIN_BYTES, dtype=np.uint8), NoBuffer()])
    assert [name for name in shm.leftovers() if name.startswith(writer._prefix)] == []


def test_rows_stay_intact_while_threads_of_one_client_reuse_its_segments(served):
    """Four threads of one producer put while two consumers read and ack: the segments the
    server hands back are written again by whichever thread takes them, and every row a
    consumer got holds what was put, whatever came into its segment later."""
    store, server, (producer, a, b) = served
    num_threads, per_thread = 4, 12
    errors: list[BaseException] = []

    def produce(t: int) -> None:
        try:
            for k in range(per_thread):
                producer.put("train", {"x": torch.full((1, BIG), float(t * 100 + k))}, timeout=30)
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    kept: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    while any(sum(len(x) for x in rows) < num_threads * per_thread for rows in kept.values()):
        for name, consumer in (("a", a), ("b", b)):
            if sum(len(x) for x in kept[name]) < num_threads * per_thread:
                batch = consumer.get(name, "train", ["x"], 4, timeout=30, partial=True)
                kept[name].append(batch.stack("x"))
                consumer.ack(name, "train", batch.indexes)
        gc.collect()  # the server lets go of rows both acked: their segments go back and are reused
    for thread in threads:
        thread.join()
    assert not errors
    for name in kept:
        rows = torch.cat(kept[name])
        assert bool((rows == rows[:, :1]).all())  # no row took another's bytes
        assert sorted(rows[:, 0].tolist()) == sorted(float(t * 100 + k) for t in range(num_threads) for k in range(per_thread))
    assert producer._writer.num_reused > 0
