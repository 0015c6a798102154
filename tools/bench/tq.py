"""TransferQueue (PyPI ``transferqueue`` 0.1.11, SimpleStorage backend) measured on this machine.

Adapter for ``tidal bench store``: the same producer -> consumer workloads as our store, run
on TransferQueue so the numbers can be compared. Everything here uses TransferQueue's own
public API; nothing in it is modified.

Topology (one machine, Ray started here when it is not running yet):

- the TransferQueue controller and its SimpleStorage units (2, TQ's default) are Ray actors
  that ``transfer_queue.init()`` creates;
- the producer is the calling process: ``transfer_queue.init()`` gives it a
  ``TransferQueueClient`` (``transfer_queue.get_client()``);
- the consumer is a Ray actor (another process) that attaches to the same controller with
  ``transfer_queue.init()`` and reads with its own client.

API calls used:

- put: ``client.put(data=TensorDict, partition_id=...)``. Without a ``BatchMeta`` this asks
  the controller for fresh row indexes (``get_meta(mode="insert")``), sends the rows to the
  storage units (ZeroMQ), has the storage manager tell the controller the fields are ready
  (``NOTIFY_DATA_UPDATE``, waits for its ACK) and sends the rows' custom meta.
- get: ``client.get_meta(data_fields=[...], batch_size=n, partition_id=..., mode="fetch",
  task_name=...)`` returns the metadata of ``n`` rows whose requested fields are all ready and
  that this ``task_name`` has not consumed yet, and marks them consumed in the controller in
  the same call (there is no separate ack); ``client.get_data(meta)`` then reads the rows
  from the storage units.
- waiting for rows: the controller runs in *polling mode* (``controller.polling_mode=True``):
  ``get_meta`` answers an empty ``BatchMeta`` at once when fewer than ``n`` rows are ready, and
  the consumer asks again after ``POLL_INTERVAL_S``. TQ's blocking mode is not usable here:
  the controller sleeps ``TQ_CONTROLLER_GET_METADATA_CHECK_INTERVAL`` (an integer, 5 s by
  default) inside the request and then raises ``TimeoutError`` after
  ``TQ_CONTROLLER_GET_METADATA_TIMEOUT`` (1 s), so a waiting consumer would see 5 s steps.
  TQ's own ``StreamingDataset`` polls too (it sleeps 1 s after an empty answer); we poll
  every 1 ms, which favours TQ's latency at the cost of CPU on the controller.

Caveats:

- TransferQueue's actors are declared ``@ray.remote(num_cpus=1)`` and TQ has no option for
  this; with 3 actors on a 2-CPU Ray node ``init`` would wait forever. ``_tq_init`` wraps the
  two actor classes for the duration of ``transfer_queue.init()`` so that their ``.options()``
  call also passes ``num_cpus=TQ_ACTOR_NUM_CPUS``. Ray's CPU count is only a scheduling
  label: it does not limit the CPU time a process uses.
- TransferQueue binds its ZeroMQ sockets to Ray's node IP. Ray turns ``127.0.0.1`` into the
  host's reachable address unless ``ray_constants.ENABLE_RAY_CLUSTER`` is off (as on macOS),
  so when we start Ray we switch that off for the ``ray.init`` call; the node, and with it
  every TQ socket, then uses 127.0.0.1.
- ``get_data`` returns each requested field as a jagged nested tensor (the storage units keep
  rows one by one, and the client packs them with ``torch.nested.as_nested_tensor``). The
  consumer uses what TQ returns as is; it only counts the bytes received to check it got the
  whole payload.
- Consumed rows are not cleared while measuring (TQ clears with ``clear_partition`` /
  ``clear_samples``, typically at the end of a training step); the partition is dropped at
  teardown.
- ``TQ_NUM_THREADS`` (torch threads TQ uses during put/get, default 8) is set to the number of
  physical cores when unset: TQ clamps it to that anyway but logs a warning on every call.
- Before the clock starts, the same workload goes once through another partition (which is
  then cleared), so sockets are open and code paths warm; actor start-up and TQ init are
  never timed.
- The numbers swing a lot with other load on a 2-core machine (TQ runs 5 processes here:
  producer, consumer, controller, 2 storage units); ``main`` prints the load average.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import sys
import time
from typing import Any

TQ_ACTOR_NUM_CPUS = 0.25
"""Ray CPUs asked for by each TQ actor (controller, storage units) and by our consumer actor."""

POLL_INTERVAL_S = 0.001
"""Sleep between two ``get_meta`` calls that found too few ready rows (polling mode)."""

TASK_NAME = "bench_consumer"
"""``task_name`` the consumer reads with; TQ tracks consumption per task name."""

LATENCY_FIELDS: dict[str, tuple[str, tuple[int, ...]]] = {"logprobs": ("float32", (256,))}
"""The row handed over in each latency trial."""

WARMUP_PASSES = 1
"""Untimed warm-up passes of the measured rows before a throughput run (see ``_warm_up``)."""

LATENCY_WARMUP_ROWS = 10
"""Untimed one-row hand-offs before the latency trials."""

_LATENCY_SETTLE_S = 0.05
"""Pause after each latency put before checking the consumer got the row (outside timing)."""


# Environment and Ray -------------------------------------------------------------------------
def _prepare_env() -> None:
    """Set the environment defaults TQ reads at import (only when unset)."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except Exception:  # psutil is a TQ dependency; be safe anyway
        cores = os.cpu_count() or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(cores))
    # If transfer_queue was imported before the variable was set, its module constant is stale.
    client_mod = sys.modules.get("transfer_queue.client")
    if client_mod is not None:
        client_mod.TQ_NUM_THREADS = min(int(os.environ["TQ_NUM_THREADS"]), cores)  # type: ignore[attr-defined]


