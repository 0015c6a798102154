"""The rollout stage's rows: trajectories into the `train` partition and back."""

from __future__ import annotations

from tidal.flow.rollout import TRAJECTORY_COLUMNS, put_trajectories, trajectories_of
from tidal.flow.store import Store
from tidal.flow.trajectory import Trajectory


def _trajectory(prompt, tokens, version, *, group, env=()):
    t = Trajectory(prompt_ids=list(prompt), group=group, meta={"answer": str(group)})
    t.extend(tokens[:1], [-0.5] * len(tokens[:1]), version)
    t.append_env(env)
    t.extend(tokens[1:], [-0.25] * len(tokens[1:]), version + 1)
    t.finish_reason = "stop"
    return t


def test_trajectories_round_trip_through_the_store_whatever_the_puts_widths():
    store = Store()
    store.create_partition("train", consumers=["c", "d"])
    first = [_trajectory([1, 5], [7, 8, 2], 3, group="a"), _trajectory([1, 5, 6, 6], [9], 3, group="a", env=[4, 4])]
    second = [_trajectory([1], [7], 4, group="b"), Trajectory(prompt_ids=[1, 2, 3], group="b", finish_reason="length")]
    put_trajectories(store, first)  # continuations padded to 5 tokens (2 of them environment tokens)
    put_trajectories(store, second)  # padded to 1: rows of both puts come back in one batch
    for consumer, num_rows in (("c", 4), ("d", 2)):  # rows of both puts (two widths); rows of the first only
        batch = store.get(consumer, "train", [*TRAJECTORY_COLUMNS, "meta"], num_rows)
        for want, have in zip(first + second, trajectories_of(batch), strict=False):
            assert (have.prompt_ids, have.tokens, have.logprobs, have.versions) == (want.prompt_ids, want.tokens, want.logprobs, want.versions)
            assert (have.group, have.finish_reason, have.meta) == (want.group, want.finish_reason, want.meta)
        assert len(batch) == num_rows and batch.versions == [3, 3, 4, None][:num_rows]  # a row's version is its oldest token's
