"""Weight transports when something goes wrong: a stalled receiver, a slow trainer, a
source that breaks its own specs. A version either arrives whole and right, or not at all."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from tidal.hal.cpu import CpuPlatform
from tidal.hal.transfer import LazyWeights, TensorSpec, TransferError, expected_specs, plan_manifest
from tidal.hal.transfer.collective import CollectiveReceiver, CollectiveSender
from tidal.hal.transfer.host import HostReceiver, HostSender
from tidal.hal.transfer.ipc import IpcReceiver, IpcSender


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on a device, so the host sender stages it through its
    two pinned buffers as it does device memory (no accelerator here)."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")


def test_host_send_that_fails_leaves_no_complete_version_behind(tmp_path: Path, receive_in_thread):
    """A receiver stalls (its process stopped, its network gone quiet) and the sends time
    out. The first one's frames, `end` included, were still queued into the staging buffers
    when the second rewrote them: once the receiver woke up it returned version 1 holding
    version 2's values. Now `end` goes only after every bucket left, so neither goes live."""
    numel = 1 << 20  # 4 MiB a tensor: sent without a copy, from the staging buffer
    ctx = zmq.Context.instance()
    ctx.setsockopt(zmq.RCVHWM, 1)  # the receiver's I/O thread takes in one message, then stalls the sender
    try:
        receiver = HostReceiver(CpuPlatform(), bind=f"ipc://{tmp_path}/stalled", token="t")
    finally:
        ctx.setsockopt(zmq.RCVHWM, 1000)
    stalled = HostSender(CpuPlatform(), bucket_bytes=4 * numel * 4, send_timeout_s=1.0, token="t")  # two buckets, one per staging buffer
    later = HostSender(CpuPlatform(), token="t")
    try:
        stalled.connect(receiver.address)
        for version in (1, 2):
            weights = [(f"w{i}", torch.full((numel,), float(version)).as_subclass(OnDevice)) for i in range(8)]
            with pytest.raises(TransferError, match="did not take data within"):
                stalled.send(version, weights)
        with pytest.raises(TransferError, match=r"weights incomplete after 10s \(version 2: "):  # the stalled sender's frames, all queued: version 1 never ends
            receiver.receive(10)
        later.connect(receiver.address)
        t, out = receive_in_thread(receiver.receive, 60)
        later.send(3, [("w0", torch.full((4,), 3.0))])
        t.join(60)
        assert "error" not in out, out.get("error")
        got = out["weights"]
        assert got.version == 3 and list(got.tensors) == ["w0"] and got.tensors["w0"].tolist() == [3.0] * 4
        assert receiver.num_failed == 1  # version 1 began and never ended
    finally:
        stalled.close()
        later.close()
        receiver.close()


def test_collective_receiver_waits_for_a_slow_trainer_longer_than_the_group_timeout(receive_in_thread):
    """Between two versions the trainer trains (and checkpoints): a receiver waiting for the
    next one used the group's timeout (300 s in the Ray runtime), failed, and broke the group."""
    sender = CollectiveSender(CpuPlatform(), num_receivers=1, timeout_s=1.0)
    receiver = CollectiveReceiver(CpuPlatform(), rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=1.0)
    joined = threading.Thread(target=receiver.join, daemon=True)
    joined.start()
    sender.join()
    joined.join(60)
    t, out = receive_in_thread(receiver.receive, 60.0)
    time.sleep(2.5)  # a train step longer than the group's timeout
    sender.send(1, [("w", torch.arange(6.0).reshape(2, 3))])
    t.join(60)
    assert "error" not in out, out.get("error")
    assert out["weights"].version == 1 and torch.equal(out["weights"].tensors["w"], torch.arange(6.0).reshape(2, 3))
    t, out = receive_in_thread(receiver.receive)  # the default stays the group's timeout
    t.join(60)
    assert isinstance(out.get("error"), TransferError) and "waiting for the next version" in str(out["error"])


