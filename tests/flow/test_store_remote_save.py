"""A client's `save` writes only inside the directory its server was started with.

The store ran without a token on loopback, and `save` wrote wherever the client said: any
local process could make the trainer's process overwrite any file it may write."""

from __future__ import annotations

import os

import pytest
import torch

from tidal.flow.store import RemoteStore, Store, StoreError, StoreServer, persist


def _store() -> Store:
    store = Store()
    store.create_partition("train", consumers=["c"])
    store.put("train", {"x": torch.arange(4).reshape(2, 2)})
    return store


def test_a_server_without_a_persist_dir_refuses_every_clients_save_and_says_how_to_allow_it(tmp_path):
    with StoreServer(_store()) as server, RemoteStore(server.address, rpc_timeout_s=10) as client:
        for path in (str(tmp_path / "store.bin"), "store.bin"):
            with pytest.raises(ValueError, match=r"persist_dir=DIR"):
                client.save(path)
        assert os.listdir(tmp_path) == [] and not os.path.exists("store.bin")
        assert client.ping()["store"] is True
        server.save(tmp_path / "own.bin")  # its own process saves anywhere
    assert persist.load(tmp_path / "own.bin").metrics()["partitions"]["train"]["rows"] == 2


def test_a_clients_save_goes_inside_the_persist_dir_and_nowhere_else(tmp_path):
    root, outside = tmp_path / "saves", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"keep me")
    (root / "out").symlink_to(outside)  # a folder link out of it
    (root / "link.bin").symlink_to(victim)  # a file link out of it
    (root / "planted.bin.tmp").symlink_to(victim)  # where a save writes first
    with StoreServer(_store(), persist_dir=root) as server, RemoteStore(server.address, rpc_timeout_s=10) as client:
        client.save("a.bin")  # relative: to the persist_dir
        client.save("sub/../sub/b.bin")
        client.save(str(root / "c.bin"))  # absolute, inside it
        for name in ("a.bin", "sub/b.bin", "c.bin"):
            assert persist.load(root / name).metrics()["partitions"]["train"]["rows"] == 2
        for path in ("../outside/victim", str(victim), "out/victim", "out/new.bin", "link.bin", "sub/../../outside/new.bin", ".", ""):
            with pytest.raises(ValueError, match=rf"save path {path!r} names no file inside the store server's persist_dir"):
                client.save(path)
        with pytest.raises(StoreError, match="OSError"):  # a link where its temporary file goes is not followed
            client.save("planted.bin")
        with pytest.raises(ValueError, match="null byte"):
            client.save("a\0b")
        assert client.ping()["store"] is True
    assert victim.read_bytes() == b"keep me" and sorted(os.listdir(outside)) == ["victim"]
