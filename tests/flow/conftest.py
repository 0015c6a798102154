"""Fixtures shared by the store tests of this folder."""

from __future__ import annotations

import pytest

from tidal.flow.store import RemoteStore, Store, StoreServer


@pytest.fixture
def served():
    """An in-process store, a server for it on a free local port, and a client of it:
    (store, server, client). A test file may define its own `served` instead."""
    store = Store()
    with StoreServer(store) as server:
        client = RemoteStore(server.address, rpc_timeout_s=10)
        yield store, server, client
        client.close()
