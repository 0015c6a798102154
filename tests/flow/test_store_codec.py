"""What the store's codec carries (in a saved store and between processes), and how it
names what it cannot carry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.flow.store import Grouped, RemoteStore, Store, StoreServer
from tidal.flow.store.codec import CodecError, decode, encode
from tidal.flow.store.persist import load, save


@pytest.fixture
def served():
    store = Store()
    store.create_partition("p", consumers=["c"])
    with StoreServer(store) as server:
        client = RemoteStore(server.address, rpc_timeout_s=10)
        yield store, client
        client.close()


class Thing:
    """A value an in-process store keeps and no codec carries."""


def test_codec_round_trip_and_rejects_bad_frames():
    value = {
        "t": torch.randn(300, 20).to(torch.bfloat16),  # large: raw buffers
        "a": np.arange(4000, dtype=np.int32),
        "small": [torch.arange(6).reshape(2, 3), np.ones(3, dtype=np.float16)],  # small: inside the header
        "r": range(3, 9),
        "l": [1, "x", None, b"y"],
    }
    header, buffers = encode(value)
    assert len(buffers) == 2
    out = decode(header, [bytes(b) for b in buffers])
    assert torch.equal(out["t"], value["t"]) and np.array_equal(out["a"], value["a"]) and out["l"] == value["l"]
    assert torch.equal(out["small"][0], value["small"][0]) and np.array_equal(out["small"][1], value["small"][1]) and out["r"] == range(3, 9)
    out["small"][0].add_(1)  # decoded tensors are writable
    with pytest.raises(CodecError, match="expected"):
        decode(header, [bytes(b)[:-1] for b in buffers])
    with pytest.raises(CodecError):
        decode(b"\xc1", [])
    with pytest.raises(CodecError, match="cannot be saved or sent"):
        encode({"f": object()})


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(1.5, dtype=torch.bfloat16),  # 0-d bf16: numpy has no bf16, so it goes as bytes
        torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
        np.array(5.0, dtype=np.float32),  # 0-d stays 0-d
        np.float32(1.5),  # a NumPy scalar keeps its dtype and comes back a scalar
        np.int16(-7),
        np.array([[1, 2], [3, 4]], dtype=">i4").T,  # not contiguous, big-endian
    ],
    ids=["bf16-0d", "bf16-2d", "np-0d", "np-float32", "np-int16", "np-transposed"],
)
def test_codec_keeps_dtype_shape_and_kind(value):
    header, buffers = encode(value)
    out = decode(header, buffers)
    assert type(out) is type(value) and out.dtype == value.dtype and tuple(out.shape) == tuple(value.shape)
    assert (torch.equal(out, value) if isinstance(value, torch.Tensor) else np.array_equal(out, value))


def test_a_saved_store_gives_back_its_numpy_and_bf16_columns_as_they_were(tmp_path):
    store = Store()
    store.create_partition("p", consumers=["c"])
    store.put("p", {"half": torch.tensor([0.5, 1.5], dtype=torch.bfloat16), "np": np.array([1e-300, 2.0])}, num_rows=2)
    save(store, tmp_path / "s.bin")
    before, after = store.get("c", "p", ["half", "np"], 2), load(tmp_path / "s.bin").get("c", "p", ["half", "np"], 2)
    for name in ("half", "np"):
        for a, b in zip(before.columns[name], after.columns[name]):
            assert type(a) is type(b) and a.dtype == b.dtype and float(a) == float(b)


def _same(a, b) -> bool:
    """Same type, dtype, shape and bytes (float8 has no `torch.equal`, NaT no `==`)."""
    if type(a) is not type(b) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor([1, 65535], dtype=torch.uint16),
        torch.tensor([[2**32 - 1]], dtype=torch.uint32),
        torch.tensor([2**63 + 5], dtype=torch.uint64),
        torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
        torch.tensor(0.25).to(torch.float8_e5m2),
        np.array(["ab", "c", "dëf"]),
        np.array([b"x", b"yz"]),
        np.array(["2024-01-01", "NaT"], dtype="datetime64[s]"),
        np.array([[5]], dtype="timedelta64[ms]"),
        np.str_("word"),
    ],
    ids=["uint16", "uint32", "uint64", "float8-e4m3", "float8-e5m2-0d", "np-unicode", "np-bytes", "np-datetime", "np-timedelta", "np-str-scalar"],
)
def test_codec_carries_unsigned_float8_string_and_time_dtypes(value):
    assert _same(decode(*encode(value)), value)
    assert _same(decode(*encode([value] * 2000))[1999], value)  # large: in raw buffers


def test_tuples_come_back_as_tuples():
    value = {"group": (1, "a"), "cells": [(1, (2, 3)), [4, (5,)]], "empty": (), "nested": {"k": ((1,), [2])}}
    out = decode(*encode(value))
    assert out == value  # a tuple never equals a list: each came back as what it was
    assert type(out["cells"][0][1]) is tuple and type(out["cells"][1]) is list


def test_tuple_groups_survive_a_save_and_still_make_groups(tmp_path):
    store = Store()
    store.create_partition("p", consumers=["c"])
    store.put("p", {"x": torch.arange(4), "pair": [(0, "a"), (1, "b"), (2, "c"), (3, "d")]}, groups=[("q", 1), ("q", 2), ("q", 1), ("q", 2)])
    save(store, tmp_path / "s.bin")
    batch = load(tmp_path / "s.bin").get("c", "p", ["x", "pair"], 2, sampler=Grouped(2), timeout=0)
    assert batch.indexes == [0, 2] and batch.groups == [("q", 1), ("q", 1)] and batch.columns["pair"] == [(0, "a"), (2, "c")]


def test_tuple_groups_and_cells_cross_the_wire_as_tuples(served):
    store, client = served
    client.put("p", {"x": torch.arange(4), "pair": [(0, "a"), (1, "b"), (2, "c"), (3, "d")]}, groups=[("q", 1), ("q", 2), ("q", 1), ("q", 2)])
    assert store.get("c", "p", ["x"], 2, sampler=Grouped(2), timeout=0).groups == [("q", 1), ("q", 1)]  # the server's store groups them
    batch = client.get("c", "p", ["x", "pair"], 2, sampler=Grouped(2), timeout=5)
    assert batch.indexes == [1, 3] and batch.groups == [("q", 2), ("q", 2)] and batch.columns["pair"] == [(1, "b"), (3, "d")]


def test_what_cannot_be_saved_or_sent_is_named_with_its_column_and_type(served, tmp_path):
    store, client = served
    with pytest.raises(CodecError, match=r"column 'meta' row 1: .*type Thing"):
        client.put("p", {"x": torch.zeros(2), "meta": [{}, {"k": Thing()}]})
    with pytest.raises(CodecError, match=r"groups row 0: .*type Thing"):
        client.put("p", {"x": torch.zeros(1)}, groups=[Thing()])
    store.put("p", {"x": torch.zeros(3), "meta": [{}, {}, {"k": [Thing()]}]})  # in process, anything is kept
    with pytest.raises(CodecError, match=r"partition 'p' column 'meta' row 2: .*type Thing"):
        save(store, tmp_path / "s.bin")
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    with pytest.raises(CodecError, match=r"column 'meta' row 2: .*type Thing"):
        client.get("c", "p", ["meta"], 3, timeout=5)
    assert client.get("c", "p", ["x"], 3, timeout=5).indexes == [0, 1, 2]  # the failed get gave its rows back


def test_conjugated_views_carry_their_values_and_sparse_tensors_are_refused_by_name():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for view in (z.conj(), z.conj().imag):  # a conjugate bit; a negative bit
        header, buffers = encode(view)
        assert torch.equal(decode(header, buffers), view.resolve_conj().resolve_neg())
    with pytest.raises(CodecError, match="layout torch.sparse_coo.*to_dense"):
        encode(torch.eye(3).to_sparse())


@pytest.mark.parametrize("cell", [{(1, 2): "pair key"}, {"n": 2**64}], ids=["tuple-key", "int-too-big"])
def test_a_cell_msgpack_cannot_carry_is_refused_by_name_and_never_saved_unloadable(served, tmp_path, cell):
    """A dict with a tuple key was saved (msgpack writes it as a list) into a file that no
    load could read: the whole store was lost. An int past 64 bits failed as a bare
    OverflowError that named no column."""
    store, client = served
    with pytest.raises(CodecError, match=r"column 'meta' row 1: "):
        client.put("p", {"x": torch.zeros(2), "meta": [{}, cell]})
    store.put("p", {"x": torch.zeros(2), "meta": [{}, cell]})  # in process, anything is kept
    with pytest.raises(CodecError, match=r"partition 'p' column 'meta' row 1: "):
        save(store, tmp_path / "s.bin")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["datetime64[s]", "timedelta64[ms]"])
def test_large_time_arrays_are_saved_and_sent(served, tmp_path, dtype):
    """Past `INLINE_MAX_BYTES` an array's buffer is the array itself, and NumPy gives no
    buffer of a datetime or timedelta: saving or sending one failed with ValueError."""
    value = np.arange(1000).astype(dtype)
    store, client = served
    client.put("p", {"t": value[None]})
    save(store, tmp_path / "s.bin")
    for source in (client, load(tmp_path / "s.bin")):
        (out,) = source.get("c", "p", ["t"], 1, timeout=5).columns["t"]
        assert out.dtype == value.dtype and np.array_equal(out, value)


def _nested(depth: int, leaf, kind: str = "list"):
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else (value,) if kind == "tuple" else {"k": value}
    return value


@pytest.mark.parametrize("leaf", [1, torch.zeros(2), range(3), (1,)], ids=["int", "tensor", "range", "tuple"])
@pytest.mark.parametrize("kind", ["list", "map", "tuple"])
def test_what_the_codec_encodes_at_any_depth_it_decodes_and_deeper_is_refused_by_name(kind, leaf):
    """A header nested ~500 levels ended `decode` in RecursionError, which no server caught:
    the request was never answered. Both ends now refuse past `MAX_DEPTH`, before recursing."""
    from tidal.flow.store.codec import MAX_DEPTH

    deepest = None
    for depth in range(MAX_DEPTH // (2 if kind == "tuple" else 1) - 3, MAX_DEPTH + 2):
        try:
            header, buffers = encode(_nested(depth, leaf, kind))
        except CodecError as e:
            assert "MAX_DEPTH=100" in str(e)
            break
        decode(header, buffers)  # what one end encodes, the other decodes
        deepest = depth
    assert deepest is not None and deepest < MAX_DEPTH + 1


@pytest.mark.parametrize("depth", [101, 500, 1000, 1023, 1100, 100_000])
@pytest.mark.parametrize("prefix", [b"\x91", b"\x81\xa1k"], ids=["lists", "maps"])
def test_a_header_nested_too_deeply_is_a_codec_error_not_a_recursion_error(prefix, depth):
    with pytest.raises(CodecError, match="MAX_DEPTH|not valid msgpack"):
        decode(prefix * depth + b"\xc0", [])
