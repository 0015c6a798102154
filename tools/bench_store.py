"""`tidal bench store`: the store across processes against TransferQueue and raw ZeroMQ.

Every system moves the same rows between a producer process and a consumer process:

- small rows: 4096 rows x {input_ids int64[256], attention_mask int64[256],
  logprobs float32[256], reward float32[1]}, put in batches of 256 while the consumer
  gets batches of 256 as they become ready (and acks them);
- large rows: 64 rows of 1 MB, put and got in batches of 8;
- hand-off latency: a consumer already waits in `get`; the time from the producer's
  `put` call to that `get` returning the row (p50, p99).

Systems: `tidal` (a store server process holds metadata and data; on one host, large
buffers go through shared memory, see `flow/store/shm.py`), `tidal-socket` (the same with
shared memory off: every byte crosses the store's sockets), `tidal-embedded`
(the store and its server live in the producer's process: a put is a local call and
rows cross one process boundary, to the consumer), `tidal-split` (the controller in the
server process, the data on a storage unit inside the producer, read by the consumer
straight from it), `transferqueue` (0.1.11 on Ray, when the
`[bench]` extra is installed) and `raw-zmq` (the same frames PUSHed from producer to
consumer: the machine's limit for socket transfers). The tidal producers keep up to
`put_window` puts in flight (`RemoteStore.submit_put`; 1: each put waits for its reply,
as TransferQueue's does). Ratios are against TransferQueue and
raw ZeroMQ measured in the same run. `transport="ipc"` runs tidal and raw ZeroMQ over
Unix-domain sockets (`ipc://`, for same-machine deployments) instead of loopback TCP.
Before the clock starts, every system moves the whole workload once, untimed (sockets
open, code paths and allocator warm: a pipeline that has already done a step), as the
TransferQueue run does. Times use `time.perf_counter` (CLOCK_MONOTONIC on Linux, so
comparable across processes).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

SMALL = {"input_ids": ("int64", (256,)), "attention_mask": ("int64", (256,)), "logprobs": ("float32", (256,)), "reward": ("float32", (1,))}
LARGE = {"blob": ("uint8", (1 << 20,))}
LATENCY = {"logprobs": ("float32", (256,))}
SYSTEMS = ("tidal", "tidal-socket", "tidal-embedded", "tidal-split", "raw-zmq", "transferqueue")
PUT_WINDOW = 4
"""Puts a tidal producer keeps in flight by default (`submit_put`)."""
TRANSPORTS = ("tcp", "ipc")
_endpoints = itertools.count()


def endpoint(transport: str) -> str:
    """A fresh address to bind: loopback TCP on a free port, or a Unix-domain socket path
    (removed when this process exits: libzmq leaves the file when the socket closes)."""
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    if transport == "ipc":
        path = f"{tempfile.gettempdir()}/tidal-bench-{os.getpid()}-{next(_endpoints)}"
        atexit.register(_unlink, path)
        return f"ipc://{path}"
    raise ValueError(f"unknown transport {transport!r}; transports: {', '.join(TRANSPORTS)}")


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclasses.dataclass
class Workload:
    name: str
    fields: dict[str, tuple[str, tuple[int, ...]]]
    num_rows: int
    batch_size: int

    @property
    def row_bytes(self) -> int:
        return sum(torch.empty((), dtype=getattr(torch, d)).element_size() * int(torch.Size(s).numel()) for d, s in self.fields.values())

    def batches(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for start in range(0, self.num_rows, self.batch_size):
            n = min(self.batch_size, self.num_rows - start)
            out.append({k: torch.randint(0, 100, (n, *s)).to(getattr(torch, d)) for k, (d, s) in self.fields.items()})
        return out


# Store processes -------------------------------------------------------------------------
def _serve(ready: Any, stop: Any, transport: str = "tcp") -> None:
    from tidal.flow.store import Store
    from tidal.flow.store.memory import retain_freed_memory
    from tidal.flow.store.server import StoreServer

    retain_freed_memory()  # a store process, as the store actor sets itself up

    with StoreServer(Store(), address=endpoint(transport)) as server:
        ready.put(server.address)
        stop.wait()


def _tidal_producer(address: str, split: bool, work: Workload, go: Any, out: Any, unit_ready: Any, stop: Any, transport: str = "tcp", shm: bool = True, window: int = PUT_WINDOW) -> None:
    from tidal.flow.store import StorageUnit
    from tidal.flow.store.client import RemoteStore
    from tidal.flow.store.server import StoreServer

    unit = StoreServer(unit=StorageUnit(), address=endpoint(transport)) if split else None
    store = RemoteStore(address, unit=unit, shm=shm)
    batches = work.batches()
    unit_ready.put(True)
    _put_all(store, _warm(work), batches, window)  # the warm-up pass, drained by the consumer before it says go
    go.wait()
    start = time.perf_counter()
    _put_all(store, work.name, batches, window)
    out.put(("start", start))
    stop.wait()  # a split producer serves its unit until the consumer is done
    store.close()
    if unit is not None:
        unit.close()


def _put_all(store: Any, partition: str, batches: list[dict[str, torch.Tensor]], window: int) -> None:
    """Put every batch, with up to `window` puts in flight."""
    pending: collections.deque[Any] = collections.deque()
    for batch in batches:
        pending.append(store.submit_put(partition, batch, timeout=60))
        if len(pending) >= window:
            pending.popleft().result()
    for put in pending:
        put.result()


def _embedded_producer(work: Workload, ready: Any, go: Any, out: Any, stop: Any, transport: str = "tcp") -> None:
    from tidal.flow.store import Store
    from tidal.flow.store.server import StoreServer

    store = Store()
    for name in (_warm(work), work.name):
        store.create_partition(name, consumers=["c"])
    batches = work.batches()
    with StoreServer(store, address=endpoint(transport)) as server:
        ready.put(server.address)
        for batch in batches:  # the warm-up pass
            store.put(_warm(work), batch)
        go.wait()
        start = time.perf_counter()
        for batch in batches:
            store.put(work.name, batch)
        out.put(("start", start))
        stop.wait()


def embedded_throughput(work: Workload, transport: str = "tcp") -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    stop, go = ctx.Event(), ctx.Event()
    producer = ctx.Process(target=_embedded_producer, args=(work, ready, go, out, stop, transport), daemon=True)
    producer.start()
    consumer = ctx.Process(target=_tidal_consumer, args=(ready.get(timeout=60), work, go, out), daemon=True)
    try:
        consumer.start()
        times = dict(out.get(timeout=120) for _ in range(2))
    finally:
        stop.set()
        _reap(consumer, producer)
    return _rates(work, times["end"] - times["start"])


def embedded_latency(num_trials: int, transport: str = "tcp") -> list[float]:
    from tidal.flow.store import Store
    from tidal.flow.store.server import StoreServer

    ctx = mp.get_context("spawn")
    store = Store()
    store.create_partition("lat", consumers=["c"])
    with StoreServer(store, address=endpoint(transport)) as server:
        return _time_handoffs(ctx, server.address, store.put, num_trials)


def _tidal_consumer(address: str, work: Workload, go: Any, out: Any, shm: bool = True) -> None:
    from tidal.flow.store.client import RemoteStore

    store = RemoteStore(address, shm=shm)
    _drain(store, _warm(work), work)
    go.set()
    _drain(store, work.name, work)
    out.put(("end", time.perf_counter()))
    store.close()


def _drain(store: Any, partition: str, work: Workload) -> None:
    """Get every row of `partition` in batches as they become ready; each get acks the batch
    before it (one round trip per batch), the last ack is its own call."""
    columns = list(work.fields)
    received, previous = 0, []
    while received < work.num_rows:
        batch = store.get("c", partition, columns, work.batch_size, timeout=60, partial=True, ack=previous)
        received += len(batch)
        previous = batch.indexes
    store.ack("c", partition, previous)


def _warm(work: Workload) -> str:
    """The partition of a workload's untimed warm-up pass (TransferQueue gets the same)."""
    return f"{work.name}-warmup"


