"""The `collective` transport: a broadcast group of one trainer (rank 0) and its receivers.

The group is built once, from a `TCPStore` the trainer hosts, as a standalone process
group of the platform's backend (NCCL, HCCL, or gloo for CPU tensors), so it neither
needs nor disturbs a default process group the trainer may use for FSDP. Each version
is broadcast as: the manifest's length and bytes (msgpack in a uint8 tensor), then one
flat uint8 buffer per bucket (its tensors pulled from the `WeightSource` just before),
then a flag: 1 when complete, 0 when the sender's weights failed or broke their specs
mid-version (the rest went as filler); 0 goes live nowhere. A receiver whose model does
not match the manifest still takes part in every broadcast (so the group stays in step)
and then raises.

Run for real: gloo on CPU (tests, `tidal bench weights`). NCCL and HCCL are written
against `torch.distributed.ProcessGroupNCCL` and torch_npu's `ProcessGroupHCCL` and were
not run on this project's machines.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

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
    plan_manifest,
    tensor_bytes,
    weight_source,
    wire_backend,
)

SOLO_BYTES = 1 << 20
"""Tensors this large are broadcast on their own, without packing (one copy fewer)."""


def _process_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # noqa: PLC0415 - only on NPU platforms

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise ValueError(f"no weight broadcast group for backend {backend!r}")


class _Group:
    """Rank `rank` of a standalone broadcast group rooted at rank 0."""

    def __init__(self, platform: Platform, *, rank: int, world_size: int, host: str, port: int, timeout_s: float) -> None:
        if world_size < 2:
            raise ValueError(f"a weight broadcast group needs the trainer and at least one receiver; world_size={world_size}")
        self.platform = platform
        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = platform.device(0) if wire_backend(platform.descriptor) != "gloo" else torch.device("cpu")
        platform.apply_comm_env()  # NCCL/HCCL defaults (ports, timeouts): a rollout actor joins no default group that would set them
        self.store: dist.TCPStore | None = dist.TCPStore(host, port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False)
        self.port = self.store.port
        self._pg: dist.ProcessGroup | None = None
        self._backend = wire_backend(platform.descriptor)
        self._world_size = world_size

    def join(self) -> None:
        """Build the process group (blocks until every rank joined); later calls do nothing."""
        if self.store is None:
            raise TransferError(f"rank {self.rank} of the weight broadcast group was closed: open a new sender or receiver")
        if self._pg is None:
            self._pg = _process_group(self._backend, self.store, self.rank, self._world_size, self.timeout)

    def broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        """Broadcast from rank 0, waiting up to `timeout` (default: the group's)."""
        self.join()
        assert self._pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timeout if timeout is not None else self.timeout
        self._pg.broadcast([tensor], opts).wait(opts.timeout)

    def close(self) -> None:
        """Leave the group: shut its backend down (NCCL and HCCL free their communicators)
        and drop it and the store, which closes this rank's connections (the other ranks'
        next broadcast fails at once). Idempotent. A broadcast in flight in another thread
        keeps what it uses until it ends (gloo: at its timeout)."""
        pg, self._pg, self.store = self._pg, None, None
        shutdown = getattr(pg, "shutdown", None)  # every torch backend has one; a vendor's may not
        if shutdown is not None:
            shutdown()


class CollectiveSender:
    """Trainer side (rank 0). `port` is what receivers connect to; `join()` then `send()`."""

    def __init__(self, platform: Platform, *, num_receivers: int, host: str = "127.0.0.1", port: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0) -> None:
        self._group = _Group(platform, rank=0, world_size=num_receivers + 1, host=host, port=port, timeout_s=timeout_s)
        self._bucket_bytes = bucket_bytes
        self.port = self._group.port

    def join(self) -> None:
        self._group.join()

    def abort(self) -> None:
        """Nothing to give up: a broadcast to a member that died fails by itself."""

    def close(self) -> None:
        """Leave the group (its receivers' next broadcast fails); idempotent."""
        self._group.close()

    def send(self, version: int, weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Broadcast `weights` as `version`, pulling each bucket's tensors just before it goes.

        When the source fails or a tensor is not its spec's, the remaining buckets are
        broadcast as filler (the receivers must make every call of the version) and the
        closing flag says abandoned, so nothing goes live; then this raises.

        Raises:
            TransferError: a broadcast failed, or a tensor did not match its spec (named).
        """
        g = self._group
        source = weight_source(weights)
        manifest = plan_manifest(version, source.specs(), bucket_bytes=self._bucket_bytes, solo_bytes=SOLO_BYTES)
        header = torch.frombuffer(bytearray(manifest.pack()), dtype=torch.uint8)
        failure: Exception | None = None
        try:
            with Puller(manifest, source) as puller:
                g.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=g.device))
                g.broadcast(header.to(g.device))
                for k in range(len(manifest.buckets)):
                    flat = None
                    if failure is None:
                        try:
                            parts = [tensor_bytes(t.to(g.device)) for t in puller.bucket(k)]
                            flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # a large tensor goes from its own memory
                            del parts
                        except Exception as e:  # noqa: BLE001 - raised below, after the group's calls
                            failure = e
                    if flat is None:
                        flat = torch.empty(manifest.bucket_nbytes(k), dtype=torch.uint8, device=g.device)
                    g.broadcast(flat)
                    del flat  # dropped before the next bucket is pulled
                if failure is None:
                    try:
                        puller.finish()
                    except TransferError as e:
                        failure = e
                g.broadcast(torch.tensor([int(failure is None)], dtype=torch.int64, device=g.device))
        except TransferError:
            raise
        except RuntimeError as e:
            raise TransferError(f"broadcast of version {version} failed: {e}") from e
        if failure is not None:
            if isinstance(failure, TransferError):
                raise failure
            raise TransferError(f"the weights of version {version} failed mid-transfer: {failure}; nothing went live") from failure
        return manifest


class CollectiveReceiver:
    """A rollout engine's side (rank >= 1)."""

    def __init__(
        self,
        platform: Platform,
        *,
        rank: int,
        num_receivers: int,
        host: str,
        port: int,
        expected: Mapping[str, TensorSpec] | None = None,
        timeout_s: float = 300.0,
        device: torch.device | None = None,
    ) -> None:
        """`device`: where the received tensors go (default the platform's device 0; the
        broadcast itself lands in buffers on the group's device, freed after `receive`)."""
        self._out_device = device if device is not None else platform.device(0)  # before the group: nothing to close if it fails
        self._expected = expected
        self._group = _Group(platform, rank=rank, world_size=num_receivers + 1, host=host, port=port, timeout_s=timeout_s)

    def join(self) -> None:
        self._group.join()

    def close(self) -> None:
        """Leave the group and close its connections (the trainer's next broadcast fails at
        once: build a new group); later `receive`s raise `TransferError`. Idempotent."""
        self._group.close()

    def receive(self, timeout_s: float | None = None, *, transfer_s: float | None = None) -> Weights:
        """The next version the trainer broadcasts.

        Waits up to `timeout_s` (default: the group's timeout) for the trainer to start
        it, which is as long as a train step between two versions can take; each later
        broadcast of the version, up to `transfer_s` (default: the group's timeout), what a
        version that started may take to arrive. A wait that times out leaves
        the group unusable (its members are out of step): build a new one. gloo honours
        the longer wait (tested); NCCL's and HCCL's watchdogs abort a collective after the
        group's timeout whatever the op's, so there build the group with a timeout as long
        as the longest gap between versions (not run here: no GPU or NPU).
        """
        g = self._group
        manifest: Manifest | None = None
        try:
            length = torch.zeros(1, dtype=torch.int64, device=g.device)
            g.broadcast(length, datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None)
            started = datetime.timedelta(seconds=transfer_s) if transfer_s is not None else None
            header = torch.empty(int(length.item()), dtype=torch.uint8, device=g.device)
            g.broadcast(header, started)
            manifest = Manifest.unpack(bytes(header.cpu().numpy()))
            buffers = []
            for k in range(len(manifest.buckets)):
                flat = torch.empty(manifest.bucket_nbytes(k), dtype=torch.uint8, device=g.device)
                g.broadcast(flat, started)
                buffers.append(flat)
            complete = torch.zeros(1, dtype=torch.int64, device=g.device)
            g.broadcast(complete, started)
        except RuntimeError as e:
            which = f"of version {manifest.version}" if manifest is not None else "(waiting for the next version)"
            raise TransferError(f"weight broadcast {which} failed: {e}; nothing went live") from e
        if int(complete.item()) != 1:
            raise TransferError(f"the trainer abandoned version {manifest.version} mid-transfer (its weights failed or broke their specs); nothing went live")
        manifest.check_against(self._expected)
        tensors = {}
        for k, bucket in enumerate(manifest.buckets):
            offset = 0
            for i in bucket:
                spec = manifest.specs[i]
                raw = buffers[k][offset : offset + spec.nbytes]
                if offset % spec.torch_dtype.itemsize:
                    raw = raw.clone()  # a dtype view needs an aligned offset
                tensors[spec.name] = from_bytes(raw, spec).to(self._out_device)
                offset += spec.nbytes
        return Weights(manifest.version, tensors)
