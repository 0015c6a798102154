"""Weight transports when something goes wrong: a stalled receiver, a slow trainer, a
source that breaks its own specs. A version either arrives whole and right, or not at all."""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import zmq

from tidal.hal.cpu import CpuPlatform
from tidal.hal.transfer import LazyWeights, TensorSpec, TransferError, expected_specs, pack_header, plan_manifest
from tidal.hal.transfer.collective import CollectiveReceiver, CollectiveSender
from tidal.hal.transfer.host import HostReceiver, HostSender
from tidal.hal.transfer.ipc import IpcReceiver, IpcSender


def _joined_collective_pair(timeout_s: float) -> tuple[CollectiveSender, CollectiveReceiver]:
    """A trainer and one receiver on CPU (gloo) whose group is built, with `timeout_s` as its timeout."""
    sender = CollectiveSender(CpuPlatform(), num_receivers=1, timeout_s=timeout_s)
    receiver = CollectiveReceiver(CpuPlatform(), rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=timeout_s)
    joined = threading.Thread(target=receiver.join, daemon=True)
    joined.start()
    sender.join()
    joined.join(60)
    return sender, receiver


class OnDevice(torch.Tensor):
    """A CPU tensor that says it is on a device, so the host sender stages it through its
    two pinned buffers as it does device memory (no accelerator here)."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")


def _stalled_receiver(tmp_path: Path) -> HostReceiver:
    """A host receiver whose I/O thread takes in one message, then stalls the sender."""
    ctx = zmq.Context.instance()
    ctx.setsockopt(zmq.RCVHWM, 1)
    try:
        return HostReceiver(CpuPlatform(), bind=f"ipc://{tmp_path}/stalled", token="t")
    finally:
        ctx.setsockopt(zmq.RCVHWM, 1000)


def test_host_send_that_fails_leaves_no_complete_version_behind(tmp_path: Path, receive_in_thread):
    """A receiver stalls (its process stopped, its network gone quiet) and the sends time
    out. The first one's frames, `end` included, were still queued into the staging buffers
    when the second rewrote them: once the receiver woke up it returned version 1 holding
    version 2's values. Now `end` goes only after every bucket left, so neither goes live."""
    numel = 1 << 20  # 4 MiB a tensor: sent without a copy, from the staging buffer
    receiver = _stalled_receiver(tmp_path)
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
        assert receiver.num_failed == 2  # version 1 began and never ended; version 2 was given up on (the timeout)
    finally:
        stalled.close()
        later.close()
        receiver.close()


def test_collective_receiver_waits_for_a_slow_trainer_longer_than_the_group_timeout(receive_in_thread):
    """Between two versions the trainer trains (and checkpoints): a receiver waiting for the
    next one used the group's timeout (300 s in the Ray runtime), failed, and broke the group."""
    sender, receiver = _joined_collective_pair(timeout_s=1.0)
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
        assert receiver._sock.poll(30_000)  # the announcement arrived: a close with linger 0 drops one still queued
        sender.close()  # the trainer ended (or its buffer was deleted) before this receiver read the version
        with pytest.raises(TransferError, match=r"version 7: cannot map the shared weight buffer .*tidal-weights-.* \(No such file or directory\): its holder closed it or died"):
            receiver.receive(30)
    finally:
        sender.close()
        receiver.close()


def test_host_send_waits_for_every_frame_of_a_bucket_not_only_its_last(tmp_path: Path):
    """`send_multipart` returns the tracker of a message's last frame only, and a small frame
    is copied (its tracker done at once): a bucket ending in a small tensor counted as sent
    while its large one still sat in the queue, pointing into a staging buffer. Against a
    stalled receiver the send returned without error, having restaged bucket 2 over bucket 0,
    and the receiver later took version 1 with w0 holding w2's values."""
    numel = 1 << 20
    receiver = _stalled_receiver(tmp_path)
    sender = HostSender(CpuPlatform(), bucket_bytes=numel * 4 + 16, send_timeout_s=1.0, token="t")  # buckets [w_i, s_i]
    weights = [(f"{kind}{i}", torch.full((n,), float(i)).as_subclass(OnDevice)) for i in range(3) for kind, n in (("w", numel), ("s", 4))]
    try:
        sender.connect(receiver.address)
        with pytest.raises(TransferError, match=r"did not take data within 1s \(version 1\)"):  # bucket 2 waits for bucket 0's w0 to leave slot 0
            sender.send(1, weights)
        with pytest.raises(TransferError, match=r"weights incomplete after 3s \(version 1: 2 of 3 buckets arrived\)"):  # no end: nothing goes live
            receiver.receive(3)
    finally:
        sender.close()
        receiver.close()


