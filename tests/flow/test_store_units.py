"""Split deployment: a controller that holds only metadata, and storage units that hold
the column data of the producers that wrote it."""

from __future__ import annotations

import pytest
import torch

from tidal.flow.store import Grouped, RemoteStore, StorageUnit, Store, StoreError, StoreServer
from tidal.flow.store import persist


def test_split_deployment_keeps_data_on_the_writers_unit(wait_for):
    controller = Store()
    with StoreServer(controller) as ctrl, StoreServer(unit=StorageUnit()) as unit_a, StoreServer(unit=StorageUnit()) as unit_b:
        producer_a = RemoteStore(ctrl.address, unit=unit_a)  # in-process unit: zero-copy put
        producer_b = RemoteStore(ctrl.address, unit=unit_b.address)  # a unit in "another process"
        consumer = RemoteStore(ctrl.address)
        try:
            producer_a.create_partition("train", consumers=["train"])
            producer_a.put("train", {"x": torch.ones(3, 4)}, groups=[0, 0, 1])
            producer_b.put("train", {"x": torch.zeros(2, 4)}, groups=[1, 2])
            producer_b.put("train", {"reward": torch.tensor([5.0, 6.0])}, indexes=[0, 4])
            assert (len(unit_a.unit), len(unit_b.unit)) == (1, 2)  # one chunk per column per put
            assert controller.metrics()["partitions"]["train"]["bytes"] == 5 * 16 + 2 * 4
            batch = consumer.get("train", "train", ["x", "reward"], 2, timeout=5)
            assert batch.indexes == [0, 4]
            assert batch.stack("x").sum(1).tolist() == [4.0, 0.0]
            assert batch.stack("reward").tolist() == [5.0, 6.0]
            consumer.ack("train", "train", batch.indexes)
            wait_for(lambda: (len(unit_a.unit), len(unit_b.unit)) == (1, 1))  # the reward chunk is freed
            rest = consumer.get("train", "train", ["x"], 3, timeout=5)
            assert rest.indexes == [1, 2, 3] and rest.stack("x").sum().item() == 8.0
            consumer.ack("train", "train", rest.indexes)
            wait_for(lambda: (len(unit_a.unit), len(unit_b.unit)) == (0, 0))
        finally:
            for client in (producer_a, producer_b, consumer):
                client.close()


def test_a_split_store_is_saved_with_the_rows_its_units_hold_and_served_again_beside_new_units(tmp_path):
    controller = Store()
    with StoreServer(controller) as ctrl, StoreServer(unit=StorageUnit()) as unit_a, StoreServer(unit=StorageUnit()) as unit_b:
        producer_a = RemoteStore(ctrl.address, unit=unit_a)
        producer_b = RemoteStore(ctrl.address, unit=unit_b.address)
        try:
            producer_a.create_partition("train", consumers=["train"])
            producer_a.put("train", {"x": torch.arange(6).reshape(3, 2), "meta": [{"a": 1}, {}, {"b": (2,)}]}, groups=[("g", 0), ("g", 1), ("g", 0)])
            producer_b.put("train", {"reward": torch.tensor([1.0, 3.0])}, indexes=[0, 2])
            with pytest.raises(StoreError, match=r"column 'x' .*storage unit .*StoreServer.save"):
                persist.save(controller, tmp_path / "direct.bin")  # in process, nothing reaches the units' rows
            producer_b.save(str(tmp_path / "split.bin"))
        finally:
            producer_a.close()
            producer_b.close()
    restored = persist.load(tmp_path / "split.bin")
    batch = restored.get("train", "train", ["x", "meta", "reward"], 2, sampler=Grouped(2), timeout=0)
    assert batch.indexes == [0, 2] and batch.groups == [("g", 0), ("g", 0)]
    assert batch.stack("x").tolist() == [[0, 1], [4, 5]] and batch.columns["meta"] == [{"a": 1}, {"b": (2,)}] and batch.stack("reward").tolist() == [1.0, 3.0]
    with StoreServer(persist.load(tmp_path / "split.bin")) as ctrl, StoreServer(unit=StorageUnit()) as unit:
        producer, consumer = RemoteStore(ctrl.address, unit=unit.address), RemoteStore(ctrl.address)
        try:
            producer.put("train", {"x": torch.full((1, 2), 7), "meta": [{}]})
            both = consumer.get("train", "train", ["x", "meta"], 4, timeout=5)  # rows the controller holds, and rows on a unit
            assert both.indexes == [0, 1, 2, 3] and both.stack("x").tolist() == [[0, 1], [2, 3], [4, 5], [7, 7]]
            assert both.columns["meta"] == [{"a": 1}, {}, {"b": (2,)}, {}]
        finally:
            producer.close()
            consumer.close()
