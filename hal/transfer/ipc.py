"""The `ipc` transport: trainer and rollout on one node and device kind (host memory:
any two processes of the node; CUDA memory: colocated ones).

The trainer writes a version into one shared buffer, pulling its tensors from the
`WeightSource` one at a time, and tells each receiver where it is over a REQ/REP
socket; the receiver copies its tensors out and replies, and only after every reply may
the trainer write the next version (`send` waits for the replies; `post` returns once the
version is announced, and the replies are collected before the next write). Host tensors (cpu and fake platforms) share an
mmap'd file in /dev/shm, named for its sender (`tidal.hal.owner`): a killed sender's
file is deleted by the next sender on the host to make its buffer (or a store server
starting there, or `tidal doctor --clean`). CUDA tensors share a device
buffer through CUDA IPC handles (`UntypedStorage._share_cuda_`, as torch.multiprocessing does), so the
weights never leave the device. NPUs have no such path here (`choose_transport` picks
`collective` for them).

A trainer on the host can keep its weights in the shared buffer itself (`place`, which
the torch train engine's `share_weights` takes): a `post` then writes nothing, each
receiver copies straight from the trainer's own tensors, and the trainer `collect`s the
answers before its next optimizer step changes them.

Run for real: the shared-file path on CPU (tests, `tidal bench weights`), weights placed
in it too (tests, the quickstart on Ray). The CUDA path is written against torch's CUDA
IPC API and was not run on this project's machines, placed weights neither.
"""

from __future__ import annotations

import hmac
import itertools
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import zmq

from tidal.hal.platform import Platform
from tidal.hal.transfer import (
    Manifest,
    Puller,
    TensorSpec,
    TransferError,
    Weights,
    WeightSource,
    from_bytes,
    pack_header,
    plan_manifest,
    tensor_bytes,
    unpack_header,
    weight_source,
)
from tidal.hal.transfer.host import POLL_S, check_bind, open_socket
from tidal.hal.transfer.shared_file import SharedFile, map_shared

PLACE_ALIGN = 64
"""Byte alignment of each tensor `IpcSender.place` lays out (a cache line; any dtype's itemsize divides it)."""