def _num_fds(at_most: int, timeout_s: float = 10.0) -> int:
    """This process's open file descriptors, once there are `at_most` or `timeout_s` passed
    (ZeroMQ's reaper thread frees a closed socket's descriptor a moment after `close`)."""
    deadline = time.monotonic() + timeout_s
    while len(os.listdir("/proc/self/fd")) > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "open_half",
    [
        lambda taken: HostReceiver(CpuPlatform(), bind=taken),
        lambda taken: IpcReceiver(CpuPlatform(), bind=taken),
        lambda taken: HostSender(CpuPlatform()).connect("tcp://127.0.0.1:no-port"),
        lambda taken: IpcSender(CpuPlatform()).connect("tcp://127.0.0.1:no-port"),
    ],
    ids=["host-receiver", "ipc-receiver", "host-sender", "ipc-sender"],
)
def test_a_socket_that_cannot_bind_or_connect_is_closed(open_half):
    """A receiver whose port was taken raised from `bind` (a sender from `connect` to a bad
    address) and left its new socket open for as long as the error lived (its traceback
    holds it), then closed it with a ResourceWarning."""
    taken = HostReceiver(CpuPlatform())  # 127.0.0.1 only
    try:
        with pytest.raises(zmq.ZMQError):
            open_half(taken.address)  # once first: what the first failure opens for good is not counted
        before = len(os.listdir("/proc/self/fd"))
        errors = []
        for _ in range(3):
            with pytest.raises(zmq.ZMQError) as info:
                open_half(taken.address)
            errors.append(info)  # held, as a caller that reports it does
        assert _num_fds(at_most=before) <= before  # each failure would hold one more
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del errors, info
            gc.collect()
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        taken.close()


def test_a_closed_collective_receiver_leaves_the_group_and_says_so(receive_in_thread):
    """CollectiveReceiver had no close(): its connections stayed open as long as the object
    lived, and nothing could tell the trainer it was gone."""
    w = [("w", torch.arange(6.0).reshape(2, 3))]
    sender, receiver = _joined_collective_pair(timeout_s=60)
    t, out = receive_in_thread(receiver.receive, 60)
    sender.send(1, w)
    t.join(60)
    assert out["weights"].version == 1
    receiver.close()
    receiver.close()  # idempotent
    begin = time.monotonic()
    with pytest.raises(TransferError, match="broadcast of version 2 failed"):
        sender.send(2, w)
    assert time.monotonic() - begin < 30  # the receiver's connections closed: at once, not at the group's 60 s timeout
    with pytest.raises(TransferError, match="rank 1 of the weight broadcast group was closed"):
        receiver.receive(1)
    sender.close()
    sender.close()
    with pytest.raises(TransferError, match="rank 0 of the weight broadcast group was closed"):
        sender.send(3, w)


def test_a_weight_broadcast_group_applies_the_platforms_communication_defaults(monkeypatch):
    """NCCL's and HCCL's defaults (`apply_comm_env`) were set only by `init_process_group`,
    which a rollout actor never calls: its broadcast group ran without them."""
    platform, applied = CpuPlatform(), []
    monkeypatch.setattr(platform, "apply_comm_env", lambda: applied.append(True) or {})
    sender = CollectiveSender(platform, num_receivers=1, timeout_s=1.0)
    receiver = CollectiveReceiver(platform, rank=1, num_receivers=1, host="127.0.0.1", port=sender.port, timeout_s=1.0)
    assert applied == [True, True]
    receiver.close()
    sender.close()


def test_ipc_collect_does_not_clear_placed_weights_for_change_under_a_receiver_that_may_still_read():
    """Placed weights change as soon as `collect` returns (the trainer's next optimizer
    step). A receiver whose answer never came (reset) may still read them: a second
    `collect` returned at once (nothing waited on), the trainer changed its weights, and
    the late receiver returned version 1 holding what the step wrote."""
    v1 = {"w": torch.full((1024,), 1.0)}
    receiver = IpcReceiver(CpuPlatform(), expected=expected_specs(v1.items()))
    sender = IpcSender(CpuPlatform(), reply_timeout_s=0.3)
    sender.connect(receiver.address)
    try:
        (view,) = sender.place([TensorSpec.of("w", v1["w"])])
        view.copy_(v1["w"])
        sender.post(1, [("w", view)])
        with pytest.raises(TransferError, match=r"did not answer within 0.3s \(version 1\)"):
            sender.collect()
        with pytest.raises(TransferError, match=f"{receiver.address} may still be reading version 1"):
            sender.collect()  # the trainer asks again before its step: not yet
        got = receiver.receive(30)  # version 1's announcement, late: the weights are still version 1's
        assert got.version == 1 and got.tensors["w"].unique().tolist() == [1.0]
        t = threading.Thread(target=receiver.receive, args=(30,), daemon=True)
        t.start()
        sender.post_again()
        sender.collect()  # it answered: now the trainer may change them
        t.join(30)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("refused", [False, True], ids=["answered", "refused"])
