"""Split deployment: a controller that holds only metadata, and storage units that hold
the column data of the producers that wrote it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tidal.flow.store import Grouped, RemoteStore, StorageUnit, Store, StoreError, StoreServer, persist


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
    with StoreServer(controller, persist_dir=tmp_path) as ctrl, StoreServer(unit=StorageUnit()) as unit_a, StoreServer(unit=StorageUnit()) as unit_b:
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


def test_a_zero_row_put_on_a_unit_leaves_no_chunk_there_and_still_acks(wait_for):
    """The controller keeps nothing for 0 rows, so a chunk written for them was never freed."""
    controller = Store()
    with StoreServer(controller) as ctrl, StoreServer(unit=StorageUnit()) as unit_a, StoreServer(unit=StorageUnit()) as unit_b:
        producer_a = RemoteStore(ctrl.address, unit=unit_a)
        producer_b = RemoteStore(ctrl.address, unit=unit_b.address)
        try:
            producer_a.create_partition("prompts", consumers=["rollout"])
            producer_a.create_partition("train", consumers=["train"])
            producer_a.put("prompts", {"p": torch.ones(2, 1)})
            leased = producer_b.get("rollout", "prompts", ["p"], 2, timeout=5).indexes
            assert producer_a.put("train", {"x": torch.ones(0, 4), "meta": []}) == []
            assert producer_b.put("train", {"x": torch.ones(0, 4)}, ack=("rollout", "prompts", leased)) == []
            assert producer_b.submit_put("train", {"x": torch.ones(0, 4)}, indexes=[]).result() == []
            assert len(unit_b.unit) == 0
            wait_for(lambda: len(unit_a.unit) == 0)  # the acked prompts' chunk is dropped; no 0-row chunk stays
            assert controller.metrics()["partitions"]["prompts"]["rows"] == 0  # the 0-row put acked them
            with pytest.raises(ValueError, match="no partition 'nope'"):  # still checked by the controller
                producer_a.put("nope", {"x": torch.ones(0, 4)})
            assert (len(unit_a.unit), len(unit_b.unit)) == (0, 0)
        finally:
            producer_a.close()
            producer_b.close()


def test_a_save_reads_the_units_without_holding_the_store_and_their_chunks_stay_until_read(tmp_path, wait_for):
    """The store's lock was held while every unit was read (up to `timeout_s` each): puts
    and gets stalled for the whole save. A chunk freed meanwhile is dropped only once read."""
    import threading
    import time

    controller = Store()
    with StoreServer(controller) as ctrl, StoreServer(unit=StorageUnit()) as unit:
        producer, consumer = RemoteStore(ctrl.address, unit=unit.address), RemoteStore(ctrl.address)
        try:
            producer.create_partition("train", consumers=["train"])
            producer.create_partition("other", consumers=["c"])
            producer.put("train", {"x": torch.arange(4.0).reshape(2, 2)})
            (key,) = list(unit.unit._chunks)
            events: list[str] = []
            reading, read_chunk, read, drop = threading.Event(), ctrl._read_chunk, unit.unit.read, unit.unit.drop

            def slow_read_chunk(*args):
                reading.set()
                time.sleep(1.5)  # a slow unit, or a slow way to it
                return read_chunk(*args)

            def noted_read(k, offsets):
                events.append("read")
                return read(k, offsets)

            def noted_drop(keys):
                events.extend(f"drop {k}" for k in keys)
                return drop(keys)

            ctrl._read_chunk, unit.unit.read, unit.unit.drop = slow_read_chunk, noted_read, noted_drop
            saver = threading.Thread(target=ctrl.save, args=(str(tmp_path / "s.bin"),), kwargs={"timeout_s": 10})
            saver.start()
            assert reading.wait(5)
            begin = time.monotonic()
            controller.put("other", {"y": torch.ones(1, 1)})  # in process: the store's lock
            assert consumer.get("c", "other", ["y"], 1, timeout=5).indexes == [0]  # the server thread: served during the save
            assert time.monotonic() - begin < 1.0
            controller.get("train", "train", ["x"], 2, timeout=0)  # leases them (no read of the unit)
            consumer.ack("train", "train", [0, 1])  # frees the chunk the save is reading
            saver.join(10)
            assert not saver.is_alive()
            wait_for(lambda: f"drop {key}" in events)
            assert events == ["read", f"drop {key}"]  # not dropped before the save read it
        finally:
            producer.close()
            consumer.close()
    restored = persist.load(tmp_path / "s.bin")
    assert restored.get("train", "train", ["x"], 2, timeout=0).stack("x").tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_a_put_whose_reply_is_lost_keeps_its_chunks_on_the_unit(wait_for):
    """A put the controller took but whose reply never came (a broken connection) failed
    with `StoreError`, and its chunks were freed on the unit: the controller then held
    rows without data. They stay now; a put the server refused frees its chunks."""
    controller = Store()
    with StoreServer(controller) as ctrl, StoreServer(unit=StorageUnit()) as unit:
        producer, consumer = RemoteStore(ctrl.address, unit=unit.address, rpc_timeout_s=2.0), RemoteStore(ctrl.address)
        answer = ctrl._answer
        lost = []

        def lose_the_first_put_reply(peer, request_id, op, result, args):
            if op == "put" and not lost:
                lost.append(result)  # taken, and the reply never goes out
                return
            answer(peer, request_id, op, result, args)

        ctrl._answer = lose_the_first_put_reply
        try:
            producer.create_partition("train", consumers=["train"])
            with pytest.raises(StoreError, match="no longer holds this 'put'"):
                producer.put("train", {"x": torch.arange(6.0).reshape(3, 2)}, groups=[0, 0, 1])
            assert list(lost[0]) == [0, 1, 2] and len(unit.unit) == 1
            batch = consumer.get("train", "train", ["x"], 3, timeout=5)
            assert batch.indexes == [0, 1, 2] and batch.stack("x").tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
            consumer.ack("train", "train", batch.indexes)
            wait_for(lambda: len(unit.unit) == 0)  # acked: freed as any chunk
            with pytest.raises(ValueError, match="no partition 'nope'|partition 'nope'"):
                producer.put("nope", {"x": torch.ones(2, 2)})  # refused: nothing of it was done
            wait_for(lambda: len(unit.unit) == 0)
        finally:
            for client in (producer, consumer):
                client.close()


def test_a_cancelled_put_on_a_unit_frees_its_chunks(in_thread, wait_for):
    """The server withdrew the put (it was still waiting for room): nothing of it went in,
    so its chunks on the unit go too."""
    with StoreServer(Store()) as ctrl, StoreServer(unit=StorageUnit()) as unit:
        producer = RemoteStore(ctrl.address, unit=unit.address)
        try:
            producer.create_partition("train", consumers=["train"], capacity_rows=1)
            producer.put("train", {"x": torch.zeros(1, 1)})
            cancel = threading.Event()
            thread, outcome = in_thread(lambda: producer.put("train", {"x": torch.ones(1, 1)}, cancel=cancel))
            wait_for(lambda: len(unit.unit) == 2)  # its chunk is written; the put waits for room
            time.sleep(0.2)
            cancel.set()
            producer.wake()
            thread.join(5)
            assert not thread.is_alive() and isinstance(outcome[0], StoreError) and str(outcome[0]) == "put was cancelled"
            wait_for(lambda: len(unit.unit) == 1)  # the first put's chunk only
        finally:
            producer.close()


def test_numpy_columns_read_from_a_unit_stay_numpy_with_their_dtype():
    """A unit turned a NumPy chunk into a tensor when read: a split store gave back tensors
    where the in-process store gives NumPy values, and strings failed the get outright."""
    import numpy as np

    columns = {"f": np.array([1.5, 2.5], dtype=np.float16), "s": np.array(["a", "bc"]), "b": np.array([[True], [False]])}
    local = Store()
    local.create_partition("train", consumers=["train"])
    local.put("train", columns)
    expected = local.get("train", "train", list(columns), 2, timeout=0).columns
    with StoreServer(Store()) as ctrl, StoreServer(unit=StorageUnit()) as unit:
        for where in (unit, unit.address):  # in process, and over the wire
            client = RemoteStore(ctrl.address, unit=where, rpc_timeout_s=5)
            try:
                client.create_partition(f"train-{where is unit}", consumers=["train"])
                client.put(f"train-{where is unit}", columns)
                got = client.get("train", f"train-{where is unit}", list(columns), 2, timeout=5).columns
                for name, cells in expected.items():
                    assert [(type(c), c.dtype, np.shape(c)) for c in got[name]] == [(type(c), c.dtype, np.shape(c)) for c in cells]
                    assert all(np.array_equal(a, b) for a, b in zip(got[name], cells))
            finally:
                client.close()


def test_a_put_naming_a_unit_zeromq_cannot_reach_never_stops_the_server(served, wait_for):
    """Freeing its chunk made the server thread connect to that address to drop it there:
    ZeroMQ's error ended the thread, and no request was answered again."""
    import numpy as np

    store, server, client = served
    client.create_partition("train", consumers=["train"])
    client._call("put", {"partition": "train", "remote": {"x": {"unit": "not an address", "key": "k", "sizes": np.array([4])}}})
    client.put("train", {"x": torch.zeros(1)}, indexes=[0])  # replaces the row's cell: its chunk is freed
    wait_for(lambda: not server._units.drops)
    assert server._thread.is_alive() and client.ping()["store"]


def test_rows_of_several_puts_on_units_keep_each_puts_dtype_and_shape():
    """The client concatenated the pieces read from units: a float32 row came back float64
    beside a float64 one, and rows of different shapes failed the get."""
    with StoreServer(Store()) as ctrl, StoreServer(unit=StorageUnit()) as unit:
        client = RemoteStore(ctrl.address, unit=unit.address, rpc_timeout_s=5)
        try:
            client.create_partition("train", consumers=["train"])
            for x in (torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)):
                client.put("train", {"x": x})
            cells = client.get("train", "train", ["x"], 3, timeout=5).columns["x"]
            assert [(c.dtype, tuple(c.shape)) for c in cells] == [(torch.float32, (2,)), (torch.float64, (2,)), (torch.float64, (3,))]
        finally:
            client.close()
