"""Engines: tiny model + tokenizer, hf rollout (logprobs, padding, EOS, budget, pause/resume), torch trainer, rewards, tasks."""

from __future__ import annotations

import copy
import math
import os
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.engines.rewards import arithmetic, countdown, exact_match, resolve_reward, score
from tidal.engines.tasks import arithmetic as arithmetic_prompts
from tidal.engines.tasks import countdown as countdown_prompts
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2, load_model, save_model
from tidal.engines import torch_train
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
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
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
    resumed = Trajectory(prompt_ids=trajectory.prompt_ids, tokens=trajectory.tokens[2:])  # the new weights' part
    resumed.prompt_ids = trajectory.prompt_ids + trajectory.tokens[:2]
    assert trajectory.logprobs[2:] == pytest.approx(_reference_logprobs(reference, resumed), abs=1e-4)


def test_sampling_loop_draws_what_transformers_generate_draws():
    # No row ends early (EOS suppressed), so every decoding step samples every row, as
    # `generate` does: same seed, same tokens; a group's rows share one prefill.
    model = tiny(0, torch.float64)
    _bias_token(model, T.eos_id)[T.eos_id] = -1e9
    engine = HFRolloutEngine(copy.deepcopy(model), eos_id=T.eos_id, pad_id=T.pad_id, temperature=0.7, chunk_tokens=2)
    _bias_token(engine.model, T.eos_id)[T.eos_id] = -1e9
    prompts = [T.encode(p) for p in ["1+2=", "13-4=", "7="] for _ in range(3)]
    torch.manual_seed(5)
    trajectories = [Trajectory(prompt_ids=p) for p in prompts]
    engine.generate(trajectories, max_new_tokens=6, should_pause=lambda: False)
    torch.manual_seed(5)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[T.pad_id] * (width - len(p)) + p for p in prompts])
    out = model.generate(input_ids, attention_mask=(input_ids != T.pad_id).long(), max_new_tokens=6, do_sample=True, temperature=0.7, top_k=0, top_p=1.0, pad_token_id=T.pad_id, eos_token_id=T.eos_id, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, width:]
    assert [t.tokens for t in trajectories] == new.tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.7, -1).gather(-1, new[..., None]).squeeze(-1)
    assert torch.allclose(torch.tensor([t.logprobs for t in trajectories]), logprobs, atol=1e-6)
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


def _batch():
    torch.manual_seed(0)
    engine = HFRolloutEngine(tiny(), eos_id=T.eos_id, pad_id=T.pad_id)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["1+2=", "13-4=", "7+7=", "2-9="]]
    engine.generate(trajectories, max_new_tokens=4)
    return to_token_batch(trajectories, pad_id=T.pad_id)


def test_micro_batches_give_the_same_step_as_one_batch():
    batch = _batch()
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0], dtype=torch.float64)
    results = []
    for micro in (1, 4):
        engine = TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, micro_batch_size=micro)
        engine.train_step(batch, advantages, loss=PolicyLossConfig())
        results.append(dict(engine.named_weights()))
        assert engine.version == 1
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], atol=1e-8), name


