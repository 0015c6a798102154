"""`tidal bench weights`: weight transports against the raw channels under them.

A "model" of `size` bytes (float32 tensors of up to 4 MB, plus a few small ones) moves
from a sender process to a receiver process, which ends with every tensor as a tensor
of its own. Each system is timed from the sender's first call to the receiver holding
the complete, checked version (`time.perf_counter`, CLOCK_MONOTONIC on Linux, so it is
comparable across processes); the best of `repeats` transfers is reported.

- `host`: tidal's host transport (PUSH/PULL over TCP on 127.0.0.1, bucketed);
- `collective`: tidal's broadcast group (gloo here);
- `ipc`: tidal's shared-buffer transport;
- `ipc-placed`: the same, the sender's tensors kept in the shared buffer (`IpcSender.place`,
  as the torch train engine keeps a Ray trainer's weights): the sender copies nothing;
- baselines move the same tensors with no protocol at all (no manifest, headers, buckets
  or checks): `raw-zmq` (one zero-copy PUSH frame per tensor, copied by the receiver
  into a new tensor), `raw-gloo` (one `broadcast` per tensor into a new tensor, in a
  2-process gloo group), `raw-shm` (the sender copies every tensor into a shared file,
  the receiver copies each out: the least any shared-memory path can do).

Ratios: host / raw-zmq, collective / raw-gloo, ipc and ipc-placed / raw-shm. Target: >= 70%.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

SYSTEMS = ("host", "collective", "ipc", "ipc-placed", "raw-zmq", "raw-gloo", "raw-shm")
RATIOS = {"host": "raw-zmq", "collective": "raw-gloo", "ipc": "raw-shm", "ipc-placed": "raw-shm"}
TENSOR_BYTES = 4 << 20


def model_of(size: int) -> dict[str, torch.Tensor]:
    """Tensors totalling about `size` bytes: float32 pieces of up to 4 MB and two small ones."""
    out: dict[str, torch.Tensor] = {"norm.weight": torch.ones(1024), "head.bias": torch.zeros(1000)}
    left = max(size - 8096, 4)
    i = 0
    while left > 0:
        n = min(TENSOR_BYTES, left) // 4
        out[f"layers.{i}.weight"] = torch.full((max(n, 1),), float(i))
        left -= max(n, 1) * 4
        i += 1
    return out


def _spans(weights: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    out, offset = [], 0
    for t in weights.values():
        out.append((offset, offset + t.numel() * t.element_size()))
        offset = out[-1][1]
    return out


def _copy_out(data: Any, spec: Any) -> torch.Tensor:
    """A new tensor of `spec`'s (a `TensorSpec`) shape and dtype holding the bytes of `data`."""
    out = torch.empty(spec.shape, dtype=spec.torch_dtype)
    out.view(torch.uint8).numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out


def _receiver(system: str, size: int, repeats: int, ready: Any, done: Any) -> None:
    torch.set_num_threads(1)
    from tidal.hal.cpu import CpuPlatform  # noqa: PLC0415
    from tidal.hal.transfer import expected_specs  # noqa: PLC0415

    platform = CpuPlatform()
    expected = expected_specs(model_of(size).items())
    r: Any  # each system's receiver
    receive: Callable[[], Any]
    if system == "host":
        from tidal.hal.transfer.host import HostReceiver  # noqa: PLC0415

        r = HostReceiver(platform, expected=expected)
        ready.put(r.address)
        receive = lambda: r.receive(300)  # noqa: E731
    elif system in ("ipc", "ipc-placed"):
        from tidal.hal.transfer.ipc import IpcReceiver  # noqa: PLC0415

        r = IpcReceiver(platform, expected=expected)
        ready.put(r.address)
        receive = lambda: r.receive(300)  # noqa: E731
    elif system == "collective":
        from tidal.hal.transfer.collective import CollectiveReceiver  # noqa: PLC0415

        port = ready.get()
        r = CollectiveReceiver(platform, rank=1, num_receivers=1, host="127.0.0.1", port=port, expected=expected)
        r.join()
        receive = r.receive
    elif system == "raw-zmq":
        import zmq  # noqa: PLC0415

        sock: Any = zmq.Context.instance().socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        ready.put(f"tcp://127.0.0.1:{port}")
        specs = list(expected.values())  # known before the clock, as the host receiver's `expected`: nothing is built while timed
        receive = lambda: [_copy_out(sock.recv(copy=False).buffer, spec) for spec in specs]  # noqa: E731
    elif system == "raw-gloo":
        port = ready.get()
        import torch.distributed as dist  # noqa: PLC0415

        dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 2, is_master=False), rank=1, world_size=2)
        shapes = [t.shape for t in model_of(size).values()]
        receive = lambda: [dist.broadcast(torch.empty(s), src=0) for s in shapes]  # noqa: E731
    elif system == "raw-shm":
        path = ready.get()
        nbytes = sum(t.numel() * 4 for t in model_of(size).values())
        mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        spans = _spans(model_of(size))
        go = ready  # the sender puts a token per transfer once its copy is done
        receive = lambda: (go.get(), [mapped[a:b].view(torch.float32).clone() for a, b in spans])  # noqa: E731
    else:
        raise ValueError(system)
    for _ in range(repeats):
        receive()
        done.put(time.perf_counter())


