"""Fixtures shared by the store tests of this folder."""

from __future__ import annotations

import threading

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


def _run_in_thread(call):
    """Run `call` in a thread of its own (a remote store's waits are per thread): (the
    thread, a list its outcome, a value or the exception, lands in)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as e:  # checked by the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)  # a failed test must not leave the process waiting on it
    thread.start()
    return thread, outcome


@pytest.fixture
def in_thread():
    """`in_thread(call)` -> (thread, outcome): `call` run in a thread of its own."""
    return _run_in_thread