def _start_ray_if_needed() -> bool:
    """Start a local 2-CPU Ray bound to 127.0.0.1 unless Ray is initialised; True if started here."""
    _prepare_env()
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return False
    os.environ["RAY_AUTH_MODE"] = "disabled"  # our own throw-away local cluster
    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # lets "127.0.0.1" stay loopback (see module docstring)
    try:
        ray.init(
            address="local",  # a Ray of its own, not one a `ray start` on this machine left running
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous
    return True


class _FractionalCPUs:
    """Stand-in for a TQ Ray actor class whose ``.options()`` also passes a fractional ``num_cpus``."""

    def __init__(self, actor_class: Any, num_cpus: float) -> None:
        self._actor_class = actor_class
        self._num_cpus = num_cpus

    def options(self, **kwargs: Any) -> Any:
        """Forward to the real ``ActorClass.options`` with ``num_cpus`` added."""
        kwargs.setdefault("num_cpus", self._num_cpus)
        return self._actor_class.options(**kwargs)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Create the actor with the fractional ``num_cpus``."""
        return self.options().remote(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Anything else is the real actor class's."""
        return getattr(self._actor_class, name)


def _tq_init() -> Any:
    """Create TQ's controller (polling mode) and SimpleStorage units; return this process's client."""
    import ray
    import transfer_queue as tq
    import transfer_queue.interface as tq_interface
    import transfer_queue.storage.bootstrap.simple_storage_bootstrap as tq_simple_bootstrap

    try:
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
    except ValueError:
        pass
    else:
        raise RuntimeError("a TransferQueueController already runs in this Ray cluster; close it first")

    controller_class = tq_interface.TransferQueueController
    storage_class = tq_simple_bootstrap.SimpleStorageUnit
    tq_interface.TransferQueueController = _FractionalCPUs(controller_class, TQ_ACTOR_NUM_CPUS)
    tq_simple_bootstrap.SimpleStorageUnit = _FractionalCPUs(storage_class, TQ_ACTOR_NUM_CPUS)
    try:
        tq.init({"controller": {"polling_mode": True}, "backend": {"storage_backend": "SimpleStorage"}})
    except BaseException:
        _tq_close()
        raise
    finally:
        tq_interface.TransferQueueController = controller_class
        tq_simple_bootstrap.SimpleStorageUnit = storage_class
    return tq.get_client()


def _tq_close() -> None:
    """Shut TQ's storage units and controller down (TQ's ``close``) and wait for the name to free."""
    import ray
    import transfer_queue as tq

    tq.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor("TransferQueueController", namespace="transfer_queue")
        except ValueError:
            return
        time.sleep(0.05)


# Payload -------------------------------------------------------------------------------------
def _make_batch(fields: dict[str, tuple[str, tuple[int, ...]]], n: int) -> Any:
    """A TensorDict of ``n`` rows with real tensors of the given dtypes and per-row shapes."""
    import torch
    from tensordict import TensorDict

    columns = {}
    for name, (dtype_name, shape) in fields.items():
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            columns[name] = torch.rand((n, *shape), dtype=dtype)
        else:
            high = 256 if dtype == torch.uint8 else 32000
            columns[name] = torch.randint(0, high, (n, *shape), dtype=dtype)
    return TensorDict(columns, batch_size=[n])


def _row_bytes(fields: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Payload bytes of one row."""
    import math

    import torch

    return sum(
        torch.empty((), dtype=getattr(torch, d)).element_size() * math.prod(s) for d, s in fields.values()
    )


def _received_bytes(data: Any) -> int:
    """Bytes of tensor payload in a TensorDict returned by ``get_data`` (dense or nested fields)."""
    total = 0
    for value in data.values():
        if value.is_nested:
            try:
                total += value.values().numel() * value.element_size()
            except (RuntimeError, NotImplementedError):  # strided nested fallback
                total += sum(t.numel() * t.element_size() for t in value.unbind())
        else:
            total += value.numel() * value.element_size()
    return total


# Consumer (a Ray actor: another process) -------------------------------------------------------
class _Consumer:
    """Consumer process: attaches to the running TQ controller and reads rows in polling mode.

    Created as a threaded Ray actor (``max_concurrency=2``) so the producer can ask how far
    it got while a read loop runs.
    """

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        import transfer_queue as tq

        tq.init()  # finds the named controller, reads its config and builds a client
        self._client = tq.get_client()
        self._polling = False
        self._received = 0

    def polling(self) -> bool:
        """True once the current read loop has started asking for rows."""
        return self._polling

    def received(self) -> int:
        """Rows the latency loop has received so far."""
        return self._received

    def _get(self, partition_id: str, field_names: list[str], n: int, poll_interval_s: float) -> Any:
        """Poll ``get_meta`` until ``n`` ready, unconsumed rows exist; return their data."""
        client = self._client
        while True:
            meta = client.get_meta(
                data_fields=field_names, batch_size=n, partition_id=partition_id, mode="fetch", task_name=TASK_NAME
            )
            if meta.size > 0:
                return client.get_data(meta)
            self._polling = True
            time.sleep(poll_interval_s)

    def consume(self, partition_id: str, field_names: list[str], num_rows: int, batch_size: int, poll_interval_s: float) -> dict[str, Any]:
        """Get ``num_rows`` rows in batches of ``batch_size`` as they become ready."""
        self._polling = False
        got = nbytes = 0
        t_last = time.perf_counter()
        while got < num_rows:
            data = self._get(partition_id, field_names, min(batch_size, num_rows - got), poll_interval_s)
            t_last = time.perf_counter()
            got += int(data.batch_size[0])
            nbytes += _received_bytes(data)
        self._polling = False
        return {"t_last_get": t_last, "rows": got, "bytes": nbytes}

    def latency_loop(self, partition_id: str, field_names: list[str], num_trials: int, poll_interval_s: float) -> list[float]:
        """Get one row per trial; return ``time.perf_counter()`` at each ``get_data`` return."""
        self._polling = False
        self._received = 0
        times = []
        for _ in range(num_trials):
            data = self._get(partition_id, field_names, 1, poll_interval_s)
            times.append(time.perf_counter())
            assert int(data.batch_size[0]) == 1
            self._received += 1
        self._polling = False
        return times

    def close(self) -> None:
        """Close this process's TQ client (not the controller, which the producer owns)."""
        self._client.close()


def _start_consumer() -> Any:
    """Start the consumer actor and wait until its TQ client is connected."""
    import ray

    if __name__ != "__main__":  # workers may not import this module under the name it has here
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    env = {k: os.environ[k] for k in ("TQ_NUM_THREADS",) if k in os.environ}
    actor = ray.remote(num_cpus=TQ_ACTOR_NUM_CPUS, max_concurrency=2)(_Consumer).remote(env)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency
    ray.get(actor.polling.remote())
    return actor


def _stop_consumer(actor: Any) -> None:
    """Close the consumer's client and kill the actor process we started."""
    import ray

    try:
        ray.get(actor.close.remote(), timeout=30)
    finally:
        ray.kill(actor)


def _wait_polling(actor: Any) -> None:
    """Block until the consumer's read loop is polling for rows."""
    import ray

    while not ray.get(actor.polling.remote()):
        time.sleep(0.01)


def _warm_up(client: Any, consumer: Any, fields: dict[str, tuple[str, tuple[int, ...]]], num_rows: int, batch_size: int, passes: int) -> None:
    """Untimed: ``passes`` times, push ``num_rows`` rows through a throw-away partition, then clear it.

    Opens every socket and runs every code path once (the steady state of a pipeline that has
    already done a step), so the measurement holds no connection or first-call costs.
    """
    import ray

    for i in range(passes):
        partition_id = f"warmup_{i}"
        ref = consumer.consume.remote(partition_id, list(fields), num_rows, batch_size, POLL_INTERVAL_S)
        for start in range(0, num_rows, batch_size):
            client.put(data=_make_batch(fields, min(batch_size, num_rows - start)), partition_id=partition_id)
        ray.get(ref)
        client.clear_partition(partition_id)


# Public API ----------------------------------------------------------------------------------
def available() -> bool:
    """True when transfer_queue and ray import."""
    try:
        _prepare_env()
        import ray  # noqa: F401
        import transfer_queue  # noqa: F401
    except Exception:
        return False
    return True


def tq_throughput(*, num_rows: int, fields: dict[str, tuple[str, tuple[int, ...]]], batch_size: int, put_size: int | None = None) -> dict[str, float]:
    """Producer puts num_rows rows in batches of put_size (None: batch_size) while a consumer in ANOTHER PROCESS gets batches of batch_size as they become ready (polling mode), until it has all rows. fields maps name -> (torch dtype name like 'int64'/'float32', per-row shape). Returns {"seconds": wall time from first put to last get returned, "rows_per_s": ..., "mb_per_s": payload bytes / seconds / 1e6}."""
    started_ray = _start_ray_if_needed()
    import ray

    try:
        client = _tq_init()
        consumer = None
        try:
            consumer = _start_consumer()
            _warm_up(client, consumer, fields, num_rows, batch_size, WARMUP_PASSES)
            size = put_size or batch_size
            batches = [_make_batch(fields, min(size, num_rows - s)) for s in range(0, num_rows, size)]
            ref = consumer.consume.remote("throughput", list(fields), num_rows, batch_size, POLL_INTERVAL_S)
            _wait_polling(consumer)
            t_first_put = time.perf_counter()
            for batch in batches:
                client.put(data=batch, partition_id="throughput")
            result = ray.get(ref)
        finally:
            if consumer is not None:
                _stop_consumer(consumer)
            _tq_close()
    finally:
        if started_ray:
            ray.shutdown()

    payload = num_rows * _row_bytes(fields)
    if result["rows"] != num_rows or result["bytes"] != payload:
        raise RuntimeError(f"consumer got {result['rows']} rows / {result['bytes']} B, expected {num_rows} / {payload}")
    seconds = result["t_last_get"] - t_first_put
    return {"seconds": seconds, "rows_per_s": num_rows / seconds, "mb_per_s": payload / seconds / 1e6}


def tq_latency(*, num_trials: int) -> list[float]:
    """For each trial: a consumer in another process is already waiting for one new row (a small row, e.g. one float32[256] field); the producer records time.perf_counter() just before its put call; the consumer records time.perf_counter() when its get returns that row. Returns the list of (t_get_returned - t_put_called) in seconds. perf_counter is CLOCK_MONOTONIC on Linux so it is comparable across processes on one machine."""
    started_ray = _start_ray_if_needed()
    import ray

    try:
        client = _tq_init()
        consumer = None
        try:
            consumer = _start_consumer()
            _warm_up(client, consumer, LATENCY_FIELDS, LATENCY_WARMUP_ROWS, 1, 1)
            rows = [_make_batch(LATENCY_FIELDS, 1) for _ in range(num_trials)]
            ref = consumer.latency_loop.remote("latency", list(LATENCY_FIELDS), num_trials, POLL_INTERVAL_S)
            _wait_polling(consumer)
            t_puts = []
            for i, row in enumerate(rows):
                t_puts.append(time.perf_counter())
                client.put(data=row, partition_id="latency")
                # Outside the timed path: let the consumer take the row and go back to waiting.
                time.sleep(_LATENCY_SETTLE_S + random.uniform(0, 0.005))
                while ray.get(consumer.received.remote()) <= i:
                    time.sleep(0.01)
            t_gets = ray.get(ref)
        finally:
            if consumer is not None:
                _stop_consumer(consumer)
            _tq_close()
    finally:
        if started_ray:
            ray.shutdown()
    return [g - p for p, g in zip(t_puts, t_gets, strict=True)]


def main() -> None:
    """Run the small-row, 1 MB-row and hand-off latency measurements and print them."""
    small: dict[str, tuple[str, tuple[int, ...]]] = {
        "input_ids": ("int64", (256,)),
        "attention_mask": ("int64", (256,)),
        "logprobs": ("float32", (256,)),
        "reward": ("float32", (1,)),
    }
    large: dict[str, tuple[str, tuple[int, ...]]] = {"blob": ("uint8", (1 << 20,))}
    t0 = time.perf_counter()
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    started_ray = _start_ray_if_needed()  # one Ray for all three runs; each sets TQ up anew
    try:
        r = tq_throughput(num_rows=4096, fields=small, batch_size=256)
        print(f"small rows (4096 x {_row_bytes(small)} B, batch 256): {r['rows_per_s']:,.0f} rows/s, "
              f"{r['mb_per_s']:.1f} MB/s, {r['seconds']:.3f} s")
        r = tq_throughput(num_rows=64, fields=large, batch_size=8)
        print(f"large rows (64 x 1 MiB, batch 8): {r['rows_per_s']:,.1f} rows/s, {r['mb_per_s']:.1f} MB/s, "
              f"{r['seconds']:.3f} s")
        lat = sorted(tq_latency(num_trials=50))
        p50 = statistics.median(lat)
        p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
        print(f"hand-off latency (50 trials, 1 x float32[256]): p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
              f"min {lat[0] * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms")
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    print(f"total {time.perf_counter() - t0:.1f} s (poll interval {POLL_INTERVAL_S * 1e3:g} ms, "
          f"load average after: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
