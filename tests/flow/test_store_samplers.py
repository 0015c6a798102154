"""Samplers composed with one another: groups under staleness, partial gets, tags, specs."""

from __future__ import annotations

import re

import pytest
import torch

from tidal.flow.store import Grouped, SeqlenBalanced, StalenessFilter, Store, StoreTimeout, TaggedFirst
from tidal.flow.store.samplers import Selection, Sequential, from_spec, to_spec


def make(consumers=("c",)) -> Store:
    store = Store()
    store.create_partition("p", consumers=list(consumers))
    return store


def dropped(store: Store, consumer: str = "c") -> int:
    return store.consumer_counts("p", consumer)["dropped"]


# StalenessFilter over Grouped ---------------------------------------------------------------
def test_staleness_over_groups_drops_a_group_with_an_old_row_as_a_whole():
    store = make()
    store.put("p", {"x": [0, 1, 2, 3]}, groups=["old", "old", "new", "new"], versions=[0, 2, 2, 2])
    store.set_version(2)
    batch = store.get("c", "p", ["x"], 2, sampler=StalenessFilter(1, Grouped(2)), timeout=0)
    assert batch.indexes == [2, 3] and dropped(store) == 2  # row 1 is fresh, but its group is not
    with pytest.raises(StoreTimeout, match="0 of 2 rows were ready"):  # nothing stranded
        store.get("c", "p", ["x"], 2, sampler=StalenessFilter(1, Grouped(2)), timeout=0)


def test_staleness_over_groups_drops_an_incomplete_old_group_once_it_is_complete():
    store = make()
    store.put("p", {"x": [0, 1]}, groups=["g", "h"], versions=[0, 2])
    store.set_version(2)
    sampler = StalenessFilter(1, Grouped(2))
    with pytest.raises(StoreTimeout):
        store.get("c", "p", ["x"], 2, sampler=sampler, timeout=0)
    assert dropped(store) == 0  # g waits for its second row: dropping row 0 now would strand it
    store.put("p", {"x": [2, 3]}, groups=["g", "h"], versions=[2, 2])
    assert store.get("c", "p", ["x"], 2, sampler=sampler, timeout=0).indexes == [1, 3]
    assert dropped(store) == 2
    with pytest.raises(StoreTimeout, match="0 of 2 rows were ready"):
        store.get("c", "p", ["x"], 2, sampler=sampler, timeout=0)


def test_staleness_over_groups_holds_a_group_with_an_old_row_whole():
    store = make()
    store.put("p", {"x": [0, 1, 2, 3]}, groups=["old", "old", "new", "new"], versions=[2, 0, 2, 2])
    store.set_version(2)
    sampler = StalenessFilter(1, Grouped(2), hold=True)
    assert store.get("c", "p", ["x"], 4, sampler=sampler, partial=True, timeout=0).indexes == [2, 3]
    with pytest.raises(StoreTimeout, match="2 of 2 rows were ready"):  # both rows of "old" stay, neither handed out
        store.get("c", "p", ["x"], 2, sampler=sampler, timeout=0)
    assert dropped(store) == 0


def test_staleness_under_other_samplers_still_judges_whole_groups():
    store = make()
    store.put("p", {"x": [torch.zeros(n) for n in (1, 2, 3, 4)]}, groups=["a", "a", "b", "b"], versions=[0, 2, 2, 2])
    store.set_version(2)
    sampler = StalenessFilter(1, SeqlenBalanced(2, "x", Grouped(2)))
    assert sorted(store.get("c", "p", ["x"], 2, sampler=sampler, timeout=0).indexes) == [2, 3]
    assert dropped(store) == 2


def test_staleness_without_groups_judges_each_row():
    store = make()
    store.put("p", {"x": [0, 1, 2]}, groups=["a", "a", "a"], versions=[0, 2, 2])
    store.set_version(2)
    assert store.get("c", "p", ["x"], 2, sampler=StalenessFilter(1), timeout=0).indexes == [1, 2]
    assert dropped(store) == 1


