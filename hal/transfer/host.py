"""The `host` transport: device -> pinned host buckets -> ZeroMQ/TCP -> device, any pair of platforms.

The sender pushes one message per bucket to every receiver (a PUSH socket each):
`begin` (header + manifest), `bucket` (header + one raw frame per tensor), `end` (or
`abort` when the weights broke their specs mid-version). Each bucket's tensors are
pulled from the `WeightSource` just before it goes.
Device tensors are copied into one of two pinned staging buffers and the frames point
into it (`copy=False`), so ZeroMQ's I/O thread sends bucket k while bucket k+1 is being
copied off the device; host tensors (cpu and fake platforms) are sent from their own
memory without a copy. The receiver copies each frame straight into a tensor on its
device and returns the version only after `end`, when every bucket arrived complete.
"""

from __future__ import annotations

import hmac
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
import zmq

from tidal.hal.platform import Platform
from tidal.hal.transfer import (
    DEFAULT_BUCKET_BYTES,
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

_T = TypeVar("_T")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
POLL_S = 0.1
"""How often a blocked send checks whether it was aborted."""


def open_socket(kind: int, address: str, *, bind: bool = False, options: Mapping[int, int] | None = None) -> zmq.Socket:
    """A new socket of `kind` (linger 0, then `options`) bound or connected to `address`;
    closed again when that fails (a taken port, a malformed address), so nothing leaks."""
    sock: zmq.Socket = zmq.Context.instance().socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def check_bind(address: str, token: str | None) -> None:
    """A receiver bound beyond this host must require a token."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    if host not in LOCAL_HOSTS and not token:
        raise ValueError(f"a weight receiver bound to {address} (not 127.0.0.1) needs a token")


class HostSender:
    """Trainer side: sends versions to every connected receiver."""

    def __init__(self, platform: Platform, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, send_timeout_s: float = 120.0, token: str | None = None) -> None:
        self._platform = platform
        self._bucket_bytes = bucket_bytes
        self._timeout_ms = int(send_timeout_s * 1000)
        self._token = token or ""
        self._sockets: dict[str, zmq.Socket] = {}
        self._staging: list[torch.Tensor] = []
        self._aborted = threading.Event()

    def connect(self, address: str) -> None:
        # IMMEDIATE: queue nothing for a receiver that is not there
        self._sockets[address] = open_socket(zmq.PUSH, address, options={zmq.IMMEDIATE: 1, zmq.SNDTIMEO: self._timeout_ms})
        self._aborted.clear()

    def disconnect(self, address: str) -> None:
        sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close(linger=0)
        self._aborted.clear()

    def send(self, version: int, weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Send `weights` as `version`; returns when every receiver's frames left this process.

        A bucket's tensors are pulled from the source just before it goes and dropped once
        they are staged (device tensors) or on the wire (host tensors, sent from their own
        memory: the next bucket is pulled after they left), so the sender holds about one
        bucket of them. A tensor that is not its spec's stops the version: the receivers
        are told (`abort`) and nothing goes live. `end` goes only once every bucket's
        frames left this process, so a send that fails before then leaves no complete
        version queued (its frames may point into staging buffers the next send reuses).

        Raises:
            TransferError: a receiver did not take the data within the send timeout, or a
                tensor did not match its spec (named).
        """
        if not self._sockets:
            raise TransferError("no weight receiver is connected")
        source = weight_source(weights)
        manifest = plan_manifest(version, source.specs(), bucket_bytes=self._bucket_bytes)
        trackers: list[Any] = []
        self._send_all([pack_header(kind="begin", version=version, token=self._token), manifest.pack()], trackers, version)
        pending: list[list[Any]] = [[], []]  # trackers per staging buffer
        with Puller(manifest, source) as puller:
            for k in range(len(manifest.buckets)):
                tensors = self._or_abort(version, lambda: puller.bucket(k))  # noqa: B023 - called at once
                on_host = all(t.device.type == "cpu" for t in tensors)
                if on_host:
                    frames = [tensor_bytes(t).numpy() for t in tensors]
                else:
                    for t in pending[k % 2]:
                        self._wait(t, version)  # the buffer's previous bucket has left
                    pending[k % 2] = []
                    frames = self._stage(k % 2, tensors, manifest.bucket_nbytes(k))
                del tensors  # staged, or kept alive by the frames until they are sent
                sent: list[Any] = []
                self._send_all([pack_header(kind="bucket", version=version, index=k, token=self._token), *frames], sent, version)
                del frames
                trackers += sent
                if on_host:
                    for t in sent:
                        self._wait(t, version)  # the bucket's own memory left: drop it before pulling the next
                else:
                    pending[k % 2] += sent
            self._or_abort(version, puller.finish)
        for t in trackers:
            self._wait(t, version)  # every bucket left before `end` goes: a send that fails here leaves no complete version queued behind it (the next send rewrites the staging buffers its frames point into)
        # `end` is one small frame, which ZeroMQ copies: its tracker is done at once, so there is nothing to wait for
        self._send_all([pack_header(kind="end", version=version, num_buckets=len(manifest.buckets), token=self._token)], [], version)
        return manifest

    def _or_abort(self, version: int, pull: Callable[[], _T]) -> _T:
        """`pull()`; when the source fails or breaks its specs, tell the receivers to drop
        `version` (best effort), then raise."""
        try:
            return pull()
        except Exception as e:
            try:
                self._send_all([pack_header(kind="abort", version=version, token=self._token, reason=str(e)[:500])], [], version)
            except TransferError:
                pass  # a receiver that is gone drops the version anyway
            raise

    def abort(self) -> None:
        """Make a `send` in progress in another thread, and every later one, give up with
        `TransferError` (a receiver died) until the receivers change (`connect` or
        `disconnect`). Thread-safe."""
        self._aborted.set()

    def _wait(self, tracker: Any, version: int) -> None:
        deadline = time.monotonic() + self._timeout_ms / 1000
        while True:
            try:
                tracker.wait(POLL_S)
                return
            except zmq.NotDone:
                if self._aborted.is_set():
                    raise TransferError(f"weight send of version {version} aborted: a receiver went away") from None
                if time.monotonic() > deadline:
                    raise TransferError(f"a weight receiver did not take data within {self._timeout_ms / 1000:g}s (version {version})") from None

    def _stage(self, slot: int, tensors: list[torch.Tensor], nbytes: int) -> list[Any]:
        """Copy device tensors into pinned staging buffer `slot`; return a frame per tensor."""
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8))
        if self._staging[slot].numel() < nbytes:
            self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._platform.pin_memory)
        buf = self._staging[slot]
        views, offset = [], 0
        for t in tensors:
            src = tensor_bytes(t)
            dst = buf[offset : offset + src.numel()]
            dst.copy_(src, non_blocking=True)
            views.append(dst)
            offset += src.numel()
        event = self._platform.new_event()
        event.record()
        event.synchronize()  # the host reads the buffer only after the copies finished
        return [v.numpy() for v in views]

    def _send_all(self, frames: list[Any], trackers: list[Any], version: int) -> None:
        for address, sock in self._sockets.items():
            deadline = time.monotonic() + self._timeout_ms / 1000
            while not sock.poll(int(POLL_S * 1000), zmq.POLLOUT):  # IMMEDIATE: writable only while the receiver is there
                if self._aborted.is_set():
                    raise TransferError(f"weight send of version {version} to {address} aborted: a receiver went away")
                if time.monotonic() > deadline:
                    raise TransferError(f"weight receiver {address} did not take data within {self._timeout_ms / 1000:g}s (version {version})")
            # a tracker per frame: `send_multipart` returns only the last one's, done at once when
            # that frame is small (copied), while a large one before it may still be queued
            for i, frame in enumerate(frames):
                trackers.append(sock.send(frame, zmq.SNDMORE if i < len(frames) - 1 else 0, copy=False, track=True))

    def close(self) -> None:
        for address in list(self._sockets):
            self.disconnect(address)


