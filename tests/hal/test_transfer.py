"""Weight transports: every tensor of a version arrives intact, or nothing goes live."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from tidal.hal.cpu import CpuPlatform, fake_platform
from tidal.hal.platform import describe
from tidal.hal.transfer import Manifest, TransferError, choose_transport, expected_specs, make_manifest, pack_header, weight_source
from tidal.hal.transfer.host import HostReceiver, HostSender
from tidal.hal.transfer.ipc import IpcReceiver, IpcSender


def _weights(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64 * scale, 16, generator=g),
        "norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),  # odd byte count: misaligns what follows
        "layers.0.mlp.weight": torch.randn(33, 16, generator=g).to(torch.float16),
        "step": torch.tensor([3], dtype=torch.int64),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].cpu(), t), name


def test_manifest_buckets_round_trip_and_checks():
    w = _weights()
    m = make_manifest(5, list(w.items()), bucket_bytes=4096)
    assert len(m.buckets) >= 2 and sorted(i for b in m.buckets for i in b) == list(range(len(w)))
    assert all(m.bucket_nbytes(k) <= 4096 or len(b) == 1 for k, b in enumerate(m.buckets))
    back = Manifest.unpack(m.pack())
    assert back == m and back.nbytes == sum(t.numel() * t.element_size() for t in w.values())
    back.check_against(expected_specs(w.items()))
    other = dict(w, **{"embed.weight": torch.zeros(65, 16)})
    other.pop("step")
    with pytest.raises(TransferError, match=r"version 5 do not match.*unexpected \['step'\].*embed.weight: got float32\[64, 16\], model has float32\[65, 16\]"):
        back.check_against(expected_specs(other.items()))
    with pytest.raises(TransferError, match="malformed weight manifest"):
        Manifest.unpack(b"\x93garbage")
    bad = msgpack.packb({"version": 1, "specs": [["a", "float32", [2]]], "buckets": [[0, 0]]})
    with pytest.raises(TransferError, match="do not cover every tensor once"):
        Manifest.unpack(bad)
    with pytest.raises(TransferError, match="weight 'head.bias' is a list, not a tensor"):  # was AttributeError: 'list' ... 'detach'
        weight_source([("head.bias", [0.0, 1.0])])


@pytest.mark.parametrize(
    ("sender", "receiver", "colocated", "same_node", "want"),
    [
        (("cpu", False), ("cpu", False), True, True, "ipc"),
        (("cpu", False), ("cpu", False), False, True, "ipc"),  # host memory: any two processes of a node
        (("cpu", False), ("cpu", False), False, False, "collective"),
        (("cpu", True), ("cpu", True), False, True, "ipc"),
        (("cuda", False), ("cuda", False), False, True, "collective"),  # device memory: colocated only
        (("npu", True), ("npu", True), True, True, "ipc"),  # fake NPUs hold CPU tensors
        (("npu", False), ("npu", False), True, True, "collective"),  # no NPU IPC path
        (("cuda", False), ("cuda", False), True, True, "ipc"),
        (("cuda", False), ("cuda", False), False, False, "collective"),
        (("npu", True), ("cuda", True), False, False, "host"),  # decides as the real kinds would
        (("cuda", False), ("npu", False), False, True, "host"),
    ],
)
def test_choose_transport(sender, receiver, colocated, same_node, want):
    s = describe(sender[0], device_count=8, fake=sender[1])
    r = describe(receiver[0], device_count=8, fake=receiver[1])
    assert choose_transport(s, r, same_node=same_node, colocated=colocated) == want


def test_transport_override_that_cannot_work_says_why():
    npu, gpu = describe("npu", device_count=8), describe("cuda", device_count=8)
    with pytest.raises(ValueError, match="transport=collective needs one collective backend.*hccl -> nccl"):
        choose_transport(npu, gpu, same_node=False, colocated=False, override="collective")
    with pytest.raises(ValueError, match="transport=ipc needs"):
        choose_transport(npu, npu, same_node=True, colocated=True, override="ipc")
    with pytest.raises(ValueError, match="not one of auto, ipc, collective, host"):
        choose_transport(npu, npu, same_node=True, colocated=True, override="rdma")
    assert choose_transport(npu, gpu, same_node=False, colocated=False, override="host") == "host"


def test_two_torch_builds_exchange_weights_over_host_only():
    """A rollout in a vLLM (or vllm-ascend) environment with a torch of its own: auto picks
    host where it would pick ipc or collective, and those two are refused naming the builds."""
    cpu, gpu = describe("cpu", device_count=8), describe("cuda", device_count=8)
    builds = ("2.13.0+cu130", "2.10.0+cu128")
    assert choose_transport(cpu, cpu, same_node=True, colocated=False, torch_builds=builds) == "host"
    assert choose_transport(gpu, gpu, same_node=False, colocated=False, torch_builds=builds) == "host"
    assert choose_transport(gpu, gpu, same_node=True, colocated=True, torch_builds=(builds[0], builds[0])) == "ipc"
    for kind in ("ipc", "collective"):
        with pytest.raises(ValueError, match=rf"transport={kind} needs one torch build on both sides; here: torch 2\.13\.0\+cu130 -> 2\.10\.0\+cu128"):
            choose_transport(gpu, gpu, same_node=True, colocated=True, override=kind, torch_builds=builds)


def _receive_in_thread(receiver, *args):
    out: dict = {}

    def run():
        try:
            out["weights"] = receiver.receive(*args)
        except Exception as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_host_transport_delivers_every_version_to_every_receiver():
    platform = fake_platform("npu", 2)
    w = _weights()
    receivers = [HostReceiver(fake_platform("cuda", 1), expected=expected_specs(w.items())) for _ in range(2)]
    sender = HostSender(platform, bucket_bytes=1024)
    for r in receivers:
        sender.connect(r.address)
    try:
        for version in (1, 2):
            w = {n: t + version if t.is_floating_point() else t for n, t in w.items()}
            threads = [_receive_in_thread(r, 30) for r in receivers]
            manifest = sender.send(version, w.items())
            assert len(manifest.buckets) >= 3
            for t, out in threads:
                t.join(30)
                assert "error" not in out, out.get("error")
                assert out["weights"].version == version
                _assert_same(out["weights"].tensors, w)
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_host_transport_partial_or_mismatched_version_never_goes_live():
    w = _weights()
    receiver = HostReceiver(CpuPlatform(), expected=expected_specs(w.items()))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(receiver.address)
    try:
        m = make_manifest(7, list(w.items()), bucket_bytes=2048)
        push.send_multipart([pack_header(kind="begin", version=7, token=""), m.pack()])
        push.send_multipart([pack_header(kind="end", version=7, num_buckets=len(m.buckets), token="")])
        with pytest.raises(TransferError, match=f"version 7 ended with 0 of {len(m.buckets)} buckets; nothing went live"):
            receiver.receive(10)
        push.send_multipart([pack_header(kind="begin", version=8, token=""), m.pack()])  # a trainer that died mid-version
        with pytest.raises(TransferError, match=f"version 7: 0 of {len(m.buckets)} buckets arrived|version 8: 0 of"):
            receiver.receive(0.5)
        wrong = make_manifest(9, [(n, t) for n, t in w.items() if n != "step"])
        push.send_multipart([pack_header(kind="begin", version=9, token=""), wrong.pack()])
        with pytest.raises(TransferError, match=r"version 9 do not match the model: missing \['step'\]"):
            receiver.receive(10)
    finally:
        push.close(linger=0)
        receiver.close()


def test_host_sender_times_out_naming_an_absent_receiver():
    sender = HostSender(CpuPlatform(), send_timeout_s=0.3)
    sender.connect("tcp://127.0.0.1:1")  # nothing listens there
    with pytest.raises(TransferError, match=r"weight receiver tcp://127.0.0.1:1 did not take data within 0.3s \(version 1\)"):
        sender.send(1, _weights().items())
    sender.close()


def test_host_send_blocked_on_a_dead_receiver_gives_up_when_aborted_until_receivers_change(tmp_path):
    w = _weights()
    gone = HostReceiver(CpuPlatform(), bind=f"ipc://{tmp_path}/gone", token="t")  # a TCP port could be bound again by another process meanwhile
    sender = HostSender(CpuPlatform(), send_timeout_s=60, token="t")
    sender.connect(gone.address)
    sock = sender._sockets[gone.address]
    assert sock.poll(10_000, zmq.POLLOUT)  # connected: ZeroMQ connects in its I/O thread
    gone.close()  # the receiver's process died
    # ZeroMQ notices the closed peer a moment later (frames sent before that are lost, as a
    # dead receiver's would be); wait until the socket has been unwritable for 0.5 s, longer
    # than ZeroMQ's 0.1 s reconnect interval
    deadline, quiet_since = time.monotonic() + 10, time.monotonic()
    while time.monotonic() - quiet_since < 0.5 and time.monotonic() < deadline:
        if sock.poll(0, zmq.POLLOUT):
            quiet_since = time.monotonic()
        time.sleep(0.01)
    try:
        out: dict = {}
        thread = threading.Thread(target=lambda: out.update(error=pytest.raises(TransferError, sender.send, 1, w.items())))
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # blocked on the receiver that is not there
        sender.abort()
        thread.join(5)
        assert not thread.is_alive() and "aborted" in str(out["error"].value)
        with pytest.raises(TransferError, match="aborted"):
            sender.send(2, w.items())  # still aborted: the receivers did not change
        sender.disconnect(gone.address)
        back = HostReceiver(CpuPlatform(), expected=expected_specs(w.items()), token="t")
        sender.connect(back.address)
        t, got = _receive_in_thread(back, 30)
        sender.send(3, w.items())
        t.join(30)
        assert got["weights"].version == 3
        back.close()
    finally:
        sender.close()


def test_receiver_beyond_localhost_needs_a_token():
    with pytest.raises(ValueError, match="needs a token"):
        HostReceiver(CpuPlatform(), bind="tcp://0.0.0.0:0")


def test_ipc_transport_shares_one_buffer_and_cleans_up():
    w = _weights()
    receiver = IpcReceiver(CpuPlatform(), expected=None)
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        for version, weights in ((1, w), (2, _weights(seed=1, scale=4))):  # the second is larger: the buffer grows
            t, out = _receive_in_thread(receiver, 30)
            sender.send(version, weights.items())
            t.join(30)
            assert out["weights"].version == version
            _assert_same(out["weights"].tensors, weights)
        path = sender._path
        assert path is not None and path.exists()
    finally:
        sender.close()
        receiver.close()
    assert not Path(path).exists()


def test_ipc_sender_never_closed_removes_its_file_when_dropped_or_at_exit():
    sender = IpcSender(CpuPlatform())
    sender._ensure(4096, torch.device("cpu"))
    path = sender._path
    assert path is not None and path.exists()
    del sender
    gc.collect()
    assert not path.exists()
    code = "import torch; from tidal.hal.cpu import CpuPlatform; from tidal.hal.transfer.ipc import IpcSender; s = IpcSender(CpuPlatform()); s._ensure(4096, torch.device('cpu')); print(s._path)"
    left = Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
    assert left.name.startswith("tidal-weights-") and not left.exists()


def test_receivers_deliver_to_the_device_they_are_given():
    """A rollout guest on shared devices receives into host memory (`device=`); here the
    "meta" device stands in for one that differs from the platform's (and an empty tensor,
    which a device receiver of `host` could not copy in, for any accelerator)."""
    w = {**_weights(), "model.empty": torch.empty(0, 3)}
    meta = torch.device("meta")
    for receiver_cls, sender_cls in ((IpcReceiver, IpcSender), (HostReceiver, HostSender)):
        receiver, sender = receiver_cls(CpuPlatform(), device=meta), sender_cls(CpuPlatform())
        sender.connect(receiver.address)
        try:
            t, out = _receive_in_thread(receiver, 30)
            sender.send(1, w.items())
            t.join(30)
        finally:
            sender.close()
            receiver.close()
        got = out["weights"].tensors
        assert {n: (t.device, t.dtype, t.shape) for n, t in got.items()} == {n: (meta, t.dtype, t.shape) for n, t in w.items()}, receiver_cls


def test_ipc_receiver_refuses_a_mismatched_version_and_the_sender_hears_why():
    w = _weights()
    receiver = IpcReceiver(CpuPlatform(), expected=expected_specs([(n, t) for n, t in w.items() if n != "step"]))
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        t, out = _receive_in_thread(receiver, 30)
        with pytest.raises(TransferError, match=r"refused version 4: .*unexpected \['step'\]"):
            sender.send(4, w.items())
        t.join(30)
        assert isinstance(out["error"], TransferError) and "nothing went live" in str(out["error"])
    finally:
        sender.close()
        receiver.close()


def test_ipc_post_returns_before_the_receiver_answers_and_the_next_post_waits_for_it():
    w, w2 = _weights(), _weights(seed=1)
    receiver = IpcReceiver(CpuPlatform(), expected=None)
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        sender.post(1, w.items())  # nobody receives yet: it returns all the same
        assert sender._waiting == {receiver.address}
        posted = threading.Thread(target=sender.post, args=(2, w2.items()), daemon=True)
        posted.start()  # must not write version 2 over version 1 before the receiver copied it out
        posted.join(0.3)
        assert posted.is_alive()
        got = receiver.receive(30)
        _assert_same(got.tensors, w)
        posted.join(30)
        assert not posted.is_alive()
        t, out = _receive_in_thread(receiver, 30)
        sender.collect()
        t.join(30)
        assert out["weights"].version == 2 and not sender._waiting
        _assert_same(out["weights"].tensors, w2)
        sender.collect()  # nothing out: returns at once
    finally:
        sender.close()
        receiver.close()


def test_ipc_collect_gives_up_on_abort_and_a_new_receiver_gets_the_version_posted_again():
    w = _weights()
    gone = IpcReceiver(CpuPlatform(), expected=None)  # a receiver that never answers: its process died
    sender = IpcSender(CpuPlatform(), reply_timeout_s=60)
    sender.connect(gone.address)
    try:
        sender.post(3, w.items())
        threading.Timer(0.2, sender.abort).start()  # as `RayRollouts.run` does when Ray reports the actor dead
        begin = time.monotonic()
        with pytest.raises(TransferError, match="version 3 aborted: a receiver went away"):
            sender.collect()
        assert time.monotonic() - begin < 5 and not sender._waiting
        gone.close()
        sender.disconnect(gone.address)
        replacement = IpcReceiver(CpuPlatform(), expected=None)
        sender.connect(replacement.address)
        t, out = _receive_in_thread(replacement, 30)
        sender.post_again()
        sender.collect()
        t.join(30)
        assert out["weights"].version == 3
        _assert_same(out["weights"].tensors, w)
        replacement.close()
    finally:
        sender.close()
        gone.close()


def test_ipc_placed_weights_go_out_without_a_copy_and_a_tied_one_takes_no_room(monkeypatch):
    """A trainer keeps its weights in the buffer (`place`): a post writes nothing, each
    receiver reads the trainer's own tensors (a tied name from the place of the one it is
    tied to), and what the trainer changes after `collect` is what the next version carries."""
    from tidal.hal.transfer import TensorSpec
    from tidal.hal.transfer.ipc import PLACE_ALIGN

    g = torch.Generator().manual_seed(0)
    embed = torch.randn(10, 4, generator=g)
    want = {"embed.weight": embed, "norm.weight": torch.randn(4, generator=g).half(), "head.weight": embed, "step": torch.tensor([1, 2])}
    receiver = IpcReceiver(CpuPlatform(), expected=expected_specs(want.items()))
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        views = sender.place([TensorSpec.of(n, t) for n, t in want.items()], {"head.weight": "embed.weight"})
        placed = dict(zip(want, views))
        assert placed["head.weight"].data_ptr() == placed["embed.weight"].data_ptr()
        # embed 160 bytes, norm 8 and step 16, each at a multiple of PLACE_ALIGN; the tied head has no bytes of its own
        assert sender._placed[2] == [0, 3 * PLACE_ALIGN, 0, 4 * PLACE_ALIGN] and sender._buffer.numel() == 4 * PLACE_ALIGN + 16
        for name, t in want.items():
            placed[name].copy_(t)

        def no_copy(*args):
            raise AssertionError("a post of the placed tensors copied them")

        monkeypatch.setattr(sender, "_write", no_copy)
        for version in (1, 2):
            t, out = _receive_in_thread(receiver, 30)
            sender.post(version, list(placed.items()))
            t.join(30)
            assert out["weights"].version == version
            _assert_same(out["weights"].tensors, {n: v.clone() for n, v in placed.items()})
            sender.collect()  # every receiver took it: the trainer may change its weights
            placed["embed.weight"].mul_(2)  # as an optimizer step does, in place
            placed["step"].add_(1)
        assert torch.equal(out["weights"].tensors["head.weight"], want["embed.weight"] * 2)

        copies = {**placed, "norm.weight": placed["norm.weight"].clone()}
        with pytest.raises(TransferError, match="version 3: tensor 'norm.weight' is not the one placed"):
            sender.post(3, list(copies.items()))
        with pytest.raises(TransferError, match=r"version 4: .*these differ: 'norm.weight' float32\[4\] where 'norm.weight' float16\[4\] was placed"):
            sender.post(4, [(n, v.float() if n == "norm.weight" else v) for n, v in placed.items()])
        assert not sender._waiting  # nothing was announced
    finally:
        sender.close()
        receiver.close()


def test_ipc_place_aligns_every_tensor_and_refuses_bad_ties():
    from tidal.hal.transfer import TensorSpec
    from tidal.hal.transfer.ipc import PLACE_ALIGN

    w = _weights()  # 'norm.weight' has an odd byte count: packed, 'step' (int64) would start at byte 5,166
    receiver = IpcReceiver(CpuPlatform(), expected=expected_specs(w.items()))
    sender = IpcSender(CpuPlatform())
    sender.connect(receiver.address)
    try:
        views = sender.place([TensorSpec.of(n, t) for n, t in w.items()])
        assert all(offset % PLACE_ALIGN == 0 for offset in sender._placed[2])
        for view, t in zip(views, w.values()):
            view.copy_(t)
        t, out = _receive_in_thread(receiver, 30)
        sender.send(1, list(zip(w, views)))
        t.join(30)
        _assert_same(out["weights"].tensors, w)
        specs = [TensorSpec.of(n, t) for n, t in w.items()]
        with pytest.raises(TransferError, match=r"cannot tie 'norm.weight' bfloat16\[7\] to 'embed.weight' float32\[64, 16\]"):
            sender.place(specs, {"norm.weight": "embed.weight"})
        with pytest.raises(TransferError, match="cannot tie 'embed.weight' to 'nothing'"):
            sender.place(specs, {"embed.weight": "nothing"})
    finally:
        sender.close()
        receiver.close()


def test_ipc_collect_gives_up_at_the_reply_timeout_and_the_socket_can_send_again():
    """A receiver that did not answer in time may still be reading the buffer: no new
    version is written until it answers the one posted again (or is disconnected)."""
    w = _weights()
    receiver = IpcReceiver(CpuPlatform(), expected=None)
    sender = IpcSender(CpuPlatform(), reply_timeout_s=0.3)
    sender.connect(receiver.address)
    try:
        sender.post(1, w.items())
        with pytest.raises(TransferError, match="did not answer within 0.3s"):
            sender.collect()
        receiver.receive(30)  # version 1 was still announced; a late answer goes to the replaced socket, nowhere
        with pytest.raises(TransferError, match=r"may still be reading version 1 .*post_again\(\) and collect\(\)"):
            sender.post(2, w.items())
        t, out = _receive_in_thread(receiver, 30)
        sender.post_again()  # the replaced socket sends again
        sender.collect()
        t.join(30)
        assert out["weights"].version == 1
        t, out = _receive_in_thread(receiver, 30)
        sender.send(2, w.items())
        t.join(30)
        assert out["weights"].version == 2
    finally:
        sender.close()
        receiver.close()


def test_ipc_a_receiver_reset_by_anothers_refusal_is_not_written_over():
    """One receiver refuses a version, another has not read it yet: the failed collect
    resets the second too, and the next version waits for it (a post wrote the buffer under
    it, which then returned version 1 holding version 2's values)."""
    v1, v2 = {"w": torch.full((1024,), 1.0)}, {"w": torch.full((1024,), 2.0)}
    bad = IpcReceiver(CpuPlatform(), expected=expected_specs([("other", torch.zeros(3))]))  # refuses every version
    slow = IpcReceiver(CpuPlatform(), expected=expected_specs(v1.items()))
    sender = IpcSender(CpuPlatform())
    sender.connect(bad.address)
    sender.connect(slow.address)
    try:
        refusal = threading.Thread(target=lambda: pytest.raises(TransferError, bad.receive, 30))
        refusal.start()
        with pytest.raises(TransferError, match="refused version 1"):
            sender.send(1, v1.items())
        refusal.join(30)
        sender.disconnect(bad.address)
        with pytest.raises(TransferError, match=f"{slow.address} may still be reading version 1"):
            sender.post(2, v2.items())
        got = slow.receive(30)  # the first announcement, late
        assert got.version == 1 and got.tensors["w"].unique().tolist() == [1.0]
        t, out = _receive_in_thread(slow, 30)
        sender.post_again()
        sender.collect()
        t.join(30)
        t, out = _receive_in_thread(slow, 30)
        sender.send(2, v2.items())
        t.join(30)
        assert out["weights"].version == 2 and out["weights"].tensors["w"].unique().tolist() == [2.0]
    finally:
        sender.close()
        bad.close()
        slow.close()


def _collective_receiver(port: int, rank: int, expect_step: bool, out: dict) -> None:
    from tidal.hal.transfer.collective import CollectiveReceiver

    w = _weights()
    expected = expected_specs(w.items()) if expect_step else expected_specs([(n, t) for n, t in w.items() if n != "step"])
    receiver = CollectiveReceiver(fake_platform("npu", 1), rank=rank, num_receivers=2, host="127.0.0.1", port=port, expected=expected, timeout_s=60)
    receiver.join()
    results = []
    for _ in range(2):
        try:
            got = receiver.receive()
            results.append((got.version, {n: t.float().sum().item() for n, t in got.tensors.items()}))
        except TransferError as e:
            results.append(("error", str(e)))
    out[rank] = results


def test_collective_transport_broadcasts_to_every_rank_and_a_mismatch_keeps_the_group_in_step():
    """Three ranks of one gloo group (threads of this process, each with its own group object)."""
    from tidal.hal.transfer.collective import CollectiveSender

    sender = CollectiveSender(fake_platform("npu", 1), num_receivers=2, bucket_bytes=2048, timeout_s=60)
    results: dict = {}
    threads = [threading.Thread(target=_collective_receiver, args=(sender.port, rank, rank == 1, results), daemon=True) for rank in (1, 2)]
    for t in threads:
        t.start()
    sender.join()
    w = _weights()
    sender.send(1, w.items())
    sender.send(2, w.items())
    for t in threads:
        t.join(60)
    sums = {n: t.float().sum().item() for n, t in w.items()}
    assert results[1] == [(1, sums), (2, sums)]
    assert [r[0] for r in results[2]] == ["error", "error"] and "unexpected ['step']" in results[2][1][1]


def test_large_tensors_get_buckets_of_their_own_when_asked():
    tensors = [("a", torch.zeros(10)), ("big", torch.zeros(1000)), ("b", torch.zeros(10)), ("c", torch.zeros(10))]
    assert make_manifest(1, tensors, bucket_bytes=1 << 20).buckets == ((0, 1, 2, 3),)
    assert make_manifest(1, tensors, bucket_bytes=1 << 20, solo_bytes=4000).buckets == ((0,), (1,), (2, 3))


def test_ipc_sender_on_a_full_dev_shm_says_so_and_leaves_no_file(monkeypatch):
    """tmpfs refuses the pages at fallocate (ENOSPC) instead of killing the trainer with
    SIGBUS on its first write into the mapping."""
    from tidal.hal.transfer import shared_file

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    receiver, sender = IpcReceiver(CpuPlatform(), expected=None), IpcSender(CpuPlatform(), reply_timeout_s=30)
    sender.connect(receiver.address)
    monkeypatch.setattr(shared_file.os, "posix_fallocate", full)
    before = set(os.listdir(shared_file.SHM))
    try:
        with pytest.raises(TransferError, match=r"cannot hold .* MiB of weights in .*No space left on device.*transport.name=host"):
            sender.send(1, _weights().items())
        assert set(os.listdir(shared_file.SHM)) - before == set() and sender._path is None
        monkeypatch.undo()  # room again: the next version goes through
        t, out = _receive_in_thread(receiver, 30)
        sender.send(2, _weights().items())
        t.join(30)
        assert out["weights"].version == 2
    finally:
        sender.close()
        receiver.close()


def test_a_shared_file_is_mapped_by_path_and_deleted_when_closed(tmp_path):
    """What the ipc transport and the vllm engine hand to other processes: writes through one
    mapping are seen through the other; paths outside /dev/shm, short files and closed ones
    are refused, naming the file."""
    from tidal.hal.transfer.shared_file import SharedFile, map_shared

    shared = SharedFile(4096, prefix="tidal-test")
    other = map_shared(str(shared.path), 4096)
    shared.buffer[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert other[:4].tolist() == [1, 2, 3, 4] and shared.nbytes == 4096
    with pytest.raises(TransferError, match=r"holds 4096 bytes, 8192 are needed"):
        map_shared(str(shared.path), 8192)
    (tmp_path / "x").write_bytes(b"x")
    with pytest.raises(TransferError, match=r"is outside"):
        map_shared(str(tmp_path / "x"), 1)
    shared.close()
    assert not shared.path.exists() and shared.nbytes == 0 and other[:4].tolist() == [1, 2, 3, 4]  # a mapping keeps its pages
    with pytest.raises(TransferError, match=r"cannot map the shared weight buffer .*No such file or directory.*its holder closed it or died, or runs on another host"):
        map_shared(str(shared.path), 1)
