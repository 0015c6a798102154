"""Senders stream a `WeightSource` bucket by bucket: about one bucket of its tensors alive at a time,
each checked against its spec, and a version whose tensors break their specs never goes live."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tidal.hal.cpu import CpuPlatform, fake_platform
from tidal.hal.transfer import LazyWeights, TensorSpec, TransferError, expected_specs, weight_source
from tidal.hal.transfer.collective import CollectiveReceiver, CollectiveSender
from tidal.hal.transfer.host import HostReceiver, HostSender
from tidal.hal.transfer.ipc import IpcReceiver, IpcSender

NUMEL = 20_000
"""80 KB per tensor: above pyzmq's copy threshold (64 KB), so the host transport sends them from their own memory."""
NUM_TENSORS = 24
PER_BUCKET = 4
BUCKET_BYTES = PER_BUCKET * NUMEL * 4


class CountingSource:
    """A `WeightSource` whose every pass makes fresh tensors and counts how many are alive (its
    memory is a numpy array per tensor, freed only when no tensor or view of it is left)."""

    def __init__(self, *, bad: int | None = None, num: int = NUM_TENSORS) -> None:
        self.num, self.bad = num, bad
        self.alive = self.most_alive = self.passes = self.closed_early = 0
        self._lock = threading.Lock()

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(f"layers.{i}.weight", "float32", (NUMEL,)) for i in range(self.num)]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        done = False
        try:
            for i in range(self.num):
                data = np.full(NUMEL - (i == self.bad), float(i), dtype=np.float32)  # tensor `bad` is one element short
                with self._lock:
                    self.alive += 1
                    self.most_alive = max(self.most_alive, self.alive)
                weakref.finalize(data, self._freed)
                yield f"layers.{i}.weight", torch.from_numpy(data)
                del data
            done = True
        finally:
            self.closed_early += not done

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors()

    def _freed(self) -> None:
        with self._lock:
            self.alive -= 1

    def expected(self) -> dict[str, torch.Tensor]:
        return {f"layers.{i}.weight": torch.full((NUMEL,), float(i)) for i in range(self.num)}


def _collective_pair() -> tuple[CollectiveSender, CollectiveReceiver]:
    """A gloo broadcast group of a sender and one receiver, joined."""
    sender = CollectiveSender(CpuPlatform(), num_receivers=1, bucket_bytes=BUCKET_BYTES, timeout_s=60)
    receiver = CollectiveReceiver(CpuPlatform(), rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=60)
    joined = threading.Thread(target=receiver.join, daemon=True)
    joined.start()
    sender.join()
    joined.join(60)
    return sender, receiver


def _assert_delivered(out: dict, version: int, want: dict[str, torch.Tensor]) -> None:
    assert "error" not in out, out.get("error")
    assert out["weights"].version == version and out["weights"].tensors.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(out["weights"].tensors[name], tensor), name


def test_the_listing_helper_holds_every_tensor_a_source_holds_one_bucket():
    """What the bound below measures: a plain iterable is listed (every tensor alive at once)."""
    listed = CountingSource()
    source = weight_source(iter(listed))
    assert listed.most_alive == NUM_TENSORS and source.specs() == listed.specs()
    assert [n for n, _ in source] == [n for n, _ in source] == [s.name for s in listed.specs()]  # passes repeat
    assert weight_source(listed) is listed


def test_host_sender_holds_about_one_bucket_and_sends_a_source_again(receive_in_thread):
    source = CountingSource()
    receiver = HostReceiver(CpuPlatform(), expected=expected_specs((s.name, torch.empty(s.shape)) for s in source.specs()))
    sender = HostSender(fake_platform("npu", 1), bucket_bytes=BUCKET_BYTES)
    sender.connect(receiver.address)
    try:
        for version in (1, 2):  # the second pass is what a republish after a restart makes
            t, out = receive_in_thread(receiver.receive, 60)
            manifest = sender.send(version, source)
            t.join(60)
            _assert_delivered(out, version, source.expected())
            assert len(manifest.buckets) == NUM_TENSORS // PER_BUCKET
    finally:
        sender.close()
        receiver.close()
    assert source.passes == 2 and source.closed_early == 0
    assert source.most_alive <= PER_BUCKET + 1, f"{source.most_alive} tensors alive at once, a bucket holds {PER_BUCKET}"