def copy_in(data: Any, spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """A new tensor on `device` holding the raw bytes `data` (a buffer) as `spec`."""
    out = torch.empty(spec.shape, dtype=spec.torch_dtype, device=device)
    if out.numel() == 0:  # nothing to copy (torch.frombuffer refuses an empty buffer)
        return out
    if device.type == "cpu":
        tensor_bytes(out).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only frame: it is only read
            out.copy_(from_bytes(torch.frombuffer(data, dtype=torch.uint8), spec))
    return out


class HostReceiver:
    """Rollout side: binds a PULL socket and assembles complete, checked versions."""

    def __init__(
        self,
        platform: Platform,
        *,
        bind: str = "tcp://127.0.0.1:0",
        expected: Mapping[str, TensorSpec] | None = None,
        token: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        check_bind(bind, token)
        self._platform = platform
        self._device = device if device is not None else platform.device(0)
        self._expected = expected
        self._token = token or ""
        self._sock = open_socket(zmq.PULL, bind, bind=True)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_failed = 0
        """Versions that started arriving and were abandoned incomplete."""
        self._begun: tuple[dict[str, Any], list[zmq.Frame]] | None = None
        """A version's first message, taken by `wait` for `receive`."""

    def _next(self, timeout_s: float) -> tuple[dict[str, Any], list[zmq.Frame]] | None:
        """The next message from our trainer (its header and frames), or None after `timeout_s`."""
        if self._begun is not None:
            message, self._begun = self._begun, None
            return message
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._sock.poll(int(left * 1000) + 1):
            frames = self._sock.recv_multipart(copy=False)
            header = unpack_header(frames[0].bytes)
            if hmac.compare_digest(str(header.get("token", "")).encode(), self._token.encode()):  # bytes: str refuses non-ASCII
                return header, frames
        return None  # (a message with another token is not from our trainer)

    def wait(self, timeout_s: float) -> bool:
        """True once a version has begun arriving (`WaitsForVersions`: `receive` then takes
        it, within a time its size sets); False after `timeout_s`. Messages before a version's
        first (the tail of one given up on) are dropped, as `receive` drops them."""
        deadline = time.monotonic() + timeout_s
        while self._begun is None:
            message = self._next(max(deadline - time.monotonic(), 0.0))
            if message is None:
                return False
            if message[0].get("kind") == "begin":
                self._begun = message
        return True

    def receive(self, timeout_s: float) -> Weights:
        """The next complete version; raises `TransferError` when none completes in time.
        A version that began arriving and does not go live (timed out, aborted by the
        trainer, ended short or malformed) counts in `num_failed`."""
        deadline = time.monotonic() + timeout_s
        manifest: Manifest | None = None
        tensors: dict[str, torch.Tensor] = {}
        got: set[int] = set()
        while True:
            message = self._next(deadline - time.monotonic())
            if message is None:
                where = f"version {manifest.version}: {len(got)} of {len(manifest.buckets)} buckets arrived" if manifest else "no version started"
                if manifest is not None:
                    self.num_failed += 1  # given up on: the rest of its frames are the tail of a version the next call never saw begin
                raise TransferError(f"weights incomplete after {timeout_s:g}s ({where}); nothing went live")
            header, frames = message
            kind = header["kind"]
            if kind == "begin":
                if manifest is not None:
                    self.num_failed += 1  # the previous version never completed
                manifest = Manifest.unpack(frames[1].bytes)
                manifest.check_against(self._expected)
                tensors, got = {}, set()
            elif manifest is None or header.get("version") != manifest.version:
                continue  # the tail of a version we never saw begin
            elif kind == "bucket":
                k = int(header["index"])
                specs = [manifest.specs[i] for i in manifest.buckets[k]]
                if len(frames) - 1 != len(specs):
                    self.num_failed += 1
                    raise TransferError(f"version {manifest.version} bucket {k}: {len(frames) - 1} frames for {len(specs)} tensors")
                for spec, frame in zip(specs, frames[1:]):
                    data = frame.buffer
                    if len(data) != spec.nbytes:
                        self.num_failed += 1
                        raise TransferError(f"version {manifest.version}: tensor {spec.name!r} arrived with {len(data)} bytes, expected {spec.nbytes}")
                    tensors[spec.name] = copy_in(data, spec, self._device)
                got.add(k)
            elif kind == "abort":
                self.num_failed += 1
                raise TransferError(f"the trainer abandoned version {manifest.version} after {len(got)} of {len(manifest.buckets)} buckets ({header.get('reason', '')}); nothing went live")
            elif kind == "end":
                if len(got) != len(manifest.buckets):
                    self.num_failed += 1
                    raise TransferError(f"version {manifest.version} ended with {len(got)} of {len(manifest.buckets)} buckets; nothing went live")
                return Weights(manifest.version, tensors)

    def close(self) -> None:
        self._sock.close(linger=0)