def test_torch_engine_keeps_its_weights_where_it_is_told_and_lets_readers_finish_before_they_change():
    """`share_weights` (a transport's shared buffer, here a plain tensor): the weights move
    there (the tied head with the embedding), a step is the same step, and the hook runs
    before the weights change, every time, while they still hold the version a reader takes."""
    batch = _batch()
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    plain, shared = (TorchTrainEngine(tiny(), lr=1e-2, micro_batch_size=2) for _ in range(2))
    arena = torch.zeros(1 << 20)
    asked: list = []

    def place(specs, ties, device):
        asked.append((len(specs), ties, device))
        views, offset, at = [], 0, {}
        for spec in specs:
            if spec.name in ties:
                views.append(at[ties[spec.name]])
                continue
            n = math.prod(spec.shape)
            at[spec.name] = arena[offset : offset + n].view(spec.shape)
            views.append(at[spec.name])
            offset += n
        return views

    seen = []  # what a reader would take when the hook runs
    shared.share_weights(place, before_change=lambda: seen.append({n: t.clone() for n, t in shared.named_weights()}))
    names = list(dict(shared.named_weights()))
    assert asked == [(len(names), {"lm_head.weight": "model.embed_tokens.weight"}, torch.device("cpu"))]
    start = arena.data_ptr()
    assert all(start <= t.data_ptr() < start + arena.numel() * 4 for _, t in shared.named_weights())
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.named_weights(), shared.named_weights()))
    for step in range(2):
        before = {n: t.clone() for n, t in shared.named_weights()}
        for engine in (plain, shared):
            engine.train_step(batch, advantages, loss=PolicyLossConfig())
        assert len(seen) == step + 1 and all(torch.equal(seen[-1][n], before[n]) for n in names)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(plain.named_weights(), shared.named_weights()))
        assert not torch.equal(before["model.norm.weight"], dict(shared.named_weights())["model.norm.weight"])
    shared.load_state_dict(plain.state_dict())
    assert len(seen) == 3

    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2))

    with pytest.raises(ValueError, match="weight 'scale' is a buffer, not a parameter"):
        TorchTrainEngine(WithBuffer()).share_weights(place, before_change=lambda: None)
    assert len(asked) == 1  # refused before anything was placed
    other = TorchTrainEngine(torch.nn.Linear(2, 3))
    with pytest.raises(RuntimeError, match=r"the place for 'weight' is torch.float32\[6\] on cpu, the weight torch.float32\[3, 2\]"):
        other.share_weights(lambda specs, ties, device: [torch.zeros(6), torch.zeros(3)], before_change=lambda: None)
    assert other.model.weight.shape == (3, 2) and other.model.weight.abs().sum() > 0  # nothing moved


def _grouped_batch(dtype=torch.float32):
    """Two groups of 4 (shared prompts of different lengths) and a row with an environment turn."""
    torch.manual_seed(0)
    engine = HFRolloutEngine(tiny(dtype=dtype), eos_id=T.eos_id, pad_id=T.pad_id)
    trajectories = [Trajectory(prompt_ids=T.encode(p)) for p in ["7=", "13-4="] for _ in range(4)]
    engine.generate(trajectories, max_new_tokens=5)
    turns = Trajectory(prompt_ids=T.encode("7="))
    turns.extend([5, 6], [-1.0, -1.5], 0)
    turns.append_env([7, 8])
    turns.extend([9], [-2.0], 0)
    return to_token_batch([*trajectories, turns], pad_id=T.pad_id)


def _packed_and_plain(monkeypatch, batch, **model):
    """(logprobs, gradients of their sum on loss tokens) packed, then plain: the same
    model built twice, the second time with packing off."""
    results = []
    for pack in (True, False):
        if not pack:
            monkeypatch.setattr(torch_train, "_shared_prompts", lambda batch: None)
        engine = TorchTrainEngine(tiny(**model), micro_batch_size=16)
        logprobs = engine._token_logprobs(batch)
        (logprobs * batch.loss_mask).sum().backward()
        results.append((logprobs, [p.grad for p in engine.model.parameters()]))
    return results


# eager in float32: transformers' eager attention turns the fully masked rows of left
# padding into NaN in float64 (not in float32, bf16 or fp16)
@pytest.mark.parametrize("attention, dtype, atol", [("sdpa", torch.float64, 1e-5), ("eager", torch.float32, 2e-5)])
def test_shared_prompt_forward_equals_the_plain_forward(monkeypatch, attention, dtype, atol):
    batch = _grouped_batch(dtype)
    assert torch_train._shared_prompts(batch) is not None  # 3 distinct prompts for 9 rows
    (shared_lp, shared_grads), (plain_lp, plain_grads) = _packed_and_plain(monkeypatch, batch, dtype=dtype, attention=attention)
    mask = batch.loss_mask != 0
    assert torch.allclose(shared_lp[mask], plain_lp[mask], atol=1e-6)
    assert all(torch.allclose(a, b, atol=atol) for a, b in zip(shared_grads, plain_grads))


