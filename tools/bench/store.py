"""`tidal bench store`: the store across processes, as a user runs it, against TransferQueue and raw ZeroMQ.

Every system moves the same rows between a producer process and a consumer process:

- small rows: 4096 rows x {input_ids int64[256], attention_mask int64[256],
  logprobs float32[256], reward float32[1]}, put and got in batches of 64, and again in
  batches of 256;
- large rows: 64 rows of 1 MB, put and got in batches of 8;
- trickle: 1024 small rows put one at a time while the consumer gets batches of 256, as
  rollouts finish one response at a time while the trainer waits for a batch;
- hand-off latency: a consumer already waits in `get`; the time from the producer's
  `put` call to that `get` returning the row (p50, p99), `IDLE_S` idle before each put,
  and how long the `put` call itself took.

The consumer reads every page of the data it gets (one byte of each 4 KiB page: what
faults a page of shared memory in) and the raw-ZeroMQ consumer reads its frames the same
way. Each throughput figure is the median of `repeats` runs, reported with the slowest
and fastest; the first run counts like the others (no warm-up pass: only process start
and connecting are off the clock). Each system's runs share its processes, so runs after
the first find them warm, as a pipeline that has done a step does.

Systems, the first being the path a user gets from the docs:

- `tidal`: `StoreServer(Store())` in its own process, as a user's script starts it (no
  allocator tuning; `tidal store serve` also leaves its start-up objects out of garbage
  collections, `memory.freeze_startup_objects`); the producer's `put` waits for each reply; the consumer calls
  `get`, reads the data, then `ack`. On one host large buffers go through shared memory.
- `tidal-tuned` (labelled as such): the same with the tunings an expert may add - up to
  `put_window` puts in flight (`submit_put`), `get(partial=True, ack=previous)` (one round
  trip per batch) and a server that keeps freed memory (`memory.retain_freed_memory`, as
  the Ray store actor does).
- `tidal-socket`: `tidal` with shared memory off (every byte over the sockets).
- `tidal-embedded`: the store and its server in the producer's process (`runtime: ray`).
- `tidal-split`: the controller in its own process, the data on a storage unit inside
  the producer, read by the consumer straight from it.
- `raw-zmq`: each batch's tensor buffers PUSHed as frames to a PULL socket (no header, no
  codec: the machine's limit for moving them over a socket).
- `transferqueue`: 0.1.11 on Ray, when the `[bench]` extra is installed (`bench.tq`, which
  gives it an untimed warm-up pass).

`transport="ipc"` runs tidal and raw ZeroMQ over Unix-domain sockets instead of loopback
TCP. Times use `time.perf_counter` (CLOCK_MONOTONIC on Linux, comparable across processes).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import itertools
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tidal.flow.store import PutResult, StoreApi

Fields = dict[str, tuple[str, tuple[int, ...]]]
"""Column name -> (torch dtype name, shape of one row's cell)."""
SMALL: Fields = {"input_ids": ("int64", (256,)), "attention_mask": ("int64", (256,)), "logprobs": ("float32", (256,)), "reward": ("float32", (1,))}
LARGE: Fields = {"blob": ("uint8", (1 << 20,))}
LATENCY: Fields = {"logprobs": ("float32", (256,))}
SYSTEMS = ("tidal", "tidal-tuned", "tidal-socket", "tidal-embedded", "tidal-split", "raw-zmq", "transferqueue")
SMALL_BATCHES = (64, 256)
PUT_WINDOW = 4
"""Puts `tidal-tuned` keeps in flight by default (`submit_put`)."""
IDLE_S = 0.010
"""Idle time before each hand-off's put (a consumer that waits for a while)."""
PAGE = 4096
TRANSPORTS = ("tcp", "ipc")
_endpoints = itertools.count()


@dataclasses.dataclass(frozen=True)
class Path:
    """How a tidal system is run."""

    window: int = 1
    """Puts in flight; 1: each put waits for its reply."""
    pipelined: bool = False
    """get(partial=True, ack=previous) instead of get, then ack."""
    retain: bool = False
    """The server process keeps freed memory (`retain_freed_memory`)."""
    shm: bool = True
    split: bool = False
    embedded: bool = False


PATHS = {
    "tidal": Path(),
    "tidal-tuned": Path(window=PUT_WINDOW, pipelined=True, retain=True),
    "tidal-socket": Path(shm=False),
    "tidal-embedded": Path(embedded=True),
    "tidal-split": Path(split=True),
}


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
    put_size: int | None = None
    """Rows a put holds; None: `batch_size`, as a get takes."""

    @property
    def row_bytes(self) -> int:
        return sum(torch.empty((), dtype=getattr(torch, d)).element_size() * int(torch.Size(s).numel()) for d, s in self.fields.values())

    def batches(self) -> list[dict[str, torch.Tensor]]:
        out, size = [], self.put_size or self.batch_size
        for start in range(0, self.num_rows, size):
            n = min(size, self.num_rows - start)
            out.append({k: torch.randint(0, 100, (n, *s)).to(getattr(torch, d)) for k, (d, s) in self.fields.items()})
        return out


TRICKLE = Workload("trickle", SMALL, 1024, 256, put_size=1)
"""One-row puts, gets of 256 (rollouts finishing one by one, a trainer waiting for a batch)."""


def read_pages(data: Any) -> int:
    """Read one byte of every page of `data` (a tensor or a buffer), as a consumer that uses
    its rows does: a page of a shared-memory mapping is faulted in on first touch."""
    if isinstance(data, torch.Tensor):
        flat = data.contiguous().reshape(-1).view(torch.uint8)
        return int(flat[::PAGE].sum()) if flat.numel() else 0
    import numpy as np

    array = np.frombuffer(data, dtype=np.uint8)
    return int(array[::PAGE].sum()) if array.size else 0


# tidal --------------------------------------------------------------------------------------
def _serve(ready: Any, stop: Any, transport: str, retain: bool) -> None:
    from tidal.flow.store import Store
    from tidal.flow.store.server import StoreServer

    if retain:
        from tidal.flow.store.memory import retain_freed_memory

        retain_freed_memory()
    with StoreServer(Store(), address=endpoint(transport)) as server:
        ready.put(server.address)
        stop.wait()


def _producer(address: str | None, work: Workload, path: Path, transport: str, go: Any, out: Any, stop: Any) -> None:
    """Put the workload into each partition `go` names (None ends), timing from the first put.
    Embedded: the store and its server live here, and `address` is None."""
    from tidal.flow.store import RemoteStore, StorageUnit, Store, StoreServer

    unit = StoreServer(unit=StorageUnit(), address=endpoint(transport)) if path.split else None
    if path.embedded:
        embedded = Store()
        server = StoreServer(embedded, address=endpoint(transport))
        out.put(("address", server.address))
        store: StoreApi = embedded
    else:
        assert address is not None  # a store process's, or the embedded one's
        remote = RemoteStore(address, unit=unit, shm=path.shm)
        remote.ping()
        store = remote
    batches = work.batches()
    out.put(("ready", None))
    while (partition := go.get()) is not None:
        start = time.perf_counter()
        _put_all(store, partition, batches, path.window)
        out.put(("start", start))
    stop.wait()  # a split producer serves its unit, an embedded one its store, until the consumer is done
    for closing in (store, unit, server if path.embedded else None):
        if closing is not None:
            closing.close()


def _put_all(store: StoreApi, partition: str, batches: list[dict[str, torch.Tensor]], window: int) -> None:
    """Put every batch; with `window` > 1, up to that many in flight."""
    if window == 1:
        for batch in batches:
            store.put(partition, batch, timeout=60)
        return
    pending: collections.deque[PutResult] = collections.deque()
    for batch in batches:
        pending.append(store.submit_put(partition, batch, timeout=60))
        if len(pending) >= window:
            pending.popleft().result()
    for put in pending:
        put.result()


def _consumer(address: str, work: Workload, path: Path, go: Any, out: Any) -> None:
    from tidal.flow.store import RemoteStore

    store = RemoteStore(address, shm=path.shm)
    store.ping()
    out.put(("ready", None))
    while (partition := go.get()) is not None:
        _drain(store, partition, work, path.pipelined)
        out.put(("end", time.perf_counter()))
    store.close()


def _drain(store: StoreApi, partition: str, work: Workload, pipelined: bool) -> None:
    """Get every row of `partition` in batches, reading each batch's pages, and ack them:
    get then ack, or (pipelined) each get acking the batch before it."""
    columns = list(work.fields)
    received = 0
    previous: Any = []
    while received < work.num_rows:
        if pipelined:
            batch = store.get("c", partition, columns, work.batch_size, timeout=60, partial=True, ack=previous)
        else:
            batch = store.get("c", partition, columns, min(work.batch_size, work.num_rows - received), timeout=60)
        for column in columns:
            read_pages(batch.stack(column))
        if not pipelined:
            store.ack("c", partition, batch.indexes)
        received += len(batch)
        previous = batch.indexes
    if pipelined:
        store.ack("c", partition, previous)


def tidal_runs(work: Workload, path: Path, *, repeats: int = 1, transport: str = "tcp") -> list[float]:
    """Seconds each of `repeats` runs of `work` took along `path`."""
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    to_producer, to_consumer = ctx.Queue(), ctx.Queue()
    procs = []
    address = None
    try:
        if not path.embedded:
            procs.append(ctx.Process(target=_serve, args=(ready, stop, transport, path.retain), daemon=True))
            procs[-1].start()
            address = ready.get(timeout=60)
        procs.append(ctx.Process(target=_producer, args=(address, work, path, transport, to_producer, out, stop), daemon=True))
        procs[-1].start()
        if path.embedded:
            address = _expect(out, "address")
        _expect(out, "ready")
        from tidal.flow.store import RemoteStore

        assert address is not None
        with RemoteStore(address) as admin:
            for r in range(repeats):
                admin.create_partition(f"{work.name}-{r}", consumers=["c"])
        procs.append(ctx.Process(target=_consumer, args=(address, work, path, to_consumer, out), daemon=True))
        procs[-1].start()
        _expect(out, "ready")
        seconds = []
        for r in range(repeats):
            to_consumer.put(f"{work.name}-{r}")
            to_producer.put(f"{work.name}-{r}")
            times = dict(out.get(timeout=300) for _ in range(2))
            seconds.append(times["end"] - times["start"])
        return seconds
    finally:
        to_consumer.put(None)
        to_producer.put(None)
        stop.set()
        _reap(*procs)


def tidal_throughput(work: Workload, *, split: bool = False, transport: str = "tcp", shm: bool = True, window: int = 1) -> dict[str, float]:
    """One run of `work` through a store process (`split`: data on the producer's unit)."""
    return _rates(work, tidal_runs(work, Path(window=window, shm=shm, split=split), transport=transport)[0])


def embedded_throughput(work: Workload, transport: str = "tcp") -> dict[str, float]:
    """One run of `work` through a store in the producer's process."""
    return _rates(work, tidal_runs(work, PATHS["tidal-embedded"], transport=transport)[0])


def _expect(out: Any, what: str) -> Any:
    kind, value = out.get(timeout=120)
    assert kind == what, f"expected {what!r} from a bench process, got {kind!r}"
    return value


def _reap(*procs: Any) -> None:
    """Join our child processes; terminate (by handle) any that do not exit."""
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)


