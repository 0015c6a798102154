"""A receiver's two waits: for the trainer to start the next version (long: a train step, an
evaluation, a checkpoint), and for a version that started to arrive (bounded by its size)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tidal.hal.cpu import CpuPlatform
from tidal.hal.transfer import TransferError, WaitsForVersions, plan_manifest
from tidal.hal.transfer.collective import CollectiveReceiver, CollectiveSender
from tidal.hal.transfer.host import HostReceiver
from tidal.hal.transfer.ipc import IpcReceiver, IpcSender

W = [("w", torch.arange(6.0).reshape(2, 3))]


def test_an_ipc_receiver_waits_for_an_announcement_apart_from_receiving_it():
    receiver = IpcReceiver(CpuPlatform())
    sender = IpcSender(CpuPlatform())
    try:
        assert isinstance(receiver, WaitsForVersions)
        assert receiver.wait(0.05) is False and receiver.wait(0.05) is False  # nothing consumed, nothing failed
        sender.connect(receiver.address)
        sender.post(1, W)
        assert receiver.wait(10) is True and receiver.wait(0) is True  # announced; still there until received
        got = receiver.receive(0)
        sender.collect()
        assert got.version == 1 and torch.equal(got.tensors["w"], W[0][1])
    finally:
        sender.close()
        receiver.close()


def test_a_host_receiver_waits_for_a_version_to_begin_apart_from_receiving_it():
    """It had one deadline for both waits (24 h under Ray, so a version that stopped half-way
    was reported only then); now `wait` has no bound of its own and `receive` the transfer's."""
    import zmq

    from tidal.hal.transfer import pack_header
    from tidal.hal.transfer.host import HostSender

    receiver = HostReceiver(CpuPlatform(), token="t")
    sender = HostSender(CpuPlatform(), token="t")
    stray = zmq.Context.instance().socket(zmq.PUSH)
    try:
        assert isinstance(receiver, WaitsForVersions)
        assert receiver.wait(0.05) is False
        stray.connect(receiver.address)
        stray.send_multipart([pack_header(kind="bucket", version=7, index=0, token="t"), b"x"])  # the tail of a version given up on
        stray.send_multipart([pack_header(kind="begin", version=8, token="other"), b"x"])  # not our trainer's
        assert receiver.wait(0.3) is False and receiver.num_failed == 0  # both dropped, as receive drops them
        sender.connect(receiver.address)
        sender.send(1, W)
        assert receiver.wait(10) is True and receiver.wait(0) is True  # begun; kept for receive
        got = receiver.receive(5)
        assert got.version == 1 and torch.equal(got.tensors["w"], W[0][1])
        stray.send_multipart([pack_header(kind="begin", version=2, token="t"), plan_manifest(2, _specs(), bucket_bytes=1 << 20).pack()])
        assert receiver.wait(10) is True  # a version begins and then stops: receive fails at its own timeout
        begin = time.monotonic()
        with pytest.raises(TransferError, match=r"version 2: 0 of 1 buckets arrived"):
            receiver.receive(0.5)
        assert time.monotonic() - begin < 5 and receiver.num_failed == 1
    finally:
        stray.close(linger=0)
        sender.close()
        receiver.close()


def test_a_collective_version_that_stops_after_it_started_fails_at_its_transfer_timeout(receive_in_thread):
    """The receiver waited the group's timeout (300 s in the Ray runtime) for each broadcast
    of a version that started; `transfer_s` bounds them (the wait for the start stays long)."""
    sender, receiver = _joined_pair(timeout_s=120)
    try:
        t, out = receive_in_thread(lambda: receiver.receive(60, transfer_s=0.5))
        time.sleep(1.0)  # a trainer slower than transfer_s to start: fine
        group = sender._group  # the trainer starts version 1 (its length and manifest), then stops
        header = torch.frombuffer(bytearray(plan_manifest(1, _specs(), bucket_bytes=1 << 20).pack()), dtype=torch.uint8)
        group.broadcast(torch.tensor([header.numel()], dtype=torch.int64))
        begin = time.monotonic()
        group.broadcast(header)
        t.join(60)
        assert isinstance(out.get("error"), TransferError) and "of version 1 failed" in str(out["error"]), out
        assert time.monotonic() - begin < 30  # at transfer_s, not at the group's 120 s
    finally:
        receiver.close()
        sender.close()


def _joined_pair(*, timeout_s: float) -> tuple[CollectiveSender, CollectiveReceiver]:
    """A collective sender and its one receiver, both joined (the receiver joins on a thread:
    each waits for the other)."""
    sender = CollectiveSender(CpuPlatform(), num_receivers=1, timeout_s=timeout_s)
    receiver = CollectiveReceiver(CpuPlatform(), rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=timeout_s)
    joined = threading.Thread(target=receiver.join, daemon=True)
    joined.start()
    sender.join()
    joined.join(60)
    return sender, receiver


def _specs():
    from tidal.hal.transfer import TensorSpec

    return [TensorSpec.of(name, tensor) for name, tensor in W]


@pytest.mark.parametrize("transfer_s", [None, 60.0])
def test_a_whole_collective_version_arrives_with_or_without_a_transfer_timeout(receive_in_thread, transfer_s):
    sender, receiver = _joined_pair(timeout_s=60)
    try:
        t, out = receive_in_thread(lambda: receiver.receive(60, transfer_s=transfer_s))
        sender.send(1, W)
        t.join(60)
        assert out["weights"].version == 1 and torch.equal(out["weights"].tensors["w"], W[0][1])
    finally:
        receiver.close()
        sender.close()