def tidal_throughput(work: Workload, *, split: bool, transport: str = "tcp", shm: bool = True, window: int = PUT_WINDOW) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready, out, unit_ready = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop, go = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_serve, args=(ready, stop, transport), daemon=True)
    server.start()
    address = ready.get(timeout=60)
    from tidal.flow.store.client import RemoteStore

    admin = RemoteStore(address)
    for name in (_warm(work), work.name):
        admin.create_partition(name, consumers=["c"])
    admin.close()
    producer = ctx.Process(target=_tidal_producer, args=(address, split, work, go, out, unit_ready, stop, transport, shm, window), daemon=True)
    consumer = ctx.Process(target=_tidal_consumer, args=(address, work, go, out, shm), daemon=True)
    producer.start()
    try:
        unit_ready.get(timeout=60)
        consumer.start()
        times = dict(out.get(timeout=120) for _ in range(2))
    finally:
        stop.set()
        _reap(consumer, producer, server)
    return _rates(work, times["end"] - times["start"])


def _reap(*procs: Any) -> None:
    """Join our child processes; terminate (by handle) any that do not exit."""
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)


def _tidal_latency_consumer(address: str, num_trials: int, waiting: Any, out: Any) -> None:
    from tidal.flow.store.client import RemoteStore

    store = RemoteStore(address)
    got = []
    for _ in range(num_trials + 1):
        waiting.set()
        batch = store.get("c", "lat", ["logprobs"], 1, timeout=60)
        got.append(time.perf_counter())
        store.ack("c", "lat", batch.indexes)
    out.put(got[1:])
    store.close()