def test_packed_rows_hold_several_prompts_and_match_the_plain_forward(monkeypatch):
    """Two short groups share a packed row beside a long one; a row without a loss token
    is left out of the packing and gets logprobs of 0 there."""
    rows = []
    for prompt, responses in [("13-4=", [[5, 6, 7, 8, 9], [5, 6, 7, 8], [5, 6, 7]]), ("7=", [[5, 9], [5, 8]]), ("8=", [[6, 9], [6, 8]]), ("9=", [[7]])]:
        for response in responses:
            t = Trajectory(prompt_ids=T.encode(prompt))
            t.extend(response, [-1.0] * len(response), 0)
            rows.append(t)
    env_only = Trajectory(prompt_ids=T.encode("9="))
    env_only.append_env([5, 6])
    batch = to_token_batch([*rows, env_only], pad_id=T.pad_id)
    shared = torch_train._shared_prompts(batch)
    packed = torch_train._pack(batch, shared)
    # a response's last token predicts nothing and is left out: units "13-4=" with 9 of its
    # 12 response tokens (15 wide), "7=" and "8=" with 2 (5 wide), "9=" its prompt alone
    # (its one-token response is predicted by the prompt's last token): two packed rows
    assert packed.input_ids.shape == (2, 15)
    assert packed.input_ids[1, :13].tolist() == [*T.encode("7="), 5, 5, *T.encode("8="), 6, 6, *T.encode("9=")]
    assert packed.position_ids[1, :13].tolist() == [0, 1, 2, 3, 3, 0, 1, 2, 3, 3, 0, 1, 2]
    assert not packed.allowed[1, 4, 3] and packed.allowed[1, 4, 2] and not packed.allowed[1, 7, 4]  # a sibling's token; its prompt; another unit
    (packed_lp, packed_grads), (plain_lp, plain_grads) = _packed_and_plain(monkeypatch, batch, attention="eager")
    mask = batch.loss_mask != 0
    assert torch.allclose(packed_lp[mask], plain_lp[mask], atol=1e-6)
    assert (packed_lp[~mask] == 0).all()
    assert all(torch.allclose(a, b, atol=2e-5) for a, b in zip(packed_grads, plain_grads))


def test_a_prompt_with_long_responses_is_packed_in_several_units(monkeypatch):
    """A unit is at most 4 longest rows wide: a 10-token prompt and eight 12-token
    responses (rows of 22; 11 tokens of each go in, the last predicts nothing) make units
    of 10 + 7 x 11 = 87 and 10 + 11 = 21 tokens, not one of 98, whose attention scores
    would be 98^2 = 9,604 against 8 x 22^2 = 3,872 for the rows unpacked."""
    rows = []
    for k in range(8):
        t = Trajectory(prompt_ids=T.encode("12+34-56="))
        t.extend([5 + (j + k) % 5 for j in range(12)], [-1.0] * 12, 0)
        rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)
    packed = torch_train._pack(batch, torch_train._shared_prompts(batch))
    assert packed.input_ids.shape == (2, 87)
    prompt = T.encode("12+34-56=")
    assert packed.input_ids[0, :10].tolist() == prompt and packed.input_ids[1, :10].tolist() == prompt
    assert (packed.input_ids[1, 21:] == 0).all() and (packed.position_ids[1, 10:21] == torch.arange(10, 21)).all()
    (packed_lp, packed_grads), (plain_lp, plain_grads) = _packed_and_plain(monkeypatch, batch, attention="eager")
    mask = batch.loss_mask != 0
    assert torch.allclose(packed_lp[mask], plain_lp[mask], atol=1e-6)
    assert all(torch.allclose(a, b, atol=2e-5) for a, b in zip(packed_grads, plain_grads))


