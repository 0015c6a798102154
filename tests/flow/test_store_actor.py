"""The store as Ray actors, and its Prometheus endpoint."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from tidal.flow.store import RemoteStore, Store
from tidal.flow.store.actor import start_store_actor
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