def tidal_latency(num_trials: int, transport: str = "tcp") -> list[float]:
    from tidal.flow.store.client import RemoteStore

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(ready, stop, transport), daemon=True)
    server.start()
    address = ready.get(timeout=60)
    producer = RemoteStore(address)
    producer.create_partition("lat", consumers=["c"])
    try:
        return _time_handoffs(ctx, address, producer.put, num_trials)
    finally:
        producer.close()
        stop.set()
        server.join(timeout=30)


def _time_handoffs(ctx: Any, address: str, put: Callable[..., Any], num_trials: int) -> list[float]:
    """A consumer process waits in `get`; time each `put` call until that `get` returns."""
    out, waiting = ctx.Queue(), ctx.Event()
    consumer = ctx.Process(target=_tidal_latency_consumer, args=(address, num_trials, waiting, out), daemon=True)
    consumer.start()
    row = {"logprobs": torch.randn(1, 256)}
    sent = []
    for _ in range(num_trials + 1):
        waiting.wait(timeout=60)
        waiting.clear()
        time.sleep(0.005)  # let the get reach the server and park there
        sent.append(time.perf_counter())
        put("lat", row)
    got = out.get(timeout=120)
    consumer.join(timeout=30)
    return [g - s for g, s in zip(got, sent[1:])]