def _latency_consumer(address: str, num_trials: int, waiting: Any, out: Any) -> None:
    from tidal.flow.store.client import RemoteStore

    store = RemoteStore(address)
    store.ping()
    got = []
    for _ in range(num_trials):
        waiting.set()
        batch = store.get("c", "lat", ["logprobs"], 1, timeout=60)
        got.append(time.perf_counter())
        read_pages(batch.stack("logprobs"))
        store.ack("c", "lat", batch.indexes)
    out.put(got)
    store.close()


def tidal_latency(num_trials: int, transport: str = "tcp", *, embedded: bool = False) -> dict[str, list[float]]:
    """Hand-offs through a store process (or one in this, the producer's, process)."""
    from tidal.flow.store import RemoteStore, Store, StoreServer

    ctx = mp.get_context("spawn")
    if embedded:
        store = Store()
        store.create_partition("lat", consumers=["c"])
        with StoreServer(store, address=endpoint(transport)) as server:
            return _time_handoffs(ctx, server.address, store.put, num_trials)
    ready, stop = ctx.Queue(), ctx.Event()
    server_proc = ctx.Process(target=_serve, args=(ready, stop, transport, False), daemon=True)
    server_proc.start()
    address = ready.get(timeout=60)
    producer = RemoteStore(address)
    try:
        producer.create_partition("lat", consumers=["c"])
        return _time_handoffs(ctx, address, producer.put, num_trials)
    finally:
        producer.close()
        stop.set()
        _reap(server_proc)