# SeqlenBalanced with partial ----------------------------------------------------------------
def test_seqlen_balanced_partial_returns_the_ready_rows_that_fill_every_rank():
    store = make()
    store.put("p", {"tokens": [torch.zeros(n) for n in (9, 1, 8)]})
    sampler = SeqlenBalanced(num_ranks=2, length_column="tokens")
    batch = store.get("c", "p", ["tokens"], 8, sampler=sampler, partial=True, timeout=0)
    assert batch.indexes == [0, 1]  # two of the three: one per rank
    with pytest.raises(StoreTimeout, match="1 of 8"):  # one row cannot fill two ranks
        store.get("c", "p", ["tokens"], 8, sampler=sampler, partial=True, timeout=0)
    store.put("p", {"tokens": [torch.zeros(n) for n in (2, 7, 3)]})
    batch = store.get("c", "p", ["tokens"], 8, sampler=sampler, partial=True, timeout=0)
    ranks = [sum(len(t) for t in batch.columns["tokens"][r * 2 : (r + 1) * 2]) for r in range(2)]
    assert sorted(batch.indexes) == [2, 3, 4, 5] and ranks == [10, 10]  # 8+2 and 7+3


def test_seqlen_balanced_partial_over_groups_takes_whole_groups_that_fill_every_rank():
    store = make()
    store.put("p", {"tokens": [torch.zeros(1)] * 3}, groups=["a", "a", "a"])
    sampler = SeqlenBalanced(num_ranks=2, length_column="tokens", inner=Grouped(3))
    with pytest.raises(StoreTimeout):  # one group of 3 cannot be split evenly over 2 ranks
        store.get("c", "p", ["tokens"], 12, sampler=sampler, partial=True, timeout=0)
    store.put("p", {"tokens": [torch.zeros(1)] * 6}, groups=["b", "b", "b", "c", "c", "c"])
    batch = store.get("c", "p", ["tokens"], 12, sampler=sampler, partial=True, timeout=0)
    assert sorted(batch.indexes) == list(range(6))  # a and b; c waits for a partner


def test_seqlen_balanced_whole_batch_is_unchanged_without_partial():
    store = make()
    store.put("p", {"tokens": [torch.zeros(1)] * 3})
    with pytest.raises(StoreTimeout, match="3 of 4"):
        store.get("c", "p", ["tokens"], 4, sampler=SeqlenBalanced(2, "tokens"), timeout=0)


# TaggedFirst over Grouped -------------------------------------------------------------------
def test_tagged_first_over_groups_hands_out_tagged_groups_whole():
    store = make()
    store.put("p", {"x": [0, 1, 2, 3]}, groups=["a", "a", "b", "b"], tags=[{}, {}, {}, {"resume": True}])
    batch = store.get("c", "p", ["x"], 2, sampler=TaggedFirst("resume", Grouped(2)), timeout=0)
    assert batch.indexes == [2, 3] and batch.groups == ["b", "b"]
    assert store.get("c", "p", ["x"], 2, sampler=TaggedFirst("resume", Grouped(2)), timeout=0).indexes == [0, 1]


def test_tagged_first_over_groups_fills_the_rest_with_whole_groups():
    store = make()
    store.put("p", {"x": list(range(6))}, groups=["a", "a", "b", "b", "c", "c"], tags=[{}, {}, {}, {"resume": True}, {}, {}])
    batch = store.get("c", "p", ["x"], 4, sampler=TaggedFirst("resume", Grouped(2)), timeout=0)
    assert batch.indexes == [2, 3, 0, 1]


def test_tagged_first_over_groups_waits_for_an_incomplete_tagged_group():
    store = make()
    store.put("p", {"x": [0, 1, 2]}, groups=["a", "a", "b"], tags=[{}, {}, {"resume": True}])
    sampler = TaggedFirst("resume", Grouped(2))
    assert store.get("c", "p", ["x"], 4, sampler=sampler, partial=True, timeout=0).indexes == [0, 1]
    store.put("p", {"x": [3]}, groups=["b"])
    assert store.get("c", "p", ["x"], 2, sampler=sampler, timeout=0).indexes == [2, 3]


def test_tagged_first_over_groups_refuses_a_batch_size_that_splits_a_group():
    store = make()
    store.put("p", {"x": [0, 1]}, groups=["a", "a"], tags=[{"resume": True}, {}])
    with pytest.raises(ValueError, match="batch_size 3 is not a multiple of group_size 2"):
        store.get("c", "p", ["x"], 3, sampler=TaggedFirst("resume", Grouped(2)), timeout=0)