def _sender(system: str, size: int, repeats: int, ready: Any, done: Any, out: Any) -> None:
    torch.set_num_threads(1)
    from tidal.hal.cpu import CpuPlatform  # noqa: PLC0415

    platform = CpuPlatform()
    weights = model_of(size)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    s: Any  # each system's sender
    send: Callable[[int], Any]
    if system in ("host", "ipc"):
        from tidal.hal.transfer.host import HostSender  # noqa: PLC0415
        from tidal.hal.transfer.ipc import IpcSender  # noqa: PLC0415

        s = HostSender(platform) if system == "host" else IpcSender(platform)
        s.connect(ready.get())
        send = lambda v: s.send(v, weights.items())  # noqa: E731
    elif system == "ipc-placed":
        from tidal.hal.transfer import TensorSpec  # noqa: PLC0415
        from tidal.hal.transfer.ipc import IpcSender  # noqa: PLC0415

        s = IpcSender(platform)
        s.connect(ready.get())
        views = s.place([TensorSpec.of(n, t) for n, t in weights.items()])
        for view, t in zip(views, weights.values()):
            view.copy_(t)  # once, before timing: from here on the weights live in the buffer
        placed = list(zip(weights, views))
        send = lambda v: s.send(v, placed)  # noqa: E731
    elif system == "collective":
        from tidal.hal.transfer.collective import CollectiveSender  # noqa: PLC0415

        s = CollectiveSender(platform, num_receivers=1)
        ready.put(s.port)
        s.join()
        send = lambda v: s.send(v, weights.items())  # noqa: E731
    elif system == "raw-zmq":
        import zmq  # noqa: PLC0415

        sock: Any = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(ready.get())
        send = lambda v: [sock.send(t.view(torch.uint8).numpy(), copy=False) for t in weights.values()]  # noqa: E731
    elif system == "raw-gloo":
        import torch.distributed as dist  # noqa: PLC0415

        rendezvous = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # port 0: the kernel picks, nothing probed
        ready.put(rendezvous.port)
        dist.init_process_group("gloo", store=rendezvous, rank=0, world_size=2)
        send = lambda v: [dist.broadcast(t, src=0) for t in weights.values()]  # noqa: E731
    elif system == "raw-shm":
        path = Path(tempfile.gettempdir() if not Path("/dev/shm").is_dir() else "/dev/shm") / f"tidal-bench-{os.getpid()}"
        path.touch()
        os.truncate(path, nbytes)
        mapped = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        ready.put(str(path))
        spans = _spans(weights)

        def send_shm(v: int) -> None:
            for (a, b), t in zip(spans, weights.values()):
                mapped[a:b].copy_(t.view(torch.uint8))
            ready.put(v)

        send = send_shm
    else:
        raise ValueError(system)
    times = []
    for v in range(repeats):
        start = time.perf_counter()
        send(v)
        times.append(done.get(timeout=600) - start)
    if system == "raw-shm":
        path.unlink(missing_ok=True)
    out.put(times)


def measure(system: str, size: int, repeats: int) -> list[float]:
    """Seconds per transfer of `size` bytes with `system`, one entry per repeat."""
    ctx = mp.get_context("spawn")
    ready, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(system, size, repeats, ready, done), daemon=True)
    sender = ctx.Process(target=_sender, args=(system, size, repeats, ready, done, out), daemon=True)
    receiver.start()
    sender.start()
    try:
        return _times(out, system, sender=sender, receiver=receiver)
    finally:
        for p in (sender, receiver):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _times(out: Any, system: str, *, sender: Any, receiver: Any, timeout_s: float = 900) -> list[float]:
    """The sender's times from `out`; raises, naming `system`, as soon as the sender or the
    receiver has exited with an error (without the times), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=0.1)
        except queue.Empty:
            for name, proc in (("sender", sender), ("receiver", receiver)):
                if proc.exitcode:
                    raise RuntimeError(f"{system}: the {name} process exited with code {proc.exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: no transfer finished in {timeout_s:.0f} s") from None


def run(*, sizes_mb: Sequence[int] = (4, 64, 256, 1024), systems: Sequence[str] = SYSTEMS, repeats: int = 3, progress: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """GB/s (best of `repeats`) per system and size: {system: {size_mb: GB/s}}."""
    results: dict[str, dict[str, float]] = {}
    for mb in sizes_mb:
        size = mb << 20
        for system in systems:
            progress(f"{system}: {mb} MB x {repeats}")
            best = min(measure(system, size, repeats))
            results.setdefault(system, {})[str(mb)] = size / best / 1e9
    return results


def table(results: dict[str, dict[str, float]]) -> list[list[str]]:
    sizes = list(next(iter(results.values())))
    rows = [["system", *(f"{s} MB GB/s" for s in sizes), *(f"{s} MB % raw" for s in sizes)]]
    for system, by_size in results.items():
        base = results.get(RATIOS.get(system, ""))
        ratios = [f"{by_size[s] / base[s]:.0%}" if base else "-" for s in sizes]
        rows.append([system, *(f"{by_size[s]:.2f}" for s in sizes), *ratios])
    return rows