def _time_handoffs(ctx: Any, address: str, put: Callable[..., Any], num_trials: int) -> dict[str, list[float]]:
    """A consumer process waits in `get`; time each `put` call until that `get` returns, and
    until the put itself returns."""
    out, waiting = ctx.Queue(), ctx.Event()
    consumer = ctx.Process(target=_latency_consumer, args=(address, num_trials, waiting, out), daemon=True)
    consumer.start()
    row = {"logprobs": torch.randn(1, 256)}
    sent, put_s = [], []
    for _ in range(num_trials):
        waiting.wait(timeout=60)
        waiting.clear()
        time.sleep(IDLE_S)  # the get reaches the server and parks there; then everyone idles
        sent.append(time.perf_counter())
        put("lat", row)
        put_s.append(time.perf_counter() - sent[-1])
    got = out.get(timeout=120)
    consumer.join(timeout=30)
    return {"handoff": [g - s for g, s in zip(got, sent)], "put": put_s}


# Raw ZeroMQ: the same buffers straight from producer to consumer -----------------------------
def _zmq_consumer(port_out: Any, work: Workload | None, num_messages: int, go: Any, out: Any, transport: str = "tcp") -> None:
    """Per `go` (None ends): receive `num_messages`, read their pages, say when the last came."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    if transport == "tcp":
        port_out.put(f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}")
    else:
        sock.bind(endpoint(transport))
        port_out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while go.get() is not None:
        times = []
        for _ in range(num_messages):
            frames = sock.recv_multipart(copy=False)
            times.append(time.perf_counter())
            for frame in frames:
                read_pages(frame.buffer)
        out.put(times)
    sock.close(linger=0)
    ctx.term()


def _zmq_connect(address: str) -> Any:
    import zmq

    sock: Any = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(address)
    return sock


def raw_frames(batch: dict[str, torch.Tensor]) -> list[Any]:
    """A batch as raw ZeroMQ frames: each tensor's buffer, zero-copy, nothing else."""
    return [t.numpy() for t in batch.values()]