def test_proximal_is_policy_step_equals_recomputing_the_proximal_logprobs():
    # Behavior logprobs from other weights (a stale sample): the decoupled step against
    # recomputed proximal logprobs and the one that reuses its own forward are the same step.
    batch = _grouped_batch(torch.float64)
    batch.behavior_logprobs = batch.behavior_logprobs + 0.2 * batch.loss_mask
    advantages = torch.linspace(-1, 1, len(batch), dtype=torch.float64)
    config = PolicyLossConfig(tis_cap=1.1)
    recompute = TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, micro_batch_size=4)
    reuse = TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, micro_batch_size=4)
    expected = recompute.train_step(batch, advantages, loss=config, proximal_logprobs=recompute.logprobs(batch))
    actual = reuse.train_step(batch, advantages, loss=PolicyLossConfig(tis_cap=1.1, proximal_is_policy=True))
    assert actual == pytest.approx(expected)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(recompute.named_weights(), reuse.named_weights()))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_rows_without_advantage_are_skipped_and_the_step_is_the_same(monkeypatch, aggregation):
    # Group 2 (rows 4-7) got one reward for all its samples: zero advantages. Skipping its
    # rows gives the gradient the full batch gives (up to the float32 rounding of rotary
    # positions, which shift with the batch's padding); a step with no signal at all still
    # moves AdamW's momentum and weight decay, as a zero gradient does.
    batch = _grouped_batch(torch.float64)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.75], dtype=torch.float64)
    config = PolicyLossConfig(aggregation=aggregation, proximal_is_policy=True, tis_cap=2.0)
    assert torch.equal(torch_train.rows_with_signal(advantages, batch.loss_mask), torch.tensor([0, 1, 2, 3, 8]))
    everything = lambda advantages, mask: torch.arange(len(mask))  # noqa: E731
    runs = []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(torch_train, "rows_with_signal", everything)
        engine = TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, weight_decay=0.1, micro_batch_size=2)
        metrics = engine.train_step(batch, advantages, loss=config)
        runs.append((metrics, {n: p.grad.clone() for n, p in engine.model.named_parameters()}, engine))
        monkeypatch.undo()
    (skipped, skipped_grads, engine), (full, full_grads, _) = runs
    assert skipped["skipped_rows"] == 4 and full["skipped_rows"] == 0
    assert skipped["loss"] == pytest.approx(full["loss"], rel=1e-6)
    for name, grad in full_grads.items():
        torch.testing.assert_close(skipped_grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)

    state = copy.deepcopy(engine.state_dict())
    after = []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(torch_train, "rows_with_signal", everything)
        engine.load_state_dict(copy.deepcopy(state))
        metrics = engine.train_step(batch, torch.zeros_like(advantages), loss=config)
        after.append((metrics["skipped_rows"], {n: t.clone() for n, t in engine.named_weights()}))
    (num_skipped, skipped_weights), (_, full_weights) = after
    assert num_skipped == len(batch)
    for name, weight in full_weights.items():
        assert not torch.equal(weight, state["model"][name]), name  # AdamW moved it
        torch.testing.assert_close(skipped_weights[name], weight, atol=1e-12, rtol=0, msg=name)


def test_positive_advantages_raise_the_sampled_tokens_logprob_and_sft_lowers_loss():
    batch = _batch()
    engine = TorchTrainEngine(tiny(), lr=1e-2, micro_batch_size=2)
    before = (engine.logprobs(batch) * batch.loss_mask).sum()
    for _ in range(3):
        engine.train_step(batch, torch.ones(4), loss=PolicyLossConfig(), proximal_logprobs=engine.logprobs(batch))
    assert (engine.logprobs(batch) * batch.loss_mask).sum() > before
    losses = [engine.sft_step(batch)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] and engine.version == 3


def _linear_output_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """A set that fills, from now on, with the dtype of every `nn.Linear` output."""
    seen: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    return seen


@pytest.mark.parametrize("batch_of, packs", [(_batch, False), (_grouped_batch, True)], ids=["plain", "packed"])
def test_bf16_precision_runs_the_matmuls_in_bf16_and_keeps_fp32_state(monkeypatch, batch_of, packs):
    batch = batch_of()
    packed = []
    monkeypatch.setattr(torch_train, "_pack", lambda *args, pack=torch_train._pack: packed.append(1) or pack(*args))
    advantages = torch.linspace(-1.0, 1.0, len(batch))
    fp32, bf16 = (TorchTrainEngine(tiny(attention="eager"), lr=1e-2, micro_batch_size=4, precision=p) for p in ("fp32", "bf16"))
    seen = _linear_output_dtypes(bf16.model)
    mask = batch.loss_mask != 0
    want, got = fp32.logprobs(batch), bf16.logprobs(batch)
    assert seen == {torch.bfloat16} and got.dtype == torch.float32
    assert 0 < (got - want)[mask].abs().max() < 0.1  # bf16 rounding, nothing more
    seen.clear()
    before = (got * batch.loss_mask * advantages[:, None]).sum()
    for _ in range(3):
        bf16.train_step(batch, advantages, loss=PolicyLossConfig())
    assert seen == {torch.bfloat16}
    assert (bf16.logprobs(batch) * batch.loss_mask * advantages[:, None]).sum() > before  # it still learns
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    assert {t.dtype for state in bf16.optimizer.state.values() for t in state.values() if t.dim()} == {torch.float32}
    assert bool(packed) == packs  # both forward paths: rows packed by prompt, and plain


