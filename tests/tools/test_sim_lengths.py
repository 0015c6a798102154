"""Response lengths for the simulator (tools/sim/lengths.py): sampler and trace replay."""

from __future__ import annotations

import json
import random

import pytest

from tidal.tools.sim.lengths import LengthModel, replay, replay_rewards


def _mean(groups: list[list[int]]) -> float:
    flat = [n for g in groups for n in g]
    return sum(flat) / len(flat)


def test_sampler_is_deterministic_with_a_seed():
    model = LengthModel(mean_tokens=500)
    a = model.sample(step=3, num_prompts=16, group_size=8, rng=random.Random(7))
    b = model.sample(step=3, num_prompts=16, group_size=8, rng=random.Random(7))
    c = model.sample(step=3, num_prompts=16, group_size=8, rng=random.Random(8))
    assert a == b != c
    assert len(a) == 16 and all(len(g) == 8 for g in a)
    assert all(isinstance(n, int) and n >= 1 for g in a for n in g)


def test_mean_is_kept_and_spreads_are_where_they_belong():
    groups = LengthModel(mean_tokens=800).sample(step=0, num_prompts=4000, group_size=4, rng=random.Random(0))
    assert _mean(groups) == pytest.approx(800, rel=0.05)  # the lognormal factors have mean 1
    alike = LengthModel(mean_tokens=800, group_sigma=0).sample(step=0, num_prompts=50, group_size=4, rng=random.Random(0))
    assert all(len(set(g)) == 1 for g in alike) and len({g[0] for g in alike}) > 10  # prompts differ, groups do not
    fixed = LengthModel(mean_tokens=300, prompt_sigma=0, group_sigma=0).sample(step=0, num_prompts=3, group_size=2, rng=random.Random(0))
    assert fixed == [[300, 300]] * 3


def test_truncation_at_max_new_tokens():
    model = LengthModel(mean_tokens=1000, max_new_tokens=1024)
    lengths, cut = model.sample_flagged(step=0, num_prompts=500, group_size=4, rng=random.Random(1))
    flat = [n for g in lengths for n in g]
    flags = [f for g in cut for f in g]
    assert max(flat) == 1024
    assert 0.1 < sum(flags) / len(flags) < 0.6
    assert all(n == 1024 for n, f in zip(flat, flags) if f)
    assert lengths == model.sample(step=0, num_prompts=500, group_size=4, rng=random.Random(1))
    _, none_cut = LengthModel(mean_tokens=1000).sample_flagged(step=0, num_prompts=50, group_size=4, rng=random.Random(1))
    assert not any(f for g in none_cut for f in g)


def test_drift_increases_the_mean():
    model = LengthModel(mean_tokens=400, drift=0.05)
    assert model.mean_at(20) == pytest.approx(400 * 1.05**20)
    early = model.sample(step=0, num_prompts=2000, group_size=4, rng=random.Random(2))
    late = model.sample(step=20, num_prompts=2000, group_size=4, rng=random.Random(2))
    assert _mean(late) / _mean(early) == pytest.approx(1.05**20, rel=0.02)  # same draws, scaled


def test_bad_parameters_are_value_errors():
    with pytest.raises(ValueError, match="drift"):
        LengthModel(mean_tokens=100, drift=-1)
    with pytest.raises(ValueError, match="mean_tokens"):
        LengthModel(mean_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        LengthModel(mean_tokens=100, max_new_tokens=0)


def test_replay_reads_a_trace(tmp_path):
    path = tmp_path / "lengths.jsonl"
    rows = [{"step": 1, "lengths": [[10, 20], [30, 40]]}, {"step": 2, "lengths": [[5], [6], [7]]}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert replay(path) == {1: [[10, 20], [30, 40]], 2: [[5], [6], [7]]}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not JSON"),
        ('{"step": 2}', "a row is"),
        ('{"step": 2, "lengths": [[1, -3]]}', "integers >= 0"),
        ('{"step": 2, "lengths": [[]]}', "non-empty lists"),
        ('{"step": -1, "lengths": [[1]]}', "step must be"),
        ('{"step": 1, "lengths": [[1]]}', "step 1 appears twice"),
    ],
)
def test_replay_errors_name_file_and_line(tmp_path, bad, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"step": 1, "lengths": [[1, 2]]}\n' + bad + "\n")
    with pytest.raises(ValueError, match=message) as err:
        replay(path)
    assert f"{path}:2:" in str(err.value)


def test_replay_rewards_reads_the_rewards_beside_the_lengths(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "lengths": [[10, 20]], "rewards": [[1, 0.5]]}, {"step": 2, "lengths": [[5]]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert replay_rewards(path) == {1: [[1.0, 0.5]]}  # step 2 has none: scored as without a trace
    path.write_text(json.dumps(rows[0]) + "\n" + '{"step": 2, "lengths": [[5, 6]], "rewards": [[1.0]]}\n')
    with pytest.raises(ValueError, match=f"{path}:2: rewards must be grouped as lengths"):
        replay_rewards(path)
    path.write_text('{"step": 2, "lengths": [[5]], "rewards": [[true]]}\n')
    with pytest.raises(ValueError, match="finite numbers"):
        replay_rewards(path)


def test_replay_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="nowhere.jsonl"):
        replay(tmp_path / "nowhere.jsonl")
