"""Weight transports: named tensors of one policy version, from a trainer to rollout engines.

Three transports, chosen from the two sides' `PlatformDescriptor`s (`choose_transport`)
and overridable in the recipe:

- `ipc`: same node and device kind: the receiver maps the sender's buffer (OS shared
  memory for host tensors, between any two processes of the node; the device's IPC
  handles for CUDA, colocated only) and copies once;
- `collective`: same collective backend (NCCL, HCCL, or gloo on CPU): a broadcast group
  of trainer + receivers, built once and reused;
- `host`: any pair, including NPU trainer -> GPU rollout: device -> pinned host buckets
  -> ZeroMQ/TCP -> device, with the next bucket's device-to-host copy overlapping the
  current bucket's send.

Every transfer carries a `Manifest` (version, and name / dtype / shape of every tensor).
A receiver returns a version only when every tensor of its manifest arrived with the
right size and, when it was given the model's own specs, the manifest matches them
exactly; a partial or failed transfer raises `TransferError` and never goes live.
Nothing on the wire is ever unpickled: headers are msgpack, tensors raw bytes.

Senders take a `WeightSource`: the specs first (the manifest goes ahead of the data),
then the tensors one at a time, pulled bucket by bucket, so a sender holds about one
bucket of them, never the whole model (an FSDP engine all-gathers a parameter per
pull). A plain iterable of (name, tensor) is still accepted (`weight_source` lists it).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgpack
import torch

from tidal.hal.platform import PlatformDescriptor

TRANSPORTS = ("ipc", "collective", "host")
DEFAULT_BUCKET_BYTES = 16 << 20
"""Bytes per bucket: large enough to stream at full speed, small enough that the receiver
copies bucket k while bucket k+1 is on the wire (much larger buckets were slower:
docs/benchmarks.md, `tidal bench weights`)."""

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)}


class TransferError(RuntimeError):
    """A weight transfer failed or arrived incomplete; the version did not go live."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    """torch dtype without the `torch.` prefix, e.g. `bfloat16`."""
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _DTYPES[self.dtype].itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        if not isinstance(tensor, torch.Tensor):
            raise TransferError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor: weight transports carry (name, tensor) pairs")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TransferError(f"tensor {name!r} has dtype {tensor.dtype}, which weight transports do not carry")
        return cls(name, dtype, tuple(tensor.shape))


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """What one version's transfer holds, sent ahead of its data."""

    version: int
    specs: tuple[TensorSpec, ...]
    buckets: tuple[tuple[int, ...], ...]
    """Indexes into `specs`, one tuple per bucket, in sending order."""

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def bucket_nbytes(self, k: int) -> int:
        return sum(self.specs[i].nbytes for i in self.buckets[k])

    def pack(self) -> bytes:
        return msgpack.packb({"version": self.version, "specs": [[s.name, s.dtype, list(s.shape)] for s in self.specs], "buckets": [list(b) for b in self.buckets]})

    @classmethod
    def unpack(cls, data: bytes) -> Manifest:
        try:
            raw = msgpack.unpackb(data)
            specs = tuple(TensorSpec(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in raw["specs"])
            buckets = tuple(tuple(int(i) for i in b) for b in raw["buckets"])
            manifest = cls(int(raw["version"]), specs, buckets)
        except Exception as e:  # noqa: BLE001 - any malformed header is the same error
            raise TransferError(f"malformed weight manifest: {e}") from None
        unknown = sorted({s.dtype for s in specs} - set(_DTYPES))
        if unknown:
            raise TransferError(f"weight manifest of version {manifest.version} names unknown dtypes {unknown}")
        if sorted(i for b in buckets for i in b) != list(range(len(specs))):
            raise TransferError(f"weight manifest of version {manifest.version}: buckets do not cover every tensor once")
        return manifest

    def check_against(self, expected: Mapping[str, TensorSpec] | None) -> None:
        """Raise `TransferError` unless the manifest holds exactly the `expected` tensors."""
        if expected is None:
            return
        got = {s.name: s for s in self.specs}
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(n for n in set(got) & set(expected) if (got[n].dtype, got[n].shape) != (expected[n].dtype, expected[n].shape))
        if missing or extra or wrong:
            parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {extra[:5]}" if extra else "",
                     "; ".join(f"{n}: got {got[n].dtype}{list(got[n].shape)}, model has {expected[n].dtype}{list(expected[n].shape)}" for n in wrong[:5])]
            raise TransferError(f"weights of version {self.version} do not match the model: " + "; ".join(p for p in parts if p))