def test_tagged_first_over_stale_groups_takes_tagged_groups_unfiltered():
    store = make()
    store.put("p", {"x": [0, 1, 2, 3, 4, 5]}, groups=["a", "a", "b", "b", "c", "c"], versions=[0, 5, 0, 5, 5, 5], tags=[{}, {}, {}, {"resume": True}, {}, {}])
    store.set_version(5)
    batch = store.get("c", "p", ["x"], 4, sampler=TaggedFirst("resume", StalenessFilter(1, Grouped(2))), timeout=0)
    assert batch.indexes == [2, 3, 4, 5] and dropped(store) == 2  # b (tagged) unfiltered; a dropped whole


# Specs --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampler",
    [
        Sequential(),
        Grouped(4),
        StalenessFilter(2, Grouped(4), hold=True, at_version=7),
        SeqlenBalanced(4, "tokens", StalenessFilter(0)),
        TaggedFirst("resume", SeqlenBalanced(2, "tokens", Grouped(2))),
    ],
)
def test_every_sampler_and_its_options_round_trip_through_a_spec(sampler):
    spec = to_spec(sampler)
    assert to_spec(from_spec(spec)) == spec
    assert type(from_spec(spec)) is type(sampler)
    if not isinstance(sampler, Sequential):
        assert from_spec(spec) == sampler


def test_a_subclass_of_a_built_in_sampler_is_not_sent_as_the_built_in():
    class Reversed(Sequential):
        def select(self, rows, batch_size, partial, ctx):
            return Selection(rows.indexes[::-1][:batch_size])

    with pytest.raises(ValueError, match="Reversed cannot be sent"):
        to_spec(Reversed())
    with pytest.raises(ValueError, match="Reversed cannot be sent"):
        to_spec(StalenessFilter(1, Reversed()))


def test_from_spec_refuses_a_hold_that_is_not_a_boolean():
    spec = to_spec(StalenessFilter(1))
    assert from_spec({**spec, "hold": True}).hold is True
    with pytest.raises(ValueError, match="hold"):
        from_spec({**spec, "hold": "false"})


@pytest.mark.parametrize("sampler", [StalenessFilter(1), SeqlenBalanced(2, "tokens"), TaggedFirst("resume")], ids=["staleness", "seqlen", "tagged_first"])
def test_from_spec_without_an_inner_sampler_names_the_kind_and_the_key(sampler):
    """Was "sampler spec must be a map, got None", naming neither the sampler nor the key."""
    spec = {key: value for key, value in to_spec(sampler).items() if key != "inner"}
    kind = spec["kind"]
    with pytest.raises(ValueError, match=rf"sampler '{kind}' spec lacks inner, the sampler it wraps"):
        from_spec(spec)
    with pytest.raises(ValueError, match=rf"sampler '{kind}' needs inner to be a sampler spec \(a map\), got 3"):
        from_spec({**spec, "inner": 3})


def test_a_sampler_reading_a_column_a_row_lacks_is_told_which_row_and_column():
    store = make()
    store.put("p", {"x": [1, 2], "tokens": [[1], [1, 2]]})
    store.put("p", {"x": [3, 4]})
    store.put("p", {"tokens": [[1]]}, indexes=[2])  # row 3 has no tokens: was KeyError(-1)
    with pytest.raises(ValueError, match="row 3 of partition 'p' has no column 'tokens'"):
        store.get("c", "p", ["x"], 4, sampler=SeqlenBalanced(2, "tokens"), timeout=0)
    assert store.get("c", "p", ["x", "tokens"], 2, sampler=SeqlenBalanced(2, "tokens"), timeout=0).indexes == [1, 0]


def test_group_ids_given_as_a_tensor_are_refused_not_left_to_starve_grouped_gets():
    store = make()
    with pytest.raises(ValueError, match=r"groups\[0\] is a tensor .*pass groups.tolist\(\)"):
        store.put("p", {"x": [0, 1]}, groups=torch.tensor([7, 7]))  # each element hashed by identity: no group ever complete
    store.put("p", {"x": [0, 1]}, groups=torch.tensor([7, 7]).tolist())
    assert store.get("c", "p", ["x"], 2, sampler=Grouped(2), timeout=0).indexes == [0, 1]


@pytest.mark.parametrize(("make", "message"), [(lambda: Grouped(0), "Grouped needs an integer group_size >= 1, got 0"), (lambda: SeqlenBalanced(0, "n"), "SeqlenBalanced needs an integer num_ranks >= 1, got 0"), (lambda: Grouped(2.0), "got 2.0")])
def test_a_sampler_that_cuts_batches_by_zero_is_refused_when_made(make, message):
    """`from_spec` checked these, a sampler made in process did not: Grouped(0) failed at the
    first get with ZeroDivisionError."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make()