def zmq_runs(work: Workload, *, repeats: int = 1, transport: str = "tcp") -> list[float]:
    ctx = mp.get_context("spawn")
    port_q, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
    batches = work.batches()
    consumer = ctx.Process(target=_zmq_consumer, args=(port_q, work, len(batches), go, out, transport), daemon=True)
    consumer.start()
    sock = _zmq_connect(port_q.get(timeout=60))
    seconds = []
    try:
        for _ in range(repeats):
            go.put(True)
            time.sleep(0.05)  # the consumer is back in recv
            start = time.perf_counter()
            for batch in batches:
                sock.send_multipart(raw_frames(batch), copy=False)
            seconds.append(out.get(timeout=300)[-1] - start)
    finally:
        go.put(None)
        sock.close(linger=1000)
        _reap(consumer)
    return seconds


def zmq_latency(num_trials: int, transport: str = "tcp") -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    port_q, out, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_zmq_consumer, args=(port_q, None, num_trials, go, out, transport), daemon=True)
    consumer.start()
    sock = _zmq_connect(port_q.get(timeout=60))
    go.put(True)
    row = raw_frames({"logprobs": torch.randn(1, 256)})
    sent = []
    try:
        for _ in range(num_trials):
            time.sleep(IDLE_S)
            sent.append(time.perf_counter())
            sock.send_multipart(row, copy=False)
        got = out.get(timeout=120)
    finally:
        go.put(None)
        sock.close(linger=1000)
        _reap(consumer)
    return {"handoff": [g - s for g, s in zip(got, sent)]}