def test_collective_sender_holds_about_one_bucket(receive_in_thread):
    source = CountingSource()
    sender, receiver = _collective_pair()
    for version in (1, 2):
        t, out = receive_in_thread(receiver.receive)
        sender.send(version, source)
        t.join(60)
        _assert_delivered(out, version, source.expected())
    assert source.passes == 2
    assert source.most_alive <= PER_BUCKET + 1, f"{source.most_alive} tensors alive at once, a bucket holds {PER_BUCKET}"


def test_ipc_sender_holds_one_tensor_at_a_time(receive_in_thread):
    source = CountingSource()
    receiver = IpcReceiver(CpuPlatform())
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        t, out = receive_in_thread(receiver.receive, 60)
        sender.send(1, source)
        t.join(60)
        _assert_delivered(out, 1, source.expected())
    finally:
        sender.close()
        receiver.close()
    assert source.most_alive <= 2


@pytest.mark.parametrize(("bad", "num", "error"), [(9, NUM_TENSORS, r"tensor 9 is 'layers.9.weight' float32\[19999\] but the manifest says 'layers.9.weight' float32\[20000\]"), (None, 7, "the weights ended after 7 of 24 tensors, before 'layers.7.weight'")])
def test_host_version_that_breaks_its_specs_never_goes_live(bad, num, error, receive_in_thread):
    source = CountingSource(bad=bad)
    short = CountingSource(num=num)
    broken = LazyWeights(source.specs, source.tensors if bad is not None else short.tensors)
    receiver = HostReceiver(CpuPlatform(), expected=None)
    sender = HostSender(CpuPlatform(), bucket_bytes=BUCKET_BYTES)
    sender.connect(receiver.address)
    try:
        t, out = receive_in_thread(receiver.receive, 60)
        with pytest.raises(TransferError, match=error):
            sender.send(1, broken)
        t.join(60)
        assert isinstance(out["error"], TransferError) and "abandoned version 1" in str(out["error"]) and "nothing went live" in str(out["error"])
        assert receiver.num_failed == 1
        t, out = receive_in_thread(receiver.receive, 60)  # the next version goes through
        good = CountingSource()
        sender.send(2, good)
        t.join(60)
        _assert_delivered(out, 2, good.expected())
    finally:
        sender.close()
        receiver.close()
    if bad is not None:
        assert source.closed_early == 1  # the sender closed the pass it stopped


def test_collective_version_that_breaks_its_specs_never_goes_live_and_the_group_stays_in_step(receive_in_thread):
    source = CountingSource(bad=13)
    sender, receiver = _collective_pair()
    t, out = receive_in_thread(receiver.receive)
    with pytest.raises(TransferError, match=r"tensor 13 is 'layers.13.weight' float32\[19999\]"):
        sender.send(1, source)
    t.join(60)
    assert isinstance(out["error"], TransferError) and "abandoned version 1" in str(out["error"])
    assert source.closed_early == 1
    good = CountingSource()
    t, out = receive_in_thread(receiver.receive)
    sender.send(2, good)
    t.join(60)
    _assert_delivered(out, 2, good.expected())


def test_ipc_version_that_breaks_its_specs_is_never_announced(receive_in_thread):
    receiver = IpcReceiver(CpuPlatform())
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        t, out = receive_in_thread(receiver.receive, 60)
        with pytest.raises(TransferError, match=r"tensor 3 is 'layers.3.weight' float32\[19999\]"):
            sender.send(1, CountingSource(bad=3))
        good = CountingSource()
        sender.send(2, good)
        t.join(60)
        _assert_delivered(out, 2, good.expected())  # the first thing the receiver heard of
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    ("weights", "error"),
    [
        ({"embed.weight": torch.ones(2)}, r"weights are \(name, tensor\) pairs, got a dict: pass its \.items\(\)"),
        ({"ab": torch.ones(2)}, r"got a dict"),  # was "weight 'a' is a str": the name unpacked as a pair
        ([torch.ones(3)], r"weights are \(name, tensor\) pairs, got Tensor"),  # was "too many values to unpack"
        ([("w", torch.ones(2), 1)], r"weights are \(name, tensor\) pairs, got tuple \('w'"),
    ],
)
def test_weights_that_are_not_name_tensor_pairs_are_refused_saying_so(weights, error):
    with pytest.raises(TransferError, match=error):
        weight_source(weights)