def test_ipc_placed_version_is_not_announced_again_once_the_trainer_may_have_changed_it(refused, receive_in_thread):
    """`post_again` gives a replaced receiver the version in the buffer. Placed weights are
    no longer that version once `collect` returned (the trainer steps them in place): a
    receiver connected after the step was announced version 1 and returned the stepped
    weights as version 1 (also when the first receiver had refused version 1)."""
    v1 = {"w": torch.full((1024,), 1.0)}
    first = IpcReceiver(CpuPlatform(), expected=expected_specs([("other", torch.zeros(3))] if refused else v1.items()))
    sender = IpcSender(CpuPlatform(), reply_timeout_s=30)
    sender.connect(first.address)
    replacement = None
    try:
        (view,) = sender.place([TensorSpec.of("w", v1["w"])])
        view.copy_(v1["w"])
        t, out = receive_in_thread(first.receive, 30)
        sender.post(1, [("w", view)])
        if refused:
            with pytest.raises(TransferError, match="refused version 1"):
                sender.collect()
        sender.collect()  # every receiver answered: the trainer may change its weights
        t.join(30)
        view.fill_(2.0)  # the trainer's optimizer step, in place
        sender.disconnect(first.address)
        replacement = IpcReceiver(CpuPlatform(), expected=expected_specs(v1.items()))
        sender.connect(replacement.address)
        sender.post_again()  # nothing to announce: the buffer holds no posted version now
        with pytest.raises(TransferError, match="no weights arrived"):
            replacement.receive(0.3)
        t, out = receive_in_thread(replacement.receive, 30)
        sender.post(2, [("w", view)])  # the next version reaches it
        t.join(30)
        assert out["weights"].version == 2 and out["weights"].tensors["w"].unique().tolist() == [2.0]
    finally:
        sender.close()
        first.close()
        if replacement is not None:
            replacement.close()


def test_a_receiver_takes_a_token_that_is_not_ascii_for_a_wrong_one():
    """The host receiver skips a message with another token ("not from our trainer"), the
    ipc receiver refuses it; one whose token held a non-ASCII character made
    `hmac.compare_digest` raise TypeError (out of the host receiver's `receive`)."""
    receiver = HostReceiver(CpuPlatform(), token="secret")
    stray = zmq.Context.instance().socket(zmq.PUSH)
    sender = HostSender(CpuPlatform(), token="secret")
    try:
        stray.connect(receiver.address)
        stray.send_multipart([pack_header(kind="begin", version=9, token="\u00e9"), b""])
        sender.connect(receiver.address)
        sender.send(1, [("w", torch.ones(3))])
        got = receiver.receive(5)
        assert got.version == 1 and torch.equal(got.tensors["w"], torch.ones(3))
    finally:
        stray.close(linger=0)
        sender.close()
        receiver.close()
    ipc = IpcReceiver(CpuPlatform(), token="secret")
    stray = zmq.Context.instance().socket(zmq.REQ)
    try:
        stray.connect(ipc.address)
        stray.send_multipart([pack_header(kind="ipc", version=9, token="\u00e9"), b""])
        with pytest.raises(TransferError, match="wrong token"):  # was "comparing strings with non-ASCII characters is not supported"
            ipc.receive(5)
    finally:
        stray.close(linger=0)
        ipc.close()


def test_weights_that_repeat_a_name_are_refused_naming_it():
    specs = [TensorSpec(n, "float32", (2,)) for n in ("embed.weight", "head.weight", "norm.weight", "head.weight")]
    with pytest.raises(TransferError, match=r"weights of version 3 repeat tensor names \['head.weight'\]"):
        plan_manifest(3, specs)


def test_a_host_version_given_up_on_a_timeout_counts_as_failed():
    """A version that began and timed out was abandoned as surely as one the trainer
    aborted, but `num_failed` counted only the latter: a receiver whose trainer stalled
    mid-version reported no failure. A timeout with no version begun counts nothing."""
    receiver = HostReceiver(CpuPlatform(), token="t")
    trainer = zmq.Context.instance().socket(zmq.PUSH)
    try:
        with pytest.raises(TransferError, match=r"no version started"):
            receiver.receive(0.2)
        assert receiver.num_failed == 0
        trainer.connect(receiver.address)
        manifest = plan_manifest(4, [TensorSpec("w", "float32", (2,))])
        trainer.send_multipart([pack_header(kind="begin", version=4, token="t"), manifest.pack()])  # and then nothing
        with pytest.raises(TransferError, match=r"weights incomplete after 2s \(version 4: 0 of 1 buckets arrived\)"):
            receiver.receive(2)
        assert receiver.num_failed == 1
    finally:
        trainer.close(linger=0)
        receiver.close()