def test_a_precision_the_platform_lacks_is_refused_when_the_engine_is_built(monkeypatch):
    from tidal.hal import PlatformError, current_platform

    platform = current_platform()
    monkeypatch.setattr(platform, "dtype_support", lambda: {"bf16": False, "fp16": True, "fp64": True, "fp8": False})
    with pytest.raises(PlatformError, match="no bf16 arithmetic"):
        TorchTrainEngine(tiny(), precision="bf16", platform=platform)
    with pytest.raises(ValueError, match="unknown precision 'half'"):
        TorchTrainEngine(tiny(), precision="half")


def _grads_and_graph(engine: TorchTrainEngine, batch, weights: torch.Tensor) -> tuple[list[torch.Tensor], set[str]]:
    """The gradients of a weighted sum of `batch`'s logprobs, and the names of the nodes of
    their autograd graph."""
    engine.model.zero_grad(set_to_none=True)
    logprobs = engine._token_logprobs(batch)
    names, seen, todo = set(), set(), [logprobs.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            names.add(type(node).__name__)
            todo.extend(next_node for next_node, _ in node.next_functions)
    (logprobs * weights).sum().backward()
    return [p.grad.clone() for p in engine.model.parameters()], names


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores: one torch thread sums in a fixed order anyway")
def test_a_packed_backward_on_two_threads_gives_the_same_gradients_every_time():
    """Rows that share a prompt share the position that predicts their first token. On
    several CPU threads, summing those rows' gradients through advanced indexing
    (`index_put_` accumulating with atomic adds) gave a different float order from run to
    run, so a sync run with `train.threads=2` diverged from itself after a few steps."""
    rng = random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(12):  # before the fix 3 of 17 such batches showed it within 4 runs
            trajectories = []
            for _ in range(16):
                ids = T.encode(f"{rng.randint(0, 9)}{rng.choice('+-')}{rng.randint(0, 9)}=")
                for _ in range(8):
                    n = rng.choice([2, 2, 3, 3, 4])
                    t = Trajectory(prompt_ids=ids)
                    t.extend([rng.randint(4, T.vocab_size - 1) for _ in range(n - 1)] + [T.eos_id], [-1.0] * n, 0)
                    trajectories.append(t)
            batch = to_token_batch(trajectories, pad_id=T.pad_id)
            weights = batch.loss_mask * torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
            assert torch_train._shared_prompts(batch) is not None  # the packed forward
            runs = [_grads_and_graph(TorchTrainEngine(tiny(attention="eager"), micro_batch_size=128), batch, weights) for _ in range(4)]
            assert "IndexBackward0" not in runs[0][1] and "IndexSelectBackward0" in runs[0][1]
            assert all(torch.equal(a, b) for grads, _ in runs[1:] for a, b in zip(runs[0][0], grads))
    finally:
        torch.set_num_threads(threads)


def test_trainer_state_round_trip(tmp_path):
    batch = _batch()
    engine = TorchTrainEngine(tiny(), lr=1e-2)
    engine.train_step(batch, torch.ones(4), loss=PolicyLossConfig())
    torch.save(engine.state_dict(), tmp_path / "s.pt")
    other = TorchTrainEngine(tiny(5), lr=1e-2)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert other.version == 1
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.named_weights(), other.named_weights()))
    assert [n for n, _ in engine.named_weights()] == list(engine.model.state_dict())
    assert engine.optimizer.param_groups[0]["fused"] is True  # the CPU platform's optimizer_options