def test_ipc_place_waits_for_a_receiver_that_may_still_read_the_buffer(receive_in_thread):
    """`place` hands the trainer views into the shared buffer to move its weights into: under
    a receiver whose answer never came it went ahead, and that receiver, still at version 1's
    announcement, returned version 1 holding what the trainer moved in."""
    v1 = {"w": torch.full((1024,), 1.0)}
    receiver = IpcReceiver(CpuPlatform(), expected=expected_specs(v1.items()))
    sender = IpcSender(CpuPlatform(), reply_timeout_s=0.3)
    sender.connect(receiver.address)
    try:
        sender.post(1, v1.items())
        with pytest.raises(TransferError, match=r"did not answer within 0.3s \(version 1\)"):
            sender.collect()
        with pytest.raises(TransferError, match=f"{receiver.address} may still be reading version 1"):
            sender.place([TensorSpec.of("w", v1["w"])])
        got = receiver.receive(30)  # version 1's announcement, late
        assert got.version == 1 and got.tensors["w"].unique().tolist() == [1.0]
        t, out = receive_in_thread(receiver.receive, 30)
        sender.post_again()
        sender.collect()
        t.join(30)
        (view,) = sender.place([TensorSpec.of("w", v1["w"])])  # every receiver answered: now it may
        view.fill_(2.0)
        t, out = receive_in_thread(receiver.receive, 30)
        sender.send(2, [("w", view)])
        t.join(30)
        assert out["weights"].version == 2 and out["weights"].tensors["w"].unique().tolist() == [2.0]
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (TensorSpec("w", "torch.float32", (2,)), r"version 1: tensor 'w' has dtype 'torch.float32', which weight transports do not carry .*without the torch. prefix"),  # was KeyError: 'torch.float32'
        (TensorSpec("w", "complex64", (2,)), r"version 1: tensor 'w' has dtype 'complex64'"),
        (TensorSpec("w", "float32", (2, -1)), r"version 1: tensor 'w' has shape \(2, -1\)"),
    ],
)
def test_a_source_whose_specs_no_transport_can_carry_is_refused_naming_the_tensor(spec, error):
    sender = HostSender(CpuPlatform(), send_timeout_s=30)
    receiver = HostReceiver(CpuPlatform())
    sender.connect(receiver.address)
    try:
        with pytest.raises(TransferError, match=error):
            sender.send(1, LazyWeights(lambda: [spec], lambda: iter([("w", torch.ones(2))])))
    finally:
        sender.close()
        receiver.close()


def test_a_spec_whose_shape_is_a_list_is_sent_as_its_tensor(receive_in_thread):
    """A custom engine's `TensorSpec(name, dtype, list(shape))`: the sender refused its own
    tensor with "tensor 0 is 'w' float32[2, 3] but the manifest says 'w' float32[2, 3]"."""
    w = torch.arange(6.0).reshape(2, 3)
    assert plan_manifest(1, [TensorSpec("w", "float32", [2, 3])]).specs == (TensorSpec("w", "float32", (2, 3)),)
    sender = HostSender(CpuPlatform(), send_timeout_s=30)
    receiver = HostReceiver(CpuPlatform(), expected=expected_specs([("w", w)]))
    sender.connect(receiver.address)
    try:
        t, out = receive_in_thread(receiver.receive, 30)
        sender.send(1, LazyWeights(lambda: [TensorSpec("w", "float32", list(w.shape))], lambda: iter([("w", w)])))
        t.join(30)
        assert "error" not in out, out.get("error")
        assert out["weights"].version == 1 and torch.equal(out["weights"].tensors["w"], w)
    finally:
        sender.close()
        receiver.close()


def test_ipc_receiver_whose_sender_closed_before_it_read_names_the_version():
    """Was "[Errno 2] No such file or directory: '/dev/shm/tidal-weights-...'; nothing went live"."""
    receiver = IpcReceiver(CpuPlatform())
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        sender.post(7, [("w", torch.ones(3))])
        sender.close()  # the trainer ended (or its buffer was deleted) before this receiver read the version
        with pytest.raises(TransferError, match=r"version 7: cannot map the shared weight buffer .*tidal-weights-.* \(No such file or directory\): its sender closed or died"):
            receiver.receive(30)
    finally:
        sender.close()
        receiver.close()
