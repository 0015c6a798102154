"""The training prompt stream (`tools.train.Prompts`) and the held-out set never share a seed.

Chunk k of the stream (prompts 512k .. 512k + 511) is drawn with seed `seed * 7919 + k`, the
held-out set with `seed + EVAL_SEED_OFFSET`: for every seed from 0 to 126 the two met at
chunk k = 1,000,003 - 7918 * seed (seed 126: chunk 2,335, about 1.2M prompts in), and that
chunk began with the held-out prompts, in order. That one chunk per seed now takes another
seed; every other chunk keeps its prompts (the quickstart's and the benchmarks' runs).
"""

from __future__ import annotations

import itertools

import pytest

from tidal.engines.tiny import CharTokenizer
from tidal.tools.config import load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.train import EVAL_SEED_OFFSET, Prompts, chunk_seed, held_out_prompts, task_prompts

COUNTDOWN = ["task.name=countdown", "model.max_positions=128"]


def _cfg(*overrides: str):
    return load_config(resolve_recipe("quickstart_cpu"), list(overrides))


def _stream(cfg, start: int, n: int) -> list[str]:
    return [item["prompt"] for item in itertools.islice(Prompts(cfg, CharTokenizer(), set(), position=start), n)]


def _colliding_chunk(seed: int) -> int:
    return seed + EVAL_SEED_OFFSET - 7919 * seed


def test_no_training_chunk_has_the_held_out_sets_seed():
    for seed in range(0, 127):
        k = _colliding_chunk(seed)
        assert k >= 0 and seed * 7919 + k == seed + EVAL_SEED_OFFSET  # where the plain formula meets it
        assert abs(chunk_seed(seed, k)) != seed + EVAL_SEED_OFFSET
        assert all(chunk_seed(seed, j) == seed * 7919 + j for j in (0, 1, k - 1, k + 1))  # its neighbours keep theirs
    assert _colliding_chunk(127) < 0  # from seed 127 on, no chunk meets it


@pytest.mark.parametrize("overrides", [[], COUNTDOWN], ids=["arithmetic", "countdown"])
def test_the_chunk_that_met_the_held_out_set_no_longer_repeats_it(overrides):
    cfg = _cfg("seed=126", *overrides)
    held = [item["prompt"] for item in held_out_prompts(cfg)[0]]
    k = _colliding_chunk(126)
    assert [item["prompt"] for item in task_prompts(cfg, len(held), seed=126 * 7919 + k)] == held  # what that chunk drew
    drawn = _stream(cfg, k * 512, 512)
    assert sum(a == b for a, b in zip(drawn, held)) < len(held) // 10  # the same prompt in the same place: by chance only
    assert _stream(cfg, (k + 1) * 512, 3) == [item["prompt"] for item in task_prompts(cfg, 3, seed=126 * 7919 + k + 1)]


@pytest.mark.parametrize(("overrides", "first"), [
    (["seed=0"], ["6+6=", "4-8=", "6-4=", "5+9=", "8-2=", "2-1="]),
    (["seed=1", *COUNTDOWN], ["8 3 6>1:", "9 2 5>90:", "1 9 10>20:", "9 9 7>72:", "3 5 2>7:", "3 4 2>14:"]),
], ids=["quickstart", "countdown"])  # fmt: skip
def test_the_first_chunks_prompts_are_unchanged(overrides, first):
    cfg = _cfg(*overrides)
    assert _stream(cfg, 0, len(first)) == first  # as the quickstart and the benchmarks drew them
    drawn = _stream(cfg, 0, 4 * 512)
    assert drawn == [item["prompt"] for k in range(4) for item in task_prompts(cfg, 512, seed=cfg.seed * 7919 + k)]
    warm_start = 10**9 // 512  # the warm start's region keeps its prompts too
    assert _stream(cfg, 10**9, 2) == [item["prompt"] for item in task_prompts(cfg, 512, seed=cfg.seed * 7919 + warm_start)[10**9 % 512 :][:2]]