class IpcSender:
    """Trainer side: one shared buffer, grown as needed, reused for every version (or
    holding the trainer's own weights: `place`).

    `send` writes a version and returns once every receiver copied it out. `post` writes
    and announces it and returns at once; the receivers' answers are collected by
    `collect`, which the next `post` (or `send`) calls first, so the buffer is never
    written while a receiver may still be reading it. `abort` makes a `collect` waiting on
    a receiver that died give up.
    """

    def __init__(self, platform: Platform, *, reply_timeout_s: float = 120.0, token: str | None = None) -> None:
        self._platform = platform
        self._timeout_s = reply_timeout_s
        self._token = token or ""
        self._sockets: dict[str, zmq.Socket] = {}
        self._buffer: torch.Tensor | None = None
        self._file: SharedFile | None = None  # the host buffer's file: it goes when this sender does, or at exit
        self._posted: tuple[Manifest, list[bytes]] | None = None  # the version in the buffer, and its announcement
        self._waiting: set[str] = set()  # receivers announced to that have not answered yet
        self._unsettled: set[str] = set()  # reset while they may still read the buffer: no new version until they answer or go
        self._aborted = threading.Event()
        self._placed: tuple[tuple[TensorSpec, ...], list[int], list[int]] | None = None  # the specs living in the buffer (`place`), their addresses and byte offsets

    @property
    def _path(self) -> Path | None:
        """The host buffer's file (None: none, or the buffer is on a device)."""
        return None if self._file is None else self._file.path

    def connect(self, address: str) -> None:
        self._sockets[address] = _request_socket(address)
        self._aborted.clear()

    def disconnect(self, address: str) -> None:
        """Stop sending to `address` (a receiver that is gone, e.g. a restarted actor's old one)."""
        sock = self._sockets.pop(address, None)
        self._waiting.discard(address)
        self._unsettled.discard(address)
        if sock is not None:
            sock.close(linger=0)
        self._aborted.clear()

    def send(self, version: int, weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Write `weights` into the shared buffer one tensor at a time (each dropped once
        copied), then announce `version`; returns when every receiver copied it out.

        Raises:
            TransferError: a receiver did not answer or refused the version, or a tensor did
                not match its spec (named; then nothing is announced).
        """
        manifest = self.post(version, weights)
        self.collect()
        return manifest

    def post(self, version: int, weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """`send` without waiting for the receivers: first collects the answers to the
        version posted before (raising its error, if any), then writes and announces this one."""
        if not self._sockets:
            raise TransferError("no weight receiver is connected")
        self.collect()
        self._posted = None
        source = weight_source(weights)
        manifest = plan_manifest(version, source.specs(), bucket_bytes=1 << 62)  # one bucket: the whole buffer
        buf = self._check_placed(manifest, source) if self._placed is not None else self._write(manifest, source)
        if buf.device.type != "cpu":
            self._platform.synchronize()  # the copies finished before the receiver reads
        where: dict[str, Any] = {"path": str(self._file.path)} if self._file is not None else {"cuda": list(_cuda_handle(buf))}
        if self._placed is not None:
            where["offsets"] = self._placed[2]  # a tied tensor is read from the place of the one it is tied to
        self._posted = (manifest, [pack_header(kind="ipc", version=version, token=self._token, **where), manifest.pack()])
        self.post_again()
        return manifest

    def _settle(self) -> None:
        """The end of every `collect`: raise `TransferError` while a receiver reset by an earlier
        failure may still read the buffer; else placed weights are the caller's to change, so
        the buffer no longer holds the version posted (nothing to announce again)."""
        if self._unsettled:
            raise TransferError(
                f"weight receiver {', '.join(sorted(self._unsettled))} may still be reading version {self._posted[0].version if self._posted else '?'} "
                "(its answer never came): post_again() and collect() to hear from it, or disconnect() it, before the buffer is written again"
            )
        if self._placed is not None:
            self._posted = None

    def _write(self, manifest: Manifest, source: WeightSource) -> torch.Tensor:
        """Copy the source's tensors into the buffer, in the manifest's order; the buffer."""
        device, buf, offset = torch.device("cpu"), None, 0
        with Puller(manifest, source) as puller:
            for _ in manifest.specs:
                src = tensor_bytes(puller.pull())
                if buf is None:
                    device = src.device  # the first tensor's device holds the buffer
                    buf = self._ensure(manifest.nbytes, device)
                buf[offset : offset + src.numel()].copy_(src)
                offset += src.numel()
                del src
            puller.finish()
        return buf if buf is not None else self._ensure(manifest.nbytes, device)

    def _check_placed(self, manifest: Manifest, source: WeightSource) -> torch.Tensor:
        """The buffer, once every tensor of the source is the one `place` put there (nothing to copy)."""
        assert self._placed is not None and self._buffer is not None
        specs, addresses, _ = self._placed
        if manifest.specs != specs:
            diff = next((f"{a.name!r} {a.dtype}{list(a.shape)} where {b.name!r} {b.dtype}{list(b.shape)} was placed" for a, b in zip(manifest.specs, specs) if a != b), f"{len(manifest.specs)} tensors where {len(specs)} were placed")
            raise TransferError(f"version {manifest.version}: the shared buffer holds placed weights, and these differ: {diff}; nothing went live")
        with Puller(manifest, source) as puller:
            for spec, address in zip(specs, addresses):
                if puller.pull().data_ptr() != address:
                    raise TransferError(f"version {manifest.version}: tensor {spec.name!r} is not the one placed in the shared buffer (it moved, or is a copy); nothing went live")
            puller.finish()
        return self._buffer

    def place(self, specs: Sequence[TensorSpec], ties: Mapping[str, str] | None = None, device: torch.device | None = None) -> list[torch.Tensor]:
        """Tensors for these specs inside the shared buffer (on `device`, default the
        host; device memory as `post` shares it, not run here), for the caller to keep
        those weights in (copy them in, then use the views as the weights: the torch train
        engine's `share_weights`). A `post` of those very tensors then writes nothing:
        every receiver copies straight from them. In return the caller changes them only
        after `collect` (no version out), and every later `post` must be of them (anything
        else raises `TransferError`). `ties[name] = other`: `name` is the very tensor
        `other` is (tied weights), so it gets `other`'s view and no room of its own.
        Waits for a version still out first.

        Each tensor starts at a multiple of `PLACE_ALIGN` bytes, so any dtype can be viewed there.

        Raises:
            TransferError: a tie names an unknown tensor, a tied one, or one of another
                dtype or shape; the version out was refused or not answered, or a receiver
                reset by an earlier failure may still be reading the buffer (as `post`).
                Nothing is placed.
        """
        self.collect()
        ties = dict(ties or {})
        manifest = plan_manifest(0, specs, bucket_bytes=1 << 62)  # checks the names are unique
        index = {spec.name: i for i, spec in enumerate(manifest.specs)}
        for name, other in ties.items():
            if name not in index or other not in index or other in ties or name == other:
                raise TransferError(f"cannot tie {name!r} to {other!r}: each must be a tensor placed here, and {other!r} not tied itself")
            a, b = manifest.specs[index[name]], manifest.specs[index[other]]
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise TransferError(f"cannot tie {name!r} {a.dtype}{list(a.shape)} to {other!r} {b.dtype}{list(b.shape)}")
        own: dict[str, int] = {}  # byte offset of each tensor with room of its own
        end = 0
        for spec in manifest.specs:
            if spec.name not in ties:
                own[spec.name] = end = -(-end // PLACE_ALIGN) * PLACE_ALIGN  # the announcement carries the offsets: padding costs nothing
                end += spec.nbytes
        offsets = [own[ties.get(spec.name, spec.name)] for spec in manifest.specs]
        self._placed = self._posted = None  # what the buffer held is gone: nothing to announce again
        buf = self._ensure(end, device if device is not None else torch.device("cpu"))
        views = [from_bytes(buf[offset : offset + spec.nbytes], spec) for offset, spec in zip(offsets, manifest.specs)]
        self._placed = (manifest.specs, [v.data_ptr() for v in views], offsets)
        return views

    def post_again(self) -> None:
        """Announce the version in the buffer again to every receiver not waited on (after a
        receiver was replaced: the new one gets it, the others take it twice, harmlessly).
        Nothing to announce before the first `post`, after one that failed, or once every
        receiver answered a version of placed weights (the trainer may have changed them)."""
        if self._posted is None:
            return
        for address, sock in self._sockets.items():
            if address not in self._waiting:
                sock.send_multipart(self._posted[1])  # a REQ socket with no request out: never blocks
                self._waiting.add(address)

    def collect(self, timeout_s: float | None = None) -> None:
        """Wait until every receiver answered the posted version (nothing to do when none
        is out). Raises `TransferError` when one refused it, did not answer within
        `timeout_s` (default: the reply timeout), or `abort` was called; the sockets still
        waiting are then reset. A reset receiver may still read the buffer (placed weights
        too, which the caller changes once this returns): until it answers again
        (`post_again`, then `collect`) or is disconnected, this raises `TransferError`."""
        if not self._waiting:
            self._settle()
            return
        version = self._posted[0].version if self._posted is not None else None
        poller = zmq.Poller()
        for address in self._waiting:
            poller.register(self._sockets[address], zmq.POLLIN)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            while self._waiting:
                if self._aborted.is_set():
                    raise TransferError(f"weight version {version} aborted: a receiver went away")
                if time.monotonic() > deadline:
                    raise TransferError(f"weight receiver {', '.join(sorted(self._waiting))} did not answer within {timeout_s:g}s (version {version})")
                for sock, _ in poller.poll(int(POLL_S * 1000)):
                    address = next(a for a, s in self._sockets.items() if s is sock)
                    reply = sock.recv()
                    self._waiting.discard(address)
                    self._unsettled.discard(address)
                    poller.unregister(sock)
                    if reply != b"ok":
                        raise TransferError(f"weight receiver {address} refused version {version}: {reply.decode(errors='replace')}")
        except TransferError:
            for address in list(self._waiting):
                self._reset(address)
            raise
        self._settle()

    def abort(self) -> None:
        """Make a `collect` in progress in another thread, and every later one, give up with
        `TransferError` (a receiver died) until the receivers change (`connect` or
        `disconnect`). Thread-safe."""
        self._aborted.set()

    def _ensure(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._buffer is not None and self._buffer.numel() >= nbytes and self._buffer.device == device:
            return self._buffer
        self._release_file()
        if device.type == "cpu":
            self._file = SharedFile(nbytes, remedy="give it more room (e.g. docker run --shm-size) or set transport.name=host")
            self._buffer = self._file.buffer
        else:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer

    def _reset(self, address: str) -> None:
        """A REQ socket whose answer never came cannot send again: replace it. Its receiver
        may still be reading the buffer: it is unsettled until it answers again."""
        self._waiting.discard(address)
        self._unsettled.add(address)
        self._sockets.pop(address).close(linger=0)
        self._sockets[address] = _request_socket(address)  # an abort stands until the receivers change

    def _release_file(self) -> None:
        self._buffer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        self._waiting.clear()
        self._unsettled.clear()
        self._posted = None
        self._placed = None  # placed tensors keep their mapping (the file's name goes)
        self._release_file()


class IpcReceiver:
    """Rollout side: binds a REP socket, copies each announced version out of the shared buffer."""

    def __init__(
        self, platform: Platform, *, bind: str = "tcp://127.0.0.1:0", expected: Mapping[str, TensorSpec] | None = None, token: str | None = None, device: torch.device | None = None
    ) -> None:
        """`device`: where the received tensors go (default the platform's device 0)."""
        check_bind(bind, token)
        self._platform = platform
        self._device = device if device is not None else platform.device(0)
        self._expected = expected
        self._token = token or ""
        self._sock = open_socket(zmq.REP, bind, bind=True)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._mapped: tuple[str, torch.Tensor] | None = None

    def wait(self, timeout_s: float) -> bool:
        """True once a version is announced (`WaitsForVersions`); False after `timeout_s`."""
        return bool(self._sock.poll(int(timeout_s * 1000)))

    def receive(self, timeout_s: float) -> Weights:
        if not self._sock.poll(int(timeout_s * 1000)):
            raise TransferError(f"no weights arrived within {timeout_s:g}s")
        frames = self._sock.recv_multipart()
        try:
            header = unpack_header(frames[0])
            if not hmac.compare_digest(str(header.get("token", "")).encode(), self._token.encode()):  # bytes: str refuses non-ASCII
                raise TransferError("weights arrived with a wrong token")
            manifest = Manifest.unpack(frames[1])
            manifest.check_against(self._expected)
            offsets = header.get("offsets") or list(itertools.accumulate((spec.nbytes for spec in manifest.specs), initial=0))[:-1]
            if len(offsets) != len(manifest.specs) or min(offsets, default=0) < 0:
                raise TransferError(f"version {manifest.version}: the announcement gives {len(offsets)} offsets for {len(manifest.specs)} tensors")
            buf = self._open(header, max((offset + spec.nbytes for offset, spec in zip(offsets, manifest.specs)), default=0))
            tensors = {}
            for offset, spec in zip(offsets, manifest.specs):
                raw = buf[offset : offset + spec.nbytes].clone()  # aligned copy; the trainer may overwrite the buffer after our reply
                tensors[spec.name] = from_bytes(raw, spec).to(self._device)
            if buf.device.type != "cpu":  # a device buffer's copies are queued on a stream: done before "ok" frees the buffer
                self._platform.synchronize(buf.device)
        except Exception as e:  # noqa: BLE001 - whatever failed, the sender hears why before this raises
            self._sock.send(str(e).encode())
            raise TransferError(f"{e}; nothing went live") from None
        self._sock.send(b"ok")
        return Weights(manifest.version, tensors)

    def _open(self, header: dict[str, Any], nbytes: int) -> torch.Tensor:
        if "path" in header:
            path = str(header["path"])
            if self._mapped is None or self._mapped[0] != path or self._mapped[1].numel() < nbytes:
                try:
                    self._mapped = (path, map_shared(path, nbytes))
                except TransferError as e:
                    raise TransferError(f"version {header.get('version')}: {e}") from None
            return self._mapped[1]
        return _open_cuda_handle(header["cuda"])[:nbytes]

    def close(self) -> None:
        self._sock.close(linger=0)
        self._mapped = None


def _request_socket(address: str) -> zmq.Socket:
    return open_socket(zmq.REQ, address)


def _cuda_handle(buf: torch.Tensor) -> tuple[Any, ...]:
    """msgpack-able CUDA IPC handle of `buf`'s storage (what torch.multiprocessing sends)."""
    handle = buf.untyped_storage()._share_cuda_()
    return tuple(h if not isinstance(h, torch.device) else str(h) for h in handle)


def _open_cuda_handle(handle: list[Any]) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(*handle)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle[0]}").set_(storage)

