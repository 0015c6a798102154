"""Engines: tiny model + tokenizer, hf rollout (logprobs, padding, EOS, budget, pause/resume), rewards, tasks, and both engines on a real GPU (the torch train engine: test_torch_train.py)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.engines.rewards import arithmetic, countdown, exact_match, resolve_reward, score
from tidal.engines.tasks import arithmetic as arithmetic_prompts
from tidal.engines.tasks import countdown as countdown_prompts
from tidal.engines.tasks import problem_key
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2, load_model, save_model
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import Trajectory, to_token_batch

T = CharTokenizer()


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32, attention: str = "sdpa"):
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=seed, attention=attention).to(dtype)


def test_tokenizer_round_trip_and_errors(tmp_path):
    ids = T.encode("12+7=19")
    assert ids[0] == T.bos_id and T.decode(ids) == "12+7=19"
    assert T.decode([T.pad_id, *ids, T.eos_id], skip_special=False) == "<pad><bos>12+7=19<eos>"
    with pytest.raises(ValueError, match="'#' is not in the tokenizer"):
        T.encode("1#2")
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):  # was decoded as <eos>
        T.decode([-1, 5], skip_special=False)
    T.save(tmp_path)
    assert CharTokenizer.load(tmp_path).encode("a=b") == T.encode("a=b")


def test_tiny_model_size_determinism_and_save_load(tmp_path):
    recipe = OmegaConf.load(Path(__file__).parents[2] / "recipes" / "quickstart_cpu.yaml").model
    shape = {k: recipe[k] for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")}
    quickstart = build_tiny_qwen2(T.vocab_size, **shape)  # the quickstart recipe's model is "about 1-5M parameters"
    assert 1_000_000 <= sum(p.numel() for p in quickstart.parameters()) <= 5_000_000
    a, b = tiny(3), tiny(3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    save_model(a, T, tmp_path)
    loaded, tok = load_model(tmp_path)
    x = torch.tensor([T.encode("3+4=")])
    assert torch.allclose(a(x).logits, loaded(x).logits) and tok.alphabet == T.alphabet
    eager, _ = load_model(tmp_path, attention="eager")  # a checkpoint does not record it
    assert eager.config._attn_implementation == "eager" and torch.allclose(a(x).logits, eager(x).logits, atol=1e-5)


def _reference_logprobs(model, trajectory):
    ids = torch.tensor([trajectory.ids])
    logits = model(ids).logits[0, :-1]
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)  # a float64 model's in float64
    p = len(trajectory.prompt_ids)
    return [logprobs[p - 1 + j, tok].item() for j, tok in enumerate(trajectory.tokens)]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_rollout_logprobs_match_an_unpadded_forward_pass(attention):
    torch.manual_seed(0)
    model = tiny(attention=attention)
    assert model.config._attn_implementation == attention
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=3)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-14=", "7="]]
    engine.generate(trajectories, max_new_tokens=7)
    for t in trajectories:
        assert t.done and 1 <= t.num_generated <= 7
        assert t.logprobs == pytest.approx(_reference_logprobs(model, t), abs=1e-4)
        assert t.finish_reason == ("stop" if t.tokens[-1] == T.eos_id else "length")
        assert T.eos_id not in t.tokens[:-1]  # nothing after EOS


def _bias_token(model, token: int) -> torch.Tensor:
    """Add `bias[token]` to every logit the model returns (set the bias to steer sampling)."""
    bias = torch.zeros(T.vocab_size)
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = out.logits + bias.to(out.logits.dtype)
        return out

    model.forward = forward
    return bias


def test_rollout_stops_at_eos_and_respects_the_budget():
    model = tiny()
    bias = _bias_token(model, T.eos_id)
    engine = HFRolloutEngine(model, eos_id=T.eos_id, pad_id=T.pad_id)
    bias[T.eos_id] = 50.0  # EOS overwhelmingly likely
    t = Trajectory(prompt_ids=T.encode("1+1="))
    engine.generate([t], max_new_tokens=5)
    assert t.tokens == [T.eos_id] and t.finish_reason == "stop"
    bias[T.eos_id] = -1e9  # EOS never: the budget ends it
    t = Trajectory(prompt_ids=T.encode("1+1="))
    engine.generate([t], max_new_tokens=5)
    assert t.num_generated == 5 and t.finish_reason == "length"


def test_rollout_stops_at_any_of_several_stop_tokens():
    model = tiny()
    bias = _bias_token(model, T.eos_id)
    stop = T.encode("?", add_bos=False)[0]  # a second stop token, as an instruct model's <|im_end|>
    engine = HFRolloutEngine(model, eos_id=[T.eos_id, stop], pad_id=T.pad_id)
    bias[T.eos_id], bias[stop] = -1e9, 50.0
    t = Trajectory(prompt_ids=T.encode("1+1="))
    engine.generate([t], max_new_tokens=5)
    assert t.tokens == [stop] and t.finish_reason == "stop"
    with pytest.raises(ValueError, match="eos_id must be a token id or a non-empty list"):
        HFRolloutEngine(model, eos_id=[], pad_id=T.pad_id)


def test_partial_rollout_pauses_loads_new_weights_and_resumes():
    torch.manual_seed(1)
    model = tiny(0)
    _bias_token(model, T.eos_id)[T.eos_id] = -1e9  # no EOS: the generation runs its whole budget
    engine = HFRolloutEngine(model, eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=2)
    trajectory = Trajectory(prompt_ids=T.encode("5+5="))
    calls = []
    engine.generate([trajectory], max_new_tokens=6, should_pause=lambda: calls.append(1) or True)
    assert len(calls) == 1 and trajectory.versions == [0, 0] and not trajectory.done  # paused at the first safe point
    engine.load_weights(1, tiny(7).state_dict().items())
    engine.generate([trajectory], max_new_tokens=6)  # resumes from the 2 tokens it has
    assert trajectory.done and trajectory.finish_reason == "length" and trajectory.num_generated == 6
    assert trajectory.versions == [0, 0, 1, 1, 1, 1] and trajectory.versions_used == [0, 1]
    reference = tiny(7)
    _bias_token(reference, T.eos_id)[T.eos_id] = -1e9
    resumed = Trajectory(prompt_ids=trajectory.prompt_ids + trajectory.tokens[:2])  # the new weights' part
    resumed.extend(trajectory.tokens[2:], trajectory.logprobs[2:], 1)
    assert trajectory.logprobs[2:] == pytest.approx(_reference_logprobs(reference, resumed), abs=1e-4)


def test_a_float64_models_sampled_logprobs_are_not_rounded_to_float32():
    # The decoding loop cast the logits to float32: on an H200 a float64 model's logprobs were
    # 4.8e-7 off a float64 forward (issue 40); on CPU the same cast rounds them alike.
    model = tiny(0, torch.float64)
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=3)
    torch.manual_seed(0)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-14=", "7="] for _ in range(4)]
    engine.generate(trajectories, max_new_tokens=7)
    for t in trajectories:
        assert t.logprobs == pytest.approx(_reference_logprobs(model, t), abs=1e-9)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (4, 1.0), (0, 0.6), (6, 0.8)])
def test_sampling_loop_draws_what_transformers_generate_draws(top_k, top_p):
    # No row ends early (EOS suppressed), so every decoding step samples every row, as
    # `generate` does: same seed, same tokens; a group's rows share one prefill. With top_k /
    # top_p the behavior logprobs are the cut distribution's: generate's scores, after its warpers.
    model = tiny(0, torch.float64)
    _bias_token(model, T.eos_id)[T.eos_id] = -1e9
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, temperature=0.7, top_k=top_k, top_p=top_p, chunk_tokens=2)
    _bias_token(engine.model, T.eos_id)[T.eos_id] = -1e9
    prompts = [T.encode(p) for p in ["1+2=", "13-4=", "7="] for _ in range(3)]
    torch.manual_seed(5)
    trajectories = [Trajectory(prompt_ids=p) for p in prompts]
    engine.generate(trajectories, max_new_tokens=6, should_pause=lambda: False)
    torch.manual_seed(5)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[T.pad_id] * (width - len(p)) + p for p in prompts])
    out = model.generate(
        input_ids, attention_mask=(input_ids != T.pad_id).long(), max_new_tokens=6, do_sample=True, temperature=0.7, top_k=top_k, top_p=top_p,
        pad_token_id=T.pad_id, eos_token_id=T.eos_id, output_scores=True, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    new = out.sequences[:, width:]
    assert [t.tokens for t in trajectories] == new.tolist()
    logged = torch.tensor([t.logprobs for t in trajectories])
    assert torch.allclose(logged, torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, new[..., None]).squeeze(-1), atol=1e-6)
    full = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.7, -1).gather(-1, new[..., None]).squeeze(-1)
    if top_k or top_p < 1:
        assert (logged >= full - 1e-6).all() and (logged > full + 1e-3).any()  # renormalised over the kept tokens
    else:
        assert torch.allclose(logged, full, atol=1e-6)
    assert all(t.finish_reason == "length" and t.versions == [0] * 6 for t in trajectories)


def test_rows_that_end_leave_the_batch_and_paused_rows_resume():
    torch.manual_seed(2)
    model = tiny(1)
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=2)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-4="] for _ in range(8)]
    engine.generate(trajectories, max_new_tokens=7, should_pause=lambda: True)  # pauses after 2 tokens
    assert all(t.num_generated == 2 or t.finish_reason == "stop" for t in trajectories)
    assert any(not t.done for t in trajectories) and any(t.finish_reason == "stop" for t in trajectories)  # rows end at different steps
    engine.load_weights(1, tiny(4).state_dict().items())
    engine.generate(trajectories, max_new_tokens=7)
    reference = tiny(4)
    for t in trajectories:
        assert t.done and t.finish_reason == ("stop" if t.tokens[-1] == T.eos_id else "length") and T.eos_id not in t.tokens[:-1]
        assert t.num_generated <= 7 and (t.finish_reason == "stop" or t.num_generated == 7)
        old = sum(v == 0 for v in t.versions)
        assert t.logprobs[:old] == pytest.approx(_reference_logprobs(model, t)[:old], abs=1e-4)
        assert t.logprobs[old:] == pytest.approx(_reference_logprobs(reference, t)[old:], abs=1e-4)


def test_load_weights_names_what_does_not_match():
    engine = HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id)
    weights = dict(tiny(1).state_dict())
    name = next(iter(weights))
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(1, {k: v for k, v in weights.items() if k != name}.items())
    with pytest.raises(ValueError, match="bogus"):
        engine.load_weights(1, {**weights, "bogus": torch.zeros(1)}.items())
    with pytest.raises(ValueError, match="wrong shape"):
        engine.load_weights(1, {**weights, name: torch.zeros(3)}.items())
    assert engine.version == 0
    engine.load_weights(1, weights.items())
    assert engine.version == 1 and torch.equal(engine.model.state_dict()[name], weights[name])


def test_load_weights_refuses_untied_values_for_tied_names_wrong_dtypes_and_repeats():
    engine = HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = {k: v.clone() for k, v in tiny(1).state_dict().items()}  # separate tensors, equal values: fine below
    untied = {**weights, "lm_head.weight": weights["lm_head.weight"] + 1.0}  # an untied trainer's head
    with pytest.raises(ValueError, match="'lm_head.weight' is tied to 'model.embed_tokens.weight'"):
        engine.load_weights(1, untied.items())  # the head's copy used to overwrite the given embedding
    diverged = {k: v * math.nan for k, v in weights.items()}  # NaN != NaN: the values "differ", and the message says why
    with pytest.raises(ValueError, match=r"given different values \('model.embed_tokens.weight' and 'lm_head.weight' not finite: NaN or inf\)"):
        engine.load_weights(1, diverged.items())
    with pytest.raises(ValueError, match=r"wrong dtype \['model.norm.weight'\]"):
        engine.load_weights(1, {**weights, "model.norm.weight": weights["model.norm.weight"].long()}.items())
    with pytest.raises(ValueError, match=r"given twice \['model.norm.weight'\]"):
        engine.load_weights(1, [*weights.items(), ("model.norm.weight", torch.zeros(32))])
    assert engine.version == 0 and all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # nothing copied
    engine.load_weights(1, {k: v.double() for k, v in weights.items()}.items())  # floating dtypes are cast
    assert engine.version == 1 and all(torch.equal(v, weights[k]) for k, v in engine.model.state_dict().items())


def test_generate_refuses_a_trajectory_without_a_prompt():
    engine = HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id)
    rows = [Trajectory(prompt_ids=[]), Trajectory(prompt_ids=T.encode("1+2="))]
    with pytest.raises(ValueError, match="at least one prompt token"):  # its row attended to nothing: junk tokens and logprobs
        engine.generate(rows, max_new_tokens=3)
    assert all(t.tokens == [] for t in rows)
    done = Trajectory(prompt_ids=[], finish_reason="length")  # a finished one is left alone
    engine.generate([done], max_new_tokens=3)
    assert done.tokens == []


def test_generate_refuses_one_unfinished_trajectory_given_twice():
    # `[Trajectory(...)] * n` is n names for one object: its rows' samples went into it one
    # after another, until the next failed with "the trajectory is finished ... append_env"
    engine = HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id)
    t = Trajectory(prompt_ids=T.encode("1+2="))
    with pytest.raises(ValueError, match=r"trajectories 0 and 2 are the same object"):
        engine.generate([t, Trajectory(prompt_ids=T.encode("1+2=")), t], max_new_tokens=3)
    assert t.tokens == [] and not t.done
    done = Trajectory(prompt_ids=[1], finish_reason="stop")
    engine.generate([done, done], max_new_tokens=3)  # a finished one is left alone, however often given


def test_a_temperature_that_is_not_a_positive_number_is_refused_when_the_engine_is_built():
    # nan passed `temperature <= 0`, and the first generate failed in torch.multinomial
    # with "probability tensor contains either `inf`, `nan` or element < 0"
    for temperature in (0.0, float("nan")):
        with pytest.raises(ValueError, match=f"temperature must be > 0 for sampling, got {temperature}"):
            HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id, temperature=temperature)


def test_verifiers():
    t = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"answer": "-3"})
    assert arithmetic(t, "-3") == 1.0 and arithmetic(t, " -3 ") == 1.0 and arithmetic(t, "3") == 0.0 and arithmetic(t, "abc") == 0.0
    assert exact_match(Trajectory(prompt_ids=[1], finish_reason="stop", meta={"answer": "ab"}), " ab ") == 1.0
    c = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [3, 5, 7], "target": 22})
    assert countdown(c, "3*5+7") == 1.0 and countdown(c, "(7+5)*3") == 0.1 and countdown(c, "7*3+1") == 0.0
    assert countdown(c, "7+7+8") == 0.0  # 7 twice, 8 not given
    assert countdown(c, "__import__('os')") == 0.0 and countdown(c, "3/0") == 0.0 and countdown(c, "(((") == 0.0
    assert countdown(Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [6, 3], "target": 2}), "6/3") == 1.0
    huge = "9" * 400  # not a number given, and too large for a float: 0.0 before any arithmetic, not an error
    assert countdown(c, f"{huge}/3") == 0.0 and countdown(c, f"(3/5)*{huge}") == 0.0


def test_countdown_needs_every_number_exactly_once():
    # A subset used to score 1.0 (and any lone number 0.1): on 30% of the default task's
    # prompts a shorter expression than the task asks for reached the target, 10% by one number.
    c = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [3, 5, 7], "target": 8})
    assert countdown(c, "3+5") == 0.0 and countdown(c, "7") == 0.0 and countdown(c, "3") == 0.0
    assert countdown(c, "(7-5)*3") == 0.1 and countdown(c, "(7-5)*3+0") == 0.0  # every number once, another value; 0 not given
    assert countdown(c, "3+5*7/7") == 0.0 and countdown(c, "5+3+7-7") == 0.0  # 7 twice
    repeated = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [3, 3, 5], "target": 14})
    assert countdown(repeated, "3*3+5") == 1.0 and countdown(repeated, "3*5") == 0.0  # a number given twice is used twice
    for item in countdown_prompts(200, seed=6):  # no prompt of the task is solved by fewer numbers
        t = Trajectory(prompt_ids=[1], finish_reason="stop", meta=item)
        assert not any(countdown(t, e) > 0 for r in range(1, len(item["numbers"])) for e in _expressions(item["numbers"][:r]))


def test_countdown_compares_values_exactly_however_large_the_target():
    # math.isclose's default rel_tol=1e-9 let a value off by up to target / 1e9 score 1.0
    # (a large task: num_numbers=6, max_number=100 draws targets up to 10**12).
    t = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [100000, 100000, 1], "target": 10**10 + 1})
    assert countdown(t, "100000*100000+1") == 1.0 and countdown(t, "100000*100000*1") == 0.1
    exact = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [10**9 + 7, 97, 97], "target": 10**9 + 7})
    assert countdown(exact, f"{10**9 + 7}/97*97") == 1.0  # no float rounding (1000000006.9999999 in floats)


def test_verifiers_score_pathological_outputs_zero_instead_of_failing():
    # The parser answers deep nesting with MemoryError, int() a 4300+ digit run with
    # ValueError: both used to escape, and `score` counted the built-in verifier as failed.
    c = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"numbers": [3, 5, 7], "target": 22})
    rewards, failed = score(countdown, [c] * 3, ["-" * 6000 + "3", "3" + "**3" * 3000, "3" + "*3" * 3000])
    assert rewards == [0.0, 0.0, 0.0] and failed == []
    a, zero = Trajectory(prompt_ids=[1], finish_reason="stop", meta={"answer": "19"}), Trajectory(prompt_ids=[1], finish_reason="stop", meta={"answer": "0"})
    rewards, failed = score(arithmetic, [a, a, a, zero, zero, a, zero], ["9" * 5000, "-" + "0" * 5000, "0019", "-00", "0" * 5000, "-19", "0"])
    assert rewards == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0] and failed == []  # the answer as written: no leading zeros, no "-0"


def test_a_response_with_trailing_junk_or_without_the_end_token_scores_zero():
    # The lenient arithmetic verifier (the first integer anywhere) paid 1.0 for "10c8c1" as
    # the answer to 3+7=, and an async quickstart run learnt to stop ending its answers.
    def ended(reason, meta):
        return Trajectory(prompt_ids=[1], finish_reason=reason, meta=meta)

    answer = {"answer": "10"}
    assert arithmetic(ended("stop", answer), "10") == 1.0
    for junk in ("10c8c1", "10 11", "10\n", "10=10", "1010", "+10", "010", "10.0"):
        expected = 1.0 if junk == "10\n" else 0.0  # surrounding whitespace is not junk
        assert arithmetic(ended("stop", answer), junk) == expected, junk
    assert arithmetic(ended("length", answer), "10") == 0.0  # the budget ran out before the end token
    assert arithmetic(ended(None, answer), "10") == 0.0  # unfinished: never rewarded
    assert exact_match(ended("stop", {"answer": "ab"}), "ab") == 1.0 and exact_match(ended("length", {"answer": "ab"}), "ab") == 0.0
    numbers = {"numbers": [3, 5, 7], "target": 22}
    assert countdown(ended("stop", numbers), "3*5+7") == 1.0
    assert countdown(ended("length", numbers), "3*5+7") == 0.0 and countdown(ended("length", numbers), "(7+5)*3") == 0.0
    assert countdown(ended("stop", numbers), "3*5+7\n3*5+7") == 0.0 and countdown(ended("stop", numbers), "3*5+7\njunk") == 0.0
    assert countdown(ended("stop", numbers), "3*5+7 junk") == 0.0


def test_resolve_reward_and_failing_rewards_do_not_crash():
    assert resolve_reward("arithmetic") is arithmetic
    assert resolve_reward("math:isfinite") is math.isfinite
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_reward("math:nope")
    for spec in (".relative:f", ":f", "math:"):  # raised TypeError / a message naming neither the spec nor the form
        with pytest.raises(ValueError, match=rf"reward '{spec}': .*module:function"):
            resolve_reward(spec)

    def flaky(trajectory, text):
        if text == "boom":
            raise RuntimeError("boom")
        return float("nan") if text == "nan" else 1.0

    rows = [Trajectory(prompt_ids=[1]) for _ in range(3)]
    rewards, failed = score(flaky, rows, ["ok", "boom", "nan"])
    assert rewards == [1.0, 0.0, 0.0] and failed == [1, 2]


def test_a_reward_beyond_float32_fails_its_row_and_each_kind_of_failure_is_logged_once(caplog):
    def huge(trajectory, text):
        if text.startswith("raise"):
            raise KeyError(f"no answer in {text!r}")  # a message that differs per row
        return float(text)

    rows = [Trajectory(prompt_ids=[1]) for _ in range(5)]
    with caplog.at_level("WARNING", logger="tidal.engines.rewards"):
        rewards, failed = score(huge, rows, ["1e39", "-3.4e38", "raise 1", "raise 2", "1e38"])
    assert rewards == [0.0, -3.4e38, 0.0, 0.0, 1e38] and failed == [0, 2, 3]  # 1e39 was stored as inf, then NaN advantages
    assert torch.tensor(rewards, dtype=torch.float32).isfinite().all()
    messages = [r.getMessage() for r in caplog.records if "'huge' failed" in r.getMessage()]
    assert len(messages) == 2 and "beyond float32's range" in messages[0] and "KeyError" in messages[1]


def test_tasks_are_deterministic_and_correct():
    a = arithmetic_prompts(50, seed=1, max_value=9)
    assert a == arithmetic_prompts(50, seed=1, max_value=9) and a != arithmetic_prompts(50, seed=2, max_value=9)
    for item in a:
        x, op, y = item["prompt"][0], item["prompt"][1], item["prompt"][2:-1]
        assert int(item["answer"]) == (int(x) + int(y) if op == "+" else int(x) - int(y))
    for item in countdown_prompts(20, seed=3):
        expression_exists = any(countdown(Trajectory(prompt_ids=[1], finish_reason="stop", meta=item), e) == 1.0 for e in _expressions(item["numbers"]))
        assert expression_exists and item["target"] > 0
        assert countdown(Trajectory(prompt_ids=[1], finish_reason="stop", meta=item), item["answer"]) == 1.0  # the warm start's reference solves it
    small = countdown_prompts(200, seed=4, num_numbers=2, max_number=5)
    assert all(len(item["numbers"]) == 2 and max(item["numbers"]) <= 5 for item in small)
    assert all(countdown(Trajectory(prompt_ids=[1], finish_reason="stop", meta=item), item["answer"]) == 1.0 for item in small)
    assert any("(" in item["answer"] for item in countdown_prompts(50, seed=5))  # a product of a sum keeps its brackets


def test_task_arguments_out_of_range_are_refused_naming_them():
    # they failed inside random with "empty range for randrange() (0, 0, 0)" or an IndexError
    with pytest.raises(ValueError, match=r"max_value \(-1\) must be >= min_value \(0\)"):
        arithmetic_prompts(2, seed=0, max_value=-1)
    with pytest.raises(ValueError, match="num_numbers must be >= 1, got 0"):
        countdown_prompts(2, seed=0, num_numbers=0)
    with pytest.raises(ValueError, match="max_number must be >= 1, got 0"):
        countdown_prompts(2, seed=0, max_number=0)


def test_problem_key_matches_countdown_prompts_whose_numbers_are_reordered():
    # Excluding held-out prompts by text let the same problems through with their numbers
    # reordered: of 51,200 training prompts (defaults, seed 0), 1,059 had a held-out text
    # and 3,660 more were a held-out problem in another order.
    held = countdown_prompts(200, seed=1_000_003)
    texts, keys = {h["prompt"] for h in held}, {problem_key(h) for h in held}
    train = [item for k in range(10) for item in countdown_prompts(512, seed=k)]
    reordered = [item for item in train if item["prompt"] not in texts and problem_key(item) in keys]
    assert reordered and all(problem_key(item) == (tuple(sorted(item["numbers"])), item["target"]) for item in reordered)
    assert problem_key({"prompt": "3 5 7>22:", "numbers": [3, 5, 7], "target": 22}) == problem_key({"prompt": "7 3 5>22:", "numbers": [7, 3, 5], "target": 22})
    assert problem_key({"prompt": "3 5 7>22:", "numbers": [3, 5, 7], "target": 22}) != problem_key({"prompt": "3 5 7>21:", "numbers": [3, 5, 7], "target": 21})
    assert problem_key({"prompt": "1+2=", "answer": "3"}) == "1+2=" != problem_key({"prompt": "2+1=", "answer": "3"})


def _expressions(numbers):
    import itertools

    for order in itertools.permutations(numbers):
        for ops in itertools.product("+-*", repeat=len(order) - 1):
            expr = str(order[0])
            for op, n in zip(ops, order[1:]):
                expr = f"({expr}){op}{n}"
            yield expr


@pytest.mark.gpu
def test_gpu_rollout_and_training_match_the_cpu_engines():
    """On a real GPU: sampled rows' logprobs equal a CPU forward pass of the same model, and
    a train step moves the weights as the same step on CPU does (float64: no rounding noise)."""
    from tidal.hal import select_platform
    from tidal.hal.cpu import CpuPlatform

    gpu = select_platform("cuda").platform
    model = tiny(0, torch.float64)
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, chunk_tokens=3, platform=gpu)
    assert next(engine.model.parameters()).device.type == "cuda"
    torch.manual_seed(0)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-14=", "7="] for _ in range(4)]
    engine.generate(trajectories, max_new_tokens=7)
    for t in trajectories:
        assert t.done and 1 <= t.num_generated <= 7
        assert t.logprobs == pytest.approx(_reference_logprobs(model, t), abs=1e-9)
    batch = to_token_batch(trajectories, pad_id=T.pad_id)
    advantages = torch.linspace(-1, 1, len(trajectories), dtype=torch.float64)
    weights, losses = [], []
    for platform in (gpu, CpuPlatform()):
        trainer = TorchTrainEngine(copy.deepcopy(model), lr=1e-2, micro_batch_size=4, platform=platform)
        losses.append(trainer.train_step(batch, advantages, loss=PolicyLossConfig(), proximal_logprobs=trainer.logprobs(batch))["loss"])
        weights.append({name: t.detach().cpu() for name, t in trainer.named_weights()})
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    for name, weight in weights[1].items():  # k_proj's bias has no gradient but rounding noise, which AdamW scales up
        torch.testing.assert_close(weights[0][name], weight, atol=1e-6 if name.endswith("k_proj.bias") else 1e-9, rtol=0, msg=name)


@pytest.mark.gpu
def test_gpu_a_state_saved_unfused_resumes_into_a_fused_cuda_adamw():
    """torch places a loaded `step` count by the saved groups' settings: on the host for a
    state saved unfused (an NPU run's), which a fused AdamW on CUDA refuses (pytorch#104767);
    `own_settings` moves the counts to the parameters' device, and the fused step runs."""
    from tidal.hal import select_platform

    gpu = select_platform("cuda").platform
    torch.manual_seed(0)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-4=", "7+7=", "2-9="]]
    HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id).generate(trajectories, max_new_tokens=4)
    batch = to_token_batch(trajectories, pad_id=T.pad_id)
    unfused = TorchTrainEngine(tiny(), lr=1e-2)
    for group in unfused.optimizer.param_groups:
        group["fused"] = False
    unfused.train_step(batch, torch.ones(4), loss=PolicyLossConfig())
    resumed = TorchTrainEngine(tiny(5), lr=1e-2, platform=gpu)
    resumed.load_state_dict(copy.deepcopy(unfused.state_dict()))
    assert resumed.optimizer.param_groups[0]["fused"] is True
    steps = [state["step"] for state in resumed.optimizer.state.values()]
    assert steps and all(t.device.type == "cuda" and t.dtype == torch.float32 for t in steps)
    metrics = resumed.train_step(batch, -torch.ones(4), loss=PolicyLossConfig())
    assert metrics["nonfinite_grad"] == 0.0 and resumed.version == 2