def make_manifest(version: int, tensors: Sequence[tuple[str, torch.Tensor]], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, solo_bytes: int | None = None) -> Manifest:
    """Specs of `tensors` grouped, in order, into buckets of at most `bucket_bytes` (see `plan_manifest`)."""
    return plan_manifest(version, [TensorSpec.of(n, t) for n, t in tensors], bucket_bytes=bucket_bytes, solo_bytes=solo_bytes)


def plan_manifest(version: int, specs: Sequence[TensorSpec], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, solo_bytes: int | None = None) -> Manifest:
    """`specs` grouped, in order, into buckets of at most `bucket_bytes`.

    A tensor larger than `bucket_bytes`, or of at least `solo_bytes`, gets a bucket of its
    own (a transport can then send it from its own memory instead of packing it).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        repeated = sorted(n for n, k in collections.Counter(names).items() if k > 1)
        raise TransferError(f"weights of version {version} repeat tensor names {repeated[:5]}")
    specs = tuple(_checked(version, s) for s in specs)
    buckets: list[list[int]] = []
    size = 0
    solo = False
    for i, spec in enumerate(specs):
        alone = solo_bytes is not None and spec.nbytes >= solo_bytes
        if not buckets or size + spec.nbytes > bucket_bytes or alone or solo:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += spec.nbytes
        solo = alone
    return Manifest(version, specs, tuple(tuple(b) for b in buckets))


def _checked(version: int, spec: TensorSpec) -> TensorSpec:
    """`spec` with its shape as a tuple of ints (a list or torch.Size too), or `TransferError` naming it."""
    if spec.dtype not in _DTYPES:
        raise TransferError(
            f"version {version}: tensor {spec.name!r} has dtype {spec.dtype!r}, which weight transports do not carry "
            f"(a TensorSpec names one of {', '.join(_DTYPES)}, without the torch. prefix)"
        )
    try:
        shape = tuple(int(s) for s in spec.shape)
    except (TypeError, ValueError):
        shape = (-1,)
    if min(shape, default=0) < 0:
        raise TransferError(f"version {version}: tensor {spec.name!r} has shape {spec.shape!r}, not a sequence of sizes >= 0")
    return spec if type(spec.shape) is tuple and all(type(s) is int for s in spec.shape) else TensorSpec(spec.name, spec.dtype, shape)


@runtime_checkable
class WeightSource(Protocol):
    """One version's weights as a sender pulls them: every spec first, then the tensors lazily.

    `specs()` must not materialise tensors (a sharded engine reads global shapes). Each
    `tensors()` call starts a new pass that yields exactly the specs' tensors, in order;
    a version is sent again after a receiver restarts, so a source must allow several
    passes. A sender may stop a pass early (it closes the iterator: a source whose pass
    is a collective finishes it then, so its ranks stay in step). Iterating a source is
    a pass too, so it works wherever (name, tensor) pairs are expected.
    """

    def specs(self) -> list[TensorSpec]: ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class LazyWeights:
    """A `WeightSource` from two functions: the specs, and a new pass over the tensors."""

    def __init__(self, specs: Callable[[], Sequence[TensorSpec]], tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self._specs, self._tensors = specs, tensors

    def specs(self) -> list[TensorSpec]:
        return list(self._specs())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._tensors()


SNAPSHOT_BATCH_BYTES = 1 << 30
"""`snapshot` copies the tensors it has taken each time they add up to this many bytes."""


def snapshot(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """A copy of every tensor (detached), as views into new buffers, one per dtype and device
    for each `SNAPSHOT_BATCH_BYTES` of tensors, each filled by one copy op: a clone per tensor
    would give up the GIL once per tensor, and a trainer publishing weights would wait for the
    threads its publish just woke. Copying batch by batch as the tensors come keeps what a
    source makes as it is taken (a LoRA engine's merged weights) to one batch beside the copy."""
    out: list[tuple[str, torch.Tensor]] = []
    pending: list[int] = []  # indices into `out` still holding the source's tensors
    size = 0

    def copy_pending() -> None:
        kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in pending:
            kinds.setdefault((out[i][1].dtype, out[i][1].device), []).append(i)
        for (dtype, device), members in kinds.items():
            flat = torch.empty(sum(out[i][1].numel() for i in members), dtype=dtype, device=device)
            views, offset = [], 0
            for i in members:
                views.append(flat[offset : offset + out[i][1].numel()].view(out[i][1].shape))
                offset += out[i][1].numel()
            torch._foreach_copy_(views, [out[i][1] for i in members])
            for i, view in zip(members, views):
                out[i] = (out[i][0], view)
        pending.clear()

    for name, tensor in weights:
        out.append((name, tensor.detach()))
        pending.append(len(out) - 1)
        size += tensor.numel() * tensor.element_size()
        if size >= SNAPSHOT_BATCH_BYTES:
            copy_pending()
            size = 0
    copy_pending()
    return out


def weight_source(weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> WeightSource:
    """`weights` as a `WeightSource`: a source as it is; anything else listed here (detached),
    so its tensors stay alive until the source goes (the old behaviour: one full copy when
    the iterable made them)."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Mapping):  # its iteration gives names only, each unpacked as a pair below
        raise TransferError(f"weights are (name, tensor) pairs, got a {type(weights).__name__}: pass its .items()")
    pairs = list(weights)
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TransferError(f"weights are (name, tensor) pairs, got {type(pair).__name__} {str(pair)[:80]}")
    specs = [TensorSpec.of(n, t) for n, t in pairs]  # first: each must be a tensor, named if not
    listed = [(n, t.detach()) for n, t in pairs]
    return LazyWeights(lambda: specs, lambda: iter(listed))


class Puller:
    """A sender's pass over a source: tensors in the manifest's order, each checked against its spec.

    Use as a context manager: leaving it closes the pass (a source that is a collective
    finishes its pass then).
    """

    def __init__(self, manifest: Manifest, source: WeightSource) -> None:
        self._manifest = manifest
        self._source = source
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None
        self.num_pulled = 0

    def __enter__(self) -> Puller:
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self._it, "close", None)
        self._it = None
        if close is not None:
            close()

    def pull(self) -> torch.Tensor:
        """The next tensor (detached). Raises `TransferError` naming it when it is not its spec's."""
        m, i = self._manifest, self.num_pulled
        if i >= len(m.specs):
            raise TransferError(f"version {m.version}: pulled past the last of {len(m.specs)} tensors")
        if self._it is None:
            self._it = iter(self._source.tensors())
        spec = m.specs[i]
        try:
            name, tensor = next(self._it)
        except StopIteration:
            raise TransferError(f"version {m.version}: the weights ended after {i} of {len(m.specs)} tensors, before {spec.name!r}; nothing went live") from None
        got = (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        if got != (spec.name, spec.dtype, spec.shape):
            raise TransferError(
                f"version {m.version}: tensor {i} is {name!r} {got[1]}{list(got[2])} but the manifest says {spec.name!r} "
                f"{spec.dtype}{list(spec.shape)}; nothing went live"
            )
        self.num_pulled += 1
        return tensor.detach()

    def bucket(self, k: int) -> list[torch.Tensor]:
        """Bucket `k`'s tensors (buckets are pulled in order)."""
        indexes = self._manifest.buckets[k]
        assert not indexes or indexes[0] == self.num_pulled, "buckets are pulled in order"
        return [self.pull() for _ in indexes]

    def finish(self) -> None:
        """Raise `TransferError` unless every spec's tensor was pulled and the source has no more."""
        m = self._manifest
        if self.num_pulled != len(m.specs):
            raise TransferError(f"version {m.version}: {self.num_pulled} of {len(m.specs)} tensors were sent")
        if self._it is None:
            self._it = iter(self._source.tensors())
        extra = next(self._it, None)
        if extra is not None:
            raise TransferError(f"version {m.version}: the weights hold more tensors than their {len(m.specs)} specs (next: {extra[0]!r}); nothing went live")


def expected_specs(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, TensorSpec]:
    """The specs a receiver checks incoming versions against (its model's own tensors)."""
    return {n: TensorSpec.of(n, t) for n, t in named_tensors}


@dataclasses.dataclass(frozen=True)
class Weights:
    """A complete, checked version: what a rollout engine's `load_weights` receives."""

    version: int
    tensors: dict[str, torch.Tensor]


@runtime_checkable
class WaitsForVersions(Protocol):
    """A receiver that waits for the next version to start apart from receiving it.

    The two waits differ: the trainer may start the next version a long step, an evaluation
    or a checkpoint later, so the first has no useful bound of the transport's own; a
    version that started should arrive in a time its size sets. `ipc` waits so (its
    announcement is the start; the copy out of the shared buffer is local) and so does
    `host` (a version's first message is its start); `collective` takes both timeouts in
    one `receive` (a broadcast that timed out leaves its group out of step, so it cannot
    wait in short slices).
    """

    def wait(self, timeout_s: float) -> bool:
        """True once the next version has started arriving (`receive` then takes it at once);
        False if none started within `timeout_s`. Nothing is consumed."""
        ...

    def receive(self, timeout_s: float) -> Weights: ...


@runtime_checkable
class WeightSender(Protocol):
    """The trainer's side of a transport: sends versions of the weights to its receivers.

    `host` and `ipc` senders reach receivers by address (`connect` / `disconnect`);
    `collective` ones form a group with them (`join`). A version either reaches every
    receiver whole (checked against its manifest) or raises `TransferError`."""

    def send(self, version: int, weights: WeightSource | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Send `weights` as `version`; returns the manifest it sent under."""
        ...

    def abort(self) -> None:
        """Give up a send blocked on a receiver that died (it raises `TransferError`)."""
        ...

    def close(self) -> None:
        """Release sockets, buffers and groups; idempotent."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """A rollout engine's side of a transport: receives whole, checked versions."""

    def receive(self, timeout_s: float) -> Weights:
        """The next version; `TransferError` if none arrived in `timeout_s` or it failed its checks."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class PlacesWeights(Protocol):
    """A sender whose own buffer the trainer's weights can live in (`ipc`'s shared buffer):
    a send then copies nothing in the trainer's process."""

    def place(self, specs: Sequence[TensorSpec], ties: Mapping[str, str] | None = None, device: torch.device | None = None) -> list[torch.Tensor]:
        """Tensors in the buffer, one per spec (a tied name shares its twin's), for the trainer to keep its weights in."""
        ...


@runtime_checkable
class JoinsGroup(Protocol):
    """A sender or receiver that must join its group (every member at once) before the first version."""

    def join(self) -> None: ...


def _transport_classes(name: str) -> tuple[type, type]:
    """(sender class, receiver class) of transport `name`, imported when asked for."""
    import importlib  # noqa: PLC0415

    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; transports: {', '.join(TRANSPORTS)}")
    module_name, sender, receiver = _TRANSPORT_CLASSES[name]
    module = importlib.import_module(module_name)
    return getattr(module, sender), getattr(module, receiver)


_TRANSPORT_CLASSES = {
    "ipc": ("tidal.hal.transfer.ipc", "IpcSender", "IpcReceiver"),
    "collective": ("tidal.hal.transfer.collective", "CollectiveSender", "CollectiveReceiver"),
    "host": ("tidal.hal.transfer.host", "HostSender", "HostReceiver"),
}
"""The transport registry: each of `TRANSPORTS` -> (module, sender class, receiver class)."""


def sender_class(name: str) -> type:
    """The `WeightSender` class of transport `name` (ValueError naming the known ones)."""
    return _transport_classes(name)[0]


def receiver_class(name: str) -> type:
    """The `WeightReceiver` class of transport `name` (ValueError naming the known ones)."""
    return _transport_classes(name)[1]


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """View a flat uint8 tensor as `spec`'s dtype and shape (no copy)."""
    return buffer.view(_DTYPES[spec.dtype]).reshape(spec.shape)


def choose_transport(
    sender: PlatformDescriptor, receiver: PlatformDescriptor, *, same_node: bool, colocated: bool, override: str | None = None, torch_builds: tuple[str, str] | None = None
) -> str:
    """The transport between a trainer on `sender` and a rollout on `receiver`.

    ipc on one node with the same device kind, when the kind supports it: host memory
    (cpu) is shared by every process of a node, device memory (cuda) only when the two
    are colocated; else collective when both use the same collective backend, else host.
    `torch_builds` (the sender's and the receiver's `torch.__version__`): two different
    builds (a vLLM or vllm-ascend environment pins its own torch) share neither device
    memory handles nor a collective library's wire format with certainty, so only host
    crosses between them. An `override` that cannot work for this pair is a ValueError that says why.
    """
    same_torch = torch_builds is None or torch_builds[0] == torch_builds[1]
    same_backend = sender.dist_backend == receiver.dist_backend and same_torch  # a fake platform decides as its kind would
    shareable = sender.kind == "cpu" or (colocated and (sender.fake or sender.kind == "cuda"))  # fake devices hold CPU tensors, but place as their kind would
    ipc_ok = same_node and sender.kind == receiver.kind and shareable and same_torch
    if override is None or override == "auto":
        return "ipc" if ipc_ok else "collective" if same_backend else "host"
    if override not in TRANSPORTS:
        raise ValueError(f"transport={override!r} is not one of auto, {', '.join(TRANSPORTS)}")
    if override in ("ipc", "collective") and torch_builds is not None and not same_torch:
        raise ValueError(f"transport={override} needs one torch build on both sides; here: torch {torch_builds[0]} -> {torch_builds[1]} (use host, or set transport.name=auto)")
    if override == "ipc" and not ipc_ok:
        raise ValueError(
            f"transport=ipc needs trainer and rollout on one node with the same device kind: cpu, or cuda "
            f"devices they are colocated on; here: {sender.kind} -> {receiver.kind}, colocated={colocated}, same_node={same_node} "
            f"(set transport.name=auto to let tidal choose)"
        )
    if override == "collective" and not same_backend:
        raise ValueError(f"transport=collective needs one collective backend on both sides; here: {sender.dist_backend} -> {receiver.dist_backend} (use host)")
    return override


def wire_backend(d: PlatformDescriptor) -> str:
    """The collective backend that actually runs: gloo for CPU tensors (cpu and fake platforms)."""
    return "gloo" if d.fake or d.kind == "cpu" else d.dist_backend


def pack_header(**fields: Any) -> bytes:
    return msgpack.packb(fields)


def unpack_header(data: bytes) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(data)
    except Exception as e:  # noqa: BLE001
        raise TransferError(f"malformed transfer header: {e}") from None
    if not isinstance(header, dict) or "kind" not in header:
        raise TransferError("malformed transfer header: not a mapping with a kind")
    return header
