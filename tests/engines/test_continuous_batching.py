"""The hf rollout engine's continuous batching (`refill`): rows that end are handed over at
safe points, new rows join the running batch (their own prefill, one KV cache), and every
row's logprobs are still those of a plain forward pass over it."""

from __future__ import annotations

import copy

import pytest
import torch

from tidal.engines.hf_rollout import HFRolloutEngine, mergeable
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.flow.trajectory import Trajectory

T = CharTokenizer()


def tiny(seed: int = 0):
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64, seed=seed)


def sliding_window_model():
    """A Qwen2 whose layers attend to their last 4 positions only (its cache keeps those)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=T.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        max_position_embeddings=64, use_sliding_window=True, sliding_window=4, max_window_layers=0,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _reference_logprobs(model, trajectory: Trajectory) -> list[float]:
    ids = torch.tensor([trajectory.prompt_ids + trajectory.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    p = len(trajectory.prompt_ids)
    return [logprobs[p - 1 + j, tok].item() for j, tok in enumerate(trajectory.tokens)]


class Feeder:
    """A `Refill` that gives the rows of `waves` one wave per `more()` call, and records what ends."""

    def __init__(self, waves: list[list[Trajectory]], engine: HFRolloutEngine | None = None) -> None:
        self.waves = list(waves)
        self.ended: list[Trajectory] = []
        self.calls: list[tuple[str, int]] = []
        self.engine = engine

    def done(self, trajectories):
        assert all(t.done for t in trajectories)
        self.ended += trajectories
        self.calls.append(("done", len(trajectories)))

    def more(self):
        self.calls.append(("more", len(self.waves)))
        return self.waves.pop(0) if self.waves else []


def _rows(prompts: list[str], copies: int = 1) -> list[Trajectory]:
    return [Trajectory(prompt_ids=T.encode(p)) for p in prompts for _ in range(copies)]


def test_rows_that_join_a_running_batch_get_the_logprobs_of_a_plain_forward_pass():
    torch.manual_seed(0)
    model = tiny(3)
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=2)
    first = _rows(["1+2=", "13-14="], copies=2)
    # waves narrower and wider than the running batch's cache: each side gets left-padded
    waves = [_rows(["7="]), _rows(["123+456+789=", "5="], copies=3), _rows(["99*99="])]
    feeder = Feeder(waves)
    out = engine.generate(first, max_new_tokens=12, refill=feeder)
    joined = [t for wave in waves for t in wave]
    assert out == first + joined  # the rows given, then those that joined
    assert len(feeder.ended) == len(out) and {id(t) for t in feeder.ended} == {id(t) for t in out}  # each handed over once
    for t in out:
        assert t.done and 1 <= t.num_generated <= 12 and T.eos_id not in t.tokens[:-1]
        assert t.finish_reason == ("stop" if t.tokens[-1] == T.eos_id else "length")
        assert t.logprobs == pytest.approx(_reference_logprobs(model, t), abs=1e-4)
    assert ("more", 0) in feeder.calls  # asked again once every wave was given


def never_ends(model, forwards: list | None = None):
    """`model`, whose end token is never sampled (every row runs its whole budget); each
    forward's input shape goes into `forwards`."""
    original = model.forward

    def forward(*args, **kwargs):
        if forwards is not None:
            forwards.append(kwargs["input_ids"].shape)
        out = original(*args, **kwargs)
        out.logits[..., T.eos_id] = -1e9
        return out

    model.forward = forward
    return model


def test_rows_join_when_others_end_and_share_the_batchs_forward_passes():
    forwards: list = []
    model = never_ends(tiny(1), forwards)
    engine = HFRolloutEngine(model, eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=4)
    fresh, later = _rows(["1+2="], copies=2), _rows(["3+4="], copies=2)
    nearly = _rows(["5+6="], copies=2)
    for t in nearly:  # 6 of their 10 tokens decoded already: they end after 4 more
        t.extend([7] * 6, [-1.0] * 6, 0)
    feeder = Feeder([later])
    engine.generate(fresh + nearly, max_new_tokens=10, refill=feeder)
    # one prefill (a group's rows run their input once); 3 steps end `nearly`, and `later`
    # joins in their place (its prefill, its first token); 6 steps with all four rows end
    # `fresh`, and `later` (4 tokens behind) needs 3 more alone
    assert [s[0] for s in forwards] == [2, 4, 4, 4, 1] + [4] * 6 + [2] * 3
    assert feeder.calls[:2] == [("done", 2), ("more", 1)] and feeder.calls.count(("done", 2)) == 3
    assert all(t.num_generated == 10 for t in fresh + nearly + later)


def test_a_pause_keeps_every_rows_tokens_and_a_later_call_resumes_them():
    torch.manual_seed(4)
    model = tiny(2)
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=2)
    first, later = _rows(["1+2="], copies=3), _rows(["45-6="], copies=3)
    safe_points = []
    engine.generate(first, max_new_tokens=9, refill=Feeder([later]), should_pause=lambda: safe_points.append(1) or len(safe_points) >= 2)
    assert all(t.done or t.finish_reason is None for t in first + later)
    assert any(not t.done for t in first + later)
    engine.generate(first + later, max_new_tokens=9)  # resumed: a fresh prefill
    for t in first + later:
        assert t.done and t.logprobs == pytest.approx(_reference_logprobs(model, t), abs=1e-4)


def test_an_engine_whose_cache_cannot_take_rows_asks_for_more_only_when_its_batch_is_empty():
    model = sliding_window_model()
    engine = HFRolloutEngine(model, eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=1)
    probe = Trajectory(prompt_ids=T.encode("1="))
    cache = engine.model(input_ids=torch.tensor([probe.prompt_ids]), use_cache=True).past_key_values
    assert not mergeable(cache)  # sliding-window layers drop old positions
    first, later = _rows(["1+2="], copies=2), _rows(["3+4="])
    feeder = Feeder([later])
    out = engine.generate(first, max_new_tokens=6, refill=feeder)
    assert out == first + later and all(t.done for t in out)
    asked = feeder.calls.index(("more", 1))
    assert sum(n for kind, n in feeder.calls[:asked] if kind == "done") == 2  # `first` had ended


def test_rows_from_refill_are_checked_like_the_rows_given():
    engine = HFRolloutEngine(never_ends(tiny()), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=1)
    first = _rows(["1+2=", "3="])
    first[1].extend([5, 5, 5], [-1.0] * 3, 0)  # ends after one more token; then `more()` gives first[0] again
    with pytest.raises(ValueError, match="same object as one already decoding"):
        engine.generate(first, max_new_tokens=4, refill=Feeder([[first[0]]]))
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.generate(_rows(["1="]), max_new_tokens=4, refill=Feeder([[Trajectory(prompt_ids=[])]]))
    ended = Trajectory(prompt_ids=T.encode("2="), finish_reason="stop")
    over = Trajectory(prompt_ids=T.encode("3="))
    over.extend([5, 6], [-1.0, -1.0], 0)
    out = engine.generate(_rows(["4="]), max_new_tokens=2, refill=Feeder([[ended, over]]))
    assert ended.tokens == [] and over.finish_reason == "length" and len(out) == 1  # nothing to decode in them