# Raw ZeroMQ: the same frames straight from producer to consumer ------------------------------
def _zmq_consumer(port_out: Any, num_messages: int, out: Any, transport: str = "tcp", warm: int = 0, warmed: Any = None) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    if transport == "tcp":
        port_out.put(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    else:
        sock.bind(endpoint(transport))
        port_out.put(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    for _ in range(warm):  # the warm-up pass, untimed
        _ = [memoryview(f) for f in sock.recv_multipart(copy=False)]
    if warmed is not None:
        warmed.set()
    times = []
    for _ in range(num_messages):
        frames = sock.recv_multipart(copy=False)
        times.append(time.perf_counter())
        _ = [memoryview(f) for f in frames]
    out.put(times)
    sock.close(linger=0)
    ctx.term()


def _zmq_connect(address: str) -> Any:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    return sock


def _frames(batch: dict[str, torch.Tensor]) -> list[Any]:
    from tidal.flow.store.codec import encode

    header, buffers = encode({"columns": batch})
    return [header, *buffers]


def zmq_throughput(work: Workload, transport: str = "tcp") -> dict[str, float]:
    ctx = mp.get_context("spawn")
    port_q, out, warmed = ctx.Queue(), ctx.Queue(), ctx.Event()
    batches = work.batches()
    consumer = ctx.Process(target=_zmq_consumer, args=(port_q, len(batches), out, transport, len(batches), warmed), daemon=True)
    consumer.start()
    sock = _zmq_connect(port_q.get(timeout=60))
    for batch in batches:  # the warm-up pass
        sock.send_multipart(_frames(batch), copy=False)
    warmed.wait(timeout=60)
    start = time.perf_counter()
    for batch in batches:
        sock.send_multipart(_frames(batch), copy=False)
    end = out.get(timeout=300)[-1]
    sock.close(linger=1000)
    consumer.join(timeout=30)
    return _rates(work, end - start)


def zmq_latency(num_trials: int, transport: str = "tcp") -> list[float]:
    ctx = mp.get_context("spawn")
    port_q, out = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_zmq_consumer, args=(port_q, num_trials + 1, out, transport), daemon=True)
    consumer.start()
    sock = _zmq_connect(port_q.get(timeout=60))
    row = {"logprobs": torch.randn(1, 256)}
    sent = []
    for _ in range(num_trials + 1):
        time.sleep(0.005)
        sent.append(time.perf_counter())
        sock.send_multipart(_frames(row), copy=False)
    got = out.get(timeout=120)
    sock.close(linger=1000)
    consumer.join(timeout=30)
    return [g - s for g, s in zip(got[1:], sent[1:])]


# Running and reporting ----------------------------------------------------------------------
def _rates(work: Workload, seconds: float) -> dict[str, float]:
    return {"seconds": seconds, "rows_per_s": work.num_rows / seconds, "mb_per_s": work.num_rows * work.row_bytes / seconds / 1e6}


def _percentiles(latencies: list[float]) -> dict[str, float]:
    """Median and 99th percentile (nearest rank: of 100 trials the 99th smallest) in ms."""
    ordered = sorted(latencies)
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": ordered[max(-(-99 * len(ordered) // 100) - 1, 0)] * 1e3}


def run(*, systems: tuple[str, ...] = SYSTEMS, num_trials: int = 100, repeats: int = 3, transport: str = "tcp", put_window: int = PUT_WINDOW, progress: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Measure every system; each throughput is the best of `repeats` runs. `transport`
    ("tcp" or "ipc") is what tidal and raw ZeroMQ run over (TransferQueue uses Ray's);
    `put_window` is how many puts a tidal producer keeps in flight."""
    if put_window < 1:
        raise ValueError(f"put_window must be >= 1, got {put_window}")
    endpoint(transport)  # fails early on an unknown transport
    small = Workload("small", SMALL, 4096, 256)
    large = Workload("large", LARGE, 64, 8)
    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        if system == "transferqueue":
            from tidal.tools import bench_tq

            if not bench_tq.available():
                progress("transferqueue: not installed (pip install -c constraints.txt -e '.[bench]'); skipped")
                continue
            throughput: Callable[[Workload], dict[str, float]] = lambda w: bench_tq.tq_throughput(num_rows=w.num_rows, fields=w.fields, batch_size=w.batch_size)  # noqa: E731
            latency: Callable[[int], list[float]] = lambda n: bench_tq.tq_latency(num_trials=n)  # noqa: E731
        elif system == "raw-zmq":
            throughput = lambda w: zmq_throughput(w, transport)  # noqa: E731
            latency = lambda n: zmq_latency(n, transport)  # noqa: E731
        elif system == "tidal-embedded":
            throughput = lambda w: embedded_throughput(w, transport)  # noqa: E731
            latency = lambda n: embedded_latency(n, transport)  # noqa: E731
        elif system in ("tidal", "tidal-socket", "tidal-split"):
            split, shm = system == "tidal-split", system != "tidal-socket"
            throughput = lambda w, split=split, shm=shm: tidal_throughput(w, split=split, transport=transport, shm=shm, window=put_window)  # noqa: E731
            latency = (lambda n: tidal_latency(n, transport)) if system == "tidal" else None  # type: ignore[assignment]  # one-row puts never use shared memory
        else:
            raise ValueError(f"unknown system {system!r}; systems: {', '.join(SYSTEMS)}")
        progress(f"{system}: small rows")
        entry: dict[str, Any] = {"small": max((throughput(small) for _ in range(repeats)), key=lambda r: r["rows_per_s"])}
        progress(f"{system}: 1 MB rows")
        entry["large"] = max((throughput(large) for _ in range(repeats)), key=lambda r: r["mb_per_s"])
        if latency is not None:
            progress(f"{system}: hand-off latency")
            entry["latency"] = _percentiles(latency(num_trials))
        results[system] = entry
    return results


def table(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Rows of the printed table, with ratios against TransferQueue and raw ZeroMQ."""
    tq, raw = results.get("transferqueue"), results.get("raw-zmq")
    rows = [["system", "small rows/s", "x TQ", "small MB/s", "1MB-row MB/s", "% raw", "x TQ", "hand-off p50 ms", "p99 ms"]]
    for system, r in results.items():
        lat = r.get("latency")
        rows.append([
            system,
            f"{r['small']['rows_per_s']:,.0f}",
            f"{r['small']['rows_per_s'] / tq['small']['rows_per_s']:.1f}" if tq else "-",
            f"{r['small']['mb_per_s']:,.0f}",
            f"{r['large']['mb_per_s']:,.0f}",
            f"{100 * r['large']['mb_per_s'] / raw['large']['mb_per_s']:.0f}%" if raw else "-",
            f"{r['large']['mb_per_s'] / tq['large']['mb_per_s']:.1f}" if tq else "-",
            f"{lat['p50_ms']:.2f}" if lat else "-",
            f"{lat['p99_ms']:.2f}" if lat else "-",
        ])
    return rows
