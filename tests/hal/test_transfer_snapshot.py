"""`hal.transfer.snapshot`: the copy of a version's weights a local publish hands to rollout
while the trainer goes on changing its own."""

from __future__ import annotations

import weakref

import torch

from tidal.hal import transfer
from tidal.hal.transfer import snapshot


def test_snapshot_copies_every_tensor_and_shares_nothing_with_the_originals():
    weights = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.arange(4, dtype=torch.int64)),
        ("c", torch.arange(12, dtype=torch.float32).reshape(3, 4).t()),  # not contiguous
        ("d", torch.ones(2, dtype=torch.bfloat16, requires_grad=True)),
        ("e", torch.zeros(0, 5)),
    ]
    copies = snapshot(weights)
    assert [n for n, _ in copies] == ["a", "b", "c", "d", "e"]
    for (_, original), (_, copy) in zip(weights, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original.detach())
        assert not copy.requires_grad and copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    with torch.no_grad():
        for _, original in weights:
            original.add_(1)  # the trainer's next step
    assert torch.equal(copies[0][1], torch.arange(6, dtype=torch.float32).reshape(2, 3)) and copies[1][1].tolist() == [0, 1, 2, 3]
    assert torch.equal(copies[2][1], torch.arange(12, dtype=torch.float32).reshape(3, 4).t())
    assert copies[0][1].untyped_storage().data_ptr() == copies[2][1].untyped_storage().data_ptr()  # one buffer per dtype


def test_snapshot_copies_a_sources_tensors_batch_by_batch_as_they_come(monkeypatch):
    """A source that makes each tensor as it is taken (a LoRA engine's merged weights) has at
    most a batch of them alive beside the copy: each batch is copied, and its tensors let go,
    once it holds `SNAPSHOT_BATCH_BYTES`."""
    monkeypatch.setattr(transfer, "SNAPSHOT_BATCH_BYTES", 2 * 16 * 4)  # two of the tensors below
    made: list[weakref.ref] = []
    alive = []

    def source():
        for k in range(7):
            alive.append(sum(ref() is not None for ref in made))
            tensor = torch.full((16,), float(k))
            made.append(weakref.ref(tensor.untyped_storage()))  # alive while any tensor uses the memory
            yield f"w{k}", tensor

    copies = transfer.snapshot(source())
    assert [n for n, _ in copies] == [f"w{k}" for k in range(7)]
    assert all(torch.equal(t, torch.full((16,), float(k))) for k, (_, t) in enumerate(copies))
    assert max(alive) <= 2
    assert sum(ref() is not None for ref in made) == 0
