"""`StoreApi` and `AsyncStoreApi`: every form of the store satisfies its protocol, by name
(`isinstance`) and by signature (each call the protocol allows is one the class takes)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from tidal.flow.store import AsyncStore, AsyncStoreApi, RemoteStore, Store, StoreApi, StoreError

P = inspect.Parameter
STORE_CALLS = {"create_partition", "wait_partition", "add_consumer", "set_version", "put", "submit_put", "get", "ack", "release", "metrics", "wake", "close"}
ASYNC_CALLS = {"put", "get", "wait_partition", "ack"}


def _methods(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}


def _mismatches(declared: object, implemented: object) -> list[str]:
    """How a call `declared` allows (self aside) could fail against `implemented`: a positional
    parameter at another place or under another name, a keyword it does not take, a
    default it lacks or has another value of, or a parameter of its own without a default."""
    want = list(inspect.signature(declared).parameters.values())[1:]
    have = list(inspect.signature(implemented).parameters.values())[1:]
    by_name = {p.name: p for p in have}
    positional = [p for p in have if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    takes_any_keyword = any(p.kind is P.VAR_KEYWORD for p in have)
    out = []
    for k, p in enumerate(want):
        q = by_name.get(p.name)
        if p.kind is P.POSITIONAL_OR_KEYWORD and (k >= len(positional) or positional[k].name != p.name):
            out.append(f"{p.name!r} is not its positional parameter {k}")
            continue
        if q is None:
            if not (p.kind is P.KEYWORD_ONLY and takes_any_keyword):
                out.append(f"no parameter {p.name!r}")
            continue
        if p.kind is P.KEYWORD_ONLY and q.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
            out.append(f"{p.name!r} is not taken by keyword")
        if p.default is not P.empty and q.default != p.default:
            out.append(f"{p.name!r} defaults to {q.default!r}, not {p.default!r}")
    declared_names = {p.name for p in want}
    for q in have:
        if q.name not in declared_names and q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and q.default is P.empty:
            out.append(f"its own {q.name!r} has no default")
    return out


def test_the_protocols_name_the_calls_their_users_make():
    assert set(_methods(StoreApi)) == STORE_CALLS
    assert set(_methods(AsyncStoreApi)) == ASYNC_CALLS
    assert all(inspect.iscoroutinefunction(f) for f in _methods(AsyncStoreApi).values())


@pytest.mark.parametrize("cls", [Store, RemoteStore], ids=["Store", "RemoteStore"])
def test_every_store_call_has_the_protocols_signature(cls):
    wrong = {name: _mismatches(declared, getattr(cls, name)) for name, declared in _methods(StoreApi).items()}
    assert {name: problems for name, problems in wrong.items() if problems} == {}


def test_async_store_has_the_async_protocols_coroutines():
    for name, declared in _methods(AsyncStoreApi).items():
        implemented = getattr(AsyncStore, name)
        assert inspect.iscoroutinefunction(implemented), name
        assert _mismatches(declared, implemented) == [], name


def test_the_signature_check_sees_drift():
    class Drifted:
        def get(self, consumer, partition, size, columns, *, sampler=None, timeout=1.0, partial=False, ack=None, wait_s): ...
        def ack(self, consumer, partition): ...

    problems = _mismatches(StoreApi.get, Drifted.get)
    assert "'columns' is not its positional parameter 2" in problems
    assert "'timeout' defaults to 1.0, not None" in problems
    assert "no parameter 'cancel'" in problems
    assert "its own 'wait_s' has no default" in problems
    assert _mismatches(StoreApi.ack, Drifted.ack) == ["'indexes' is not its positional parameter 2"]


def test_an_in_process_store_is_a_store_api_and_its_async_form_an_async_one():
    store = Store()
    assert isinstance(store, StoreApi)
    aio = AsyncStore(store)
    assert isinstance(aio, AsyncStoreApi)
    assert not isinstance(aio, StoreApi)  # no create_partition, release, wake, ...
    assert not isinstance(object(), StoreApi)


def test_a_remote_store_is_a_store_api_checked_without_a_round_trip(served):
    store, _, client = served
    assert isinstance(client, StoreApi)
    client.create_partition("p", consumers=["c"])
    client.put("p", {"x": torch.arange(3.0)}, num_rows=3, versions=[4, 4, 5])
    batch = client.get("c", "p", ["x"], 3, timeout=5)
    assert batch.stack("x").tolist() == [0.0, 1.0, 2.0] and list(batch.versions) == [4, 4, 5]
    assert client.ack("c", "p", batch.indexes) == 3
    client.close()
    with pytest.raises(StoreError, match="closed"):
        _ = client.version  # a property read is a call: the protocol leaves `version` out
    assert isinstance(client, StoreApi)  # so the check still only looks at names
    assert store.metrics()["partitions"]["p"]["rows"] == 0


def test_async_store_works_over_a_remote_store(served):
    store, _, client = served
    store.create_partition("p", consumers=["c"])
    aio = AsyncStore(client)

    async def round_trip() -> tuple[list[int], list[float], int]:
        await aio.wait_partition("p", timeout=5)
        indexes = await aio.put("p", {"x": torch.tensor([[1.0], [2.0]])})
        batch = await aio.get("c", "p", ["x"], 2, timeout=5)
        return indexes, batch.stack("x").flatten().tolist(), await aio.ack("c", "p", batch.indexes)

    assert asyncio.run(round_trip()) == ([0, 1], [1.0, 2.0], 2)
    assert store.metrics()["partitions"]["p"]["rows"] == 0