# Running and reporting ----------------------------------------------------------------------
def _rates(work: Workload, seconds: float) -> dict[str, float]:
    return {"seconds": seconds, "rows_per_s": work.num_rows / seconds, "mb_per_s": work.num_rows * work.row_bytes / seconds / 1e6}


def summary(work: Workload, seconds: list[float]) -> dict[str, Any]:
    """The median run's rates, the slowest and fastest, and every run's."""
    runs = [_rates(work, s) for s in seconds]
    ordered = sorted(runs, key=lambda r: r["seconds"])
    median = {key: statistics.median(r[key] for r in runs) for key in ("seconds", "rows_per_s", "mb_per_s")}
    return {**median, "slowest": ordered[-1], "fastest": ordered[0], "runs": runs}


def _percentiles(latencies: list[float]) -> dict[str, float]:
    """Median and 99th percentile (nearest rank: of 100 trials the 99th smallest) in ms."""
    ordered = sorted(latencies)
    return {"p50_ms": statistics.median(ordered) * 1e3, "p99_ms": ordered[max(-(-99 * len(ordered) // 100) - 1, 0)] * 1e3}


def latency_summary(measured: dict[str, list[float]], repeats: int) -> dict[str, Any]:
    """p50 and p99 of all hand-offs, the p50 of each of `repeats` equal runs of them (their
    median, slowest and fastest) and the put call's p50."""
    handoffs = measured["handoff"]
    size = max(len(handoffs) // repeats, 1)
    p50s = [statistics.median(handoffs[k : k + size]) * 1e3 for k in range(0, size * repeats, size) if handoffs[k : k + size]]
    out = {**_percentiles(handoffs), "run_p50_ms": p50s, "p50_min_ms": min(p50s), "p50_max_ms": max(p50s)}
    if "put" in measured:
        out["put_p50_ms"] = statistics.median(measured["put"]) * 1e3
    return out


def workloads() -> list[tuple[str, Workload]]:
    return [*((f"small-{b}", Workload(f"small{b}", SMALL, 4096, b)) for b in SMALL_BATCHES), ("large", Workload("large", LARGE, 64, 8)), ("trickle", TRICKLE)]


def run(*, systems: tuple[str, ...] = SYSTEMS, num_trials: int = 200, repeats: int = 3, transport: str = "tcp", put_window: int = PUT_WINDOW, progress: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Measure every system: each throughput is the median of `repeats` runs; the hand-offs
    are `num_trials` in `repeats` equal runs. `transport` ("tcp" or "ipc") is what tidal and
    raw ZeroMQ run over (TransferQueue uses Ray's); `put_window` is how many puts
    `tidal-tuned` keeps in flight."""
    if put_window < 1:
        raise ValueError(f"put_window must be >= 1, got {put_window}")
    endpoint(transport)  # fails early on an unknown transport
    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        if system == "transferqueue":
            from tidal.tools.bench import tq as bench_tq

            if not bench_tq.available():
                progress("transferqueue: not installed (pip install -c constraints.txt -e '.[bench]'); skipped")
                continue
            runs: Callable[[Workload], list[float]] = lambda w: [w.num_rows / bench_tq.tq_throughput(num_rows=w.num_rows, fields=w.fields, batch_size=w.batch_size, put_size=w.put_size)["rows_per_s"] for _ in range(repeats)]  # noqa: E731
            latency: Callable[[], dict[str, Any]] | None = lambda: {"handoff": bench_tq.tq_latency(num_trials=num_trials)}  # noqa: E731
        elif system == "raw-zmq":
            runs = lambda w: zmq_runs(w, repeats=repeats, transport=transport)  # noqa: E731
            latency = lambda: zmq_latency(num_trials, transport)  # noqa: E731
        elif system in PATHS:
            path = PATHS[system] if system != "tidal-tuned" else dataclasses.replace(PATHS[system], window=put_window)
            runs = functools.partial(tidal_runs, path=path, repeats=repeats, transport=transport)
            latency = (lambda embedded=path.embedded: tidal_latency(num_trials, transport, embedded=embedded)) if system in ("tidal", "tidal-embedded") else None
        else:
            raise ValueError(f"unknown system {system!r}; systems: {', '.join(SYSTEMS)}")
        entry: dict[str, Any] = {}
        for key, work in workloads():
            progress(f"{system}: {key} ({repeats} runs)")
            entry[key] = summary(work, runs(work))
        if latency is not None:
            progress(f"{system}: hand-off latency ({num_trials} trials)")
            entry["latency"] = latency_summary(latency(), repeats)
        results[system] = entry
    return results


def _spread(median: float, low: float, high: float, fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(median)} ({fmt.format(low)}-{fmt.format(high)})"


def table(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Rows of the printed table: medians (slowest-fastest run), ratios of medians against
    TransferQueue and raw ZeroMQ measured in the same run."""
    tq, raw = results.get("transferqueue"), results.get("raw-zmq")
    header = ["system"]
    for b in SMALL_BATCHES:
        header += [f"small b{b} rows/s", "x TQ"]
    header += ["1MB-row MB/s", "% raw", "trickle rows/s", "x TQ", "hand-off p50 ms", "x raw", "p99 ms", "put p50 ms"]
    rows = [header]
    for system, r in results.items():
        row = [system]
        for b in SMALL_BATCHES:
            s = r[f"small-{b}"]
            row += [_spread(s["rows_per_s"], s["slowest"]["rows_per_s"], s["fastest"]["rows_per_s"]), f"{s['rows_per_s'] / tq[f'small-{b}']['rows_per_s']:.1f}" if tq else "-"]
        large, lat = r["large"], r.get("latency")
        row += [_spread(large["mb_per_s"], large["slowest"]["mb_per_s"], large["fastest"]["mb_per_s"]), f"{100 * large['mb_per_s'] / raw['large']['mb_per_s']:.0f}%" if raw else "-"]
        trickle = r.get("trickle")  # results saved before 2026-12-01 have none
        row += [_spread(trickle["rows_per_s"], trickle["slowest"]["rows_per_s"], trickle["fastest"]["rows_per_s"]) if trickle else "-", f"{trickle['rows_per_s'] / tq['trickle']['rows_per_s']:.1f}" if trickle and tq and "trickle" in tq else "-"]
        raw_lat = raw.get("latency") if raw else None
        row += [
            _spread(statistics.median(lat["run_p50_ms"]), lat["p50_min_ms"], lat["p50_max_ms"], "{:.2f}") if lat else "-",
            f"{statistics.median(lat['run_p50_ms']) / statistics.median(raw_lat['run_p50_ms']):.1f}" if lat and raw_lat else "-",
            f"{lat['p99_ms']:.2f}" if lat else "-",
            f"{lat['put_p50_ms']:.2f}" if lat and "put_p50_ms" in lat else "-",
        ]
        rows.append(row)
    return rows
