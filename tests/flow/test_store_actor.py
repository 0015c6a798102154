"""The store as Ray actors, and its Prometheus endpoint."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from tidal.flow.store import RemoteStore, Store
from tidal.flow.store.actor import StoreActor, start_store_actor
from tidal.flow.store.prometheus import render, serve_metrics


def test_controller_and_storage_unit_as_ray_actors(ray_session):
    import ray

    controller, address = start_store_actor(role="controller")
    unit, unit_address = start_store_actor(role="unit")
    producer = RemoteStore(address, unit=unit_address)
    consumer = RemoteStore(address)
    try:
        producer.create_partition("train", consumers=["train"])
        producer.put("train", {"tokens": torch.arange(12).reshape(3, 4)}, versions=[0, 0, 1])
        batch = consumer.get("train", "train", ["tokens"], 3, timeout=30)
        assert batch.stack("tokens").sum().item() == sum(range(12)) and batch.versions == [0, 0, 1]
        consumer.ack("train", "train", batch.indexes)
        metrics = ray.get(controller.metrics.remote())
        assert metrics["partitions"]["train"]["evicted"] == 3
    finally:
        producer.close()
        consumer.close()
        for actor in (controller, unit):
            ray.get(actor.close.remote())
            ray.kill(actor)


def test_actor_refuses_a_public_bind_without_token(ray_session):
    import ray

    with pytest.raises(ray.exceptions.RayActorError, match="reachable from other machines"):
        start_store_actor(host="0.0.0.0")


def test_an_actor_bound_by_the_wildcard_gives_its_node_address_and_serves_metrics(monkeypatch):
    """host="*" (ZeroMQ's every-interface bind, reported back as 0.0.0.0): the address was
    tcp://0.0.0.0:<port>, which no other node can reach, and a metrics_port made the actor
    fail (HTTP cannot bind "*"). Servers stand in for the real ones: tests bind loopback only."""
    import ray

    bound: dict[str, str] = {}

    class Server:
        def __init__(self, store, *, unit, address, token, persist_dir):
            bound["store"], self.address = address, "tcp://0.0.0.0:5555"  # what ZeroMQ reports for tcp://*:0

    class Metrics:
        def __init__(self, metrics, *, host, port):
            bound["metrics"] = host

    monkeypatch.setattr("tidal.flow.store.actor.retain_freed_memory", lambda: True)  # the actor's body runs in the test's process here
    monkeypatch.setattr("tidal.flow.store.actor.freeze_startup_objects", lambda: bound.setdefault("frozen", True))
    monkeypatch.setattr("tidal.flow.store.actor.StoreServer", Server)
    monkeypatch.setattr("tidal.flow.store.actor.MetricsServer", Metrics)
    actor = StoreActor(host="*", token="t", metrics_port=0)
    assert bound == {"store": "tcp://*:0", "metrics": "0.0.0.0", "frozen": True}
    assert actor.address() == f"tcp://{ray.util.get_node_ip_address()}:5555"


def test_prometheus_text_and_endpoint():
    store = Store()
    store.create_partition("train", consumers=["train"])
    store.put("train", {"x": torch.zeros(3, 2)})
    batch = store.get("train", "train", ["x"], 2)
    store.ack("train", "train", batch.indexes)
    text = render(store.metrics())
    assert 'tidal_store_rows{partition="train"} 1' in text
    assert 'tidal_store_acked_total{partition="train",consumer="train"} 2' in text
    assert 'tidal_store_get_wait_seconds_bucket{le="+Inf",partition="train",consumer="train"} 1' in text
    assert "# TYPE tidal_store_get_wait_seconds histogram" in text
    server = serve_metrics(store.metrics)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url, timeout=10) as response:
            body = response.read().decode()
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert 'tidal_store_ready{columns="x",partition="train",consumer="train"} 1' in body
    finally:
        server.close()


_MAPPED_BYTES_AFTER_8MB = """
import ctypes, sys
from tidal.flow.store.memory import retain_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
print(applied, libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


@pytest.mark.parametrize("mode", ["retain", "default"])
def test_a_store_process_serves_row_sized_blocks_from_its_heap(mode):
    """With `retain_freed_memory`, an 8 MB block (a column of 8 rows of 1 MB) comes from the
    heap, whose freed pages are reused; glibc's default maps it fresh from the kernel."""
    import ctypes.util
    import subprocess
    import sys

    libc = ctypes.util.find_library("c") or ""
    if "libc.so.6" not in libc or not hasattr(ctypes.CDLL(libc), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    out = subprocess.run([sys.executable, "-c", _MAPPED_BYTES_AFTER_8MB, mode], capture_output=True, text=True, check=True).stdout.split()
    applied, mapped = out[0], int(out[1])
    if mode == "retain":
        assert applied == "True" and mapped == 0
    else:
        assert mapped >= 8 << 20