def test_a_resumed_optimizer_steps_the_way_its_platform_does(tmp_path):
    """A checkpoint saved where AdamW was not fused (another platform, an older tidal) is
    resumed with this platform's optimizer options, and steps as an unfused AdamW would."""
    batch = _batch()
    unfused = TorchTrainEngine(tiny(), lr=1e-2)
    for group in unfused.optimizer.param_groups:
        group["fused"] = False
    unfused.train_step(batch, torch.ones(4), loss=PolicyLossConfig())
    state = copy.deepcopy(unfused.state_dict())  # as through a checkpoint file: no tensors shared
    assert state["optimizer"]["param_groups"][0]["fused"] is False
    resumed = TorchTrainEngine(tiny(5), lr=1e-2)
    resumed.load_state_dict(state)
    assert resumed.optimizer.param_groups[0]["fused"] is True
    unfused.train_step(batch, -torch.ones(4), loss=PolicyLossConfig())
    resumed.train_step(batch, -torch.ones(4), loss=PolicyLossConfig())
    assert all(torch.allclose(a, b, atol=1e-6) for (_, a), (_, b) in zip(unfused.named_weights(), resumed.named_weights()))


def test_verifiers():
    t = Trajectory(prompt_ids=[1], meta={"answer": "-3"})
    assert arithmetic(t, "-3") == 1.0 and arithmetic(t, " -3 and more") == 1.0 and arithmetic(t, "3") == 0.0 and arithmetic(t, "abc") == 0.0
    assert exact_match(Trajectory(prompt_ids=[1], meta={"answer": "ab"}), " ab ") == 1.0
    c = Trajectory(prompt_ids=[1], meta={"numbers": [3, 5, 7], "target": 22})
    assert countdown(c, "3*5+7") == 1.0 and countdown(c, "(7+5)*3") == 0.1 and countdown(c, "7*3+1") == 0.0
    assert countdown(c, "7+7+8") == 0.0  # 7 twice, 8 not given
    assert countdown(c, "__import__('os')") == 0.0 and countdown(c, "3/0") == 0.0 and countdown(c, "(((") == 0.0
    assert countdown(Trajectory(prompt_ids=[1], meta={"numbers": [6, 3], "target": 2}), "6/3") == 1.0


def test_resolve_reward_and_failing_rewards_do_not_crash():
    assert resolve_reward("arithmetic") is arithmetic
    assert resolve_reward("math:isfinite") is math.isfinite
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:f")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_reward("math:nope")

    def flaky(trajectory, text):
        if text == "boom":
            raise RuntimeError("boom")
        return float("nan") if text == "nan" else 1.0

    rows = [Trajectory(prompt_ids=[1]) for _ in range(3)]
    rewards, failed = score(flaky, rows, ["ok", "boom", "nan"])
    assert rewards == [1.0, 0.0, 0.0] and failed == [1, 2]


def test_tasks_are_deterministic_and_correct():
    a = arithmetic_prompts(50, seed=1, max_value=9)
    assert a == arithmetic_prompts(50, seed=1, max_value=9) and a != arithmetic_prompts(50, seed=2, max_value=9)
    for item in a:
        x, op, y = item["prompt"][0], item["prompt"][1], item["prompt"][2:-1]
        assert int(item["answer"]) == (int(x) + int(y) if op == "+" else int(x) - int(y))
    for item in countdown_prompts(20, seed=3):
        expression_exists = any(countdown(Trajectory(prompt_ids=[1], meta=item), e) == 1.0 for e in _expressions(item["numbers"]))
        assert expression_exists and item["target"] > 0
        assert countdown(Trajectory(prompt_ids=[1], meta=item), item["answer"]) == 1.0  # the warm start's reference solves it
    small = countdown_prompts(200, seed=4, num_numbers=2, max_number=5)
    assert all(len(item["numbers"]) == 2 and max(item["numbers"]) <= 5 for item in small)
    assert all(countdown(Trajectory(prompt_ids=[1], meta=item), item["answer"]) == 1.0 for item in small)
    assert any("(" in item["answer"] for item in countdown_prompts(50, seed=5))  # a product of a sum keeps its brackets


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
    from tidal.hal import select_platform  # noqa: PLC0415
    from tidal.hal.cpu import CpuPlatform  # noqa: PLC0415

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
