"""The megatron train engine: megatron-core 0.16.1 for real, on CPU over gloo (hal's host patches),
across two processes.

One pair of worker processes (`conftest.spawn_ranks`) runs everything, in two phases. SPMD
first: each rank calls every method with its own rows, on the tied tiny Qwen2 and on an untied
one. Then led by rank 0, as `tidal run` drives it: rank 0 alone is called with every row and
rank 1 runs `megatron_lead.follow()`. The tests compare what the ranks saved with one
`TorchTrainEngine` on all six rows and with the Hugging Face model itself, and a state moved
through `state_dict()` / `load_state_dict()` with the run that never moved.

Tolerance: float32 noise. Logprobs within 1e-5 of the HF model's; after six steps at lr 1e-2
the weights within 1e-4 of the torch engine's (a key projection's bias, whose gradient is zero
in exact arithmetic, within 1e-3: AdamW turns its noise into steps of up to lr), the loss and
gradient norm within 1e-4 relative. megatron-core computes attention with its own kernels
(`baddbmm`, its softmax) where transformers calls sdpa, and the ranks sum gradients in another
order than the torch engine's micro-batches. A state moved between megatron engines goes on bit
for bit.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tidal.engines.megatron_train import MegatronTrainEngine
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.engines.train_steps import padded_positions
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch

T = CharTokenizer()
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=2, padding_free=False)
SHARDS = [[0, 1, 2, 3], [4, 5]]
"""Rows of each SPMD rank: rank 0 has rows without a loss token, rank 1 rows without advantage
(no pass of its own in policy steps)."""
PLAN = [{"aggregation": "token_mean"}, {"aggregation": "seq_mean_token_mean"}, "sft", {"aggregation": "token_sum_norm", "max_tokens": 8}, {"aggregation": "token_mean", "scale": 0.0}, {"aggregation": "token_mean", "seq_mask_low": 0.5, "seq_mask_high": 2.0}]
"""Policy losses with three aggregations, a supervised step, a step with all advantages zero
(no row runs anywhere; AdamW still steps) and one with sequence masking."""
NUM_RL_STEPS = sum(step != "sft" for step in PLAN)
RESUME = [{"aggregation": "token_mean"}, "sft"]
"""Steps taken after a state moved, by the engine that saved it and by the one that loaded it."""

WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers

    from tidal.engines.fsdp_lead import stop_followers
    from tidal.engines.megatron_lead import follow
    from tidal.engines.megatron_train import MegatronTrainEngine
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    import rank_worker  # beside this script (conftest.spawn_ranks)

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)

    def engine(seed, model=None, **options):
        return MegatronTrainEngine(model or build_tiny_qwen2(data["vocab_size"], seed=seed, **data["model"]), **data["engine"], **options)

    def run(e, plan, batch, advantages):
        return rank_worker.run_plan(e, batch, advantages, plan)

    export = rank_worker.export

    # SPMD: every rank calls every method with its own rows
    rows = data["shards"][rank]
    mine, my_advantages = TokenBatch(*(t[rows] for t in data["batch"])), data["advantages"][rows]
    e = engine(0)
    spmd = {"first_logprobs": e.logprobs(mine), "first_left_logprobs": e.logprobs(TokenBatch(*(t[rows] for t in data["left_padded"])))}
    spmd["first_weights"] = export(e)
    spmd["metrics"] = run(e, data["plan"], mine, my_advantages)
    spmd["version"] = e.version
    spmd["weights"] = export(e)
    spmd["specs"] = e.named_weights().specs()
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    spmd["host_device"] = rotary_pos_embedding.torch.cuda.current_device()
    torch.save(spmd["metrics"], work / f"metrics{rank}.pt")
    torch.manual_seed(0)  # the test builds the same weights
    untied = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**data["untied"]))
    u = engine(0, model=untied)
    spmd["untied_first"] = export(u)
    spmd["untied_metrics"] = run(u, data["plan"][:3], mine, my_advantages)
    spmd["untied_weights"] = export(u)
    spmd["untied_state"] = u.state_dict()
    torch.manual_seed(0)
    q3 = engine(0, model=transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**data["qwen3"])))
    spmd["qwen3_metrics"] = run(q3, data["plan"][:3], mine, my_advantages)
    spmd["qwen3_weights"] = export(q3)
    del e, u, q3

    # Led by rank 0: rank 1 follows
    if rank:
        torch.save(follow(), work / f"follow{rank}.pt")
    else:
        batch, advantages = TokenBatch(*data["batch"]), data["advantages"]
        led = {}
        e = engine(0, rank0_leads=True)
        led["metrics"] = run(e, data["plan"], batch, advantages)
        led["version"] = e.version
        led["logprobs"] = e.logprobs(batch)
        led["weights"] = export(e)
        state = e.state_dict()
        led["state"] = state
        led["resume_metrics"] = run(e, data["resume"], batch, advantages)
        led["continued"] = export(e)
        other = engine(7, rank0_leads=True)  # the followers replace their engine too
        other.load_state_dict(state)
        led["loaded_version"] = other.version
        led["loaded"] = export(other)
        led["reloaded_metrics"] = run(other, data["resume"], batch, advantages)
        led["reloaded"] = export(other)
        from_torch = engine(9, rank0_leads=True)
        from_torch.load_state_dict(data["torch_state"])
        led["from_torch_version"] = from_torch.version
        led["from_torch_settings"] = {key: from_torch.optimizer.param_groups[0][key] for key in ("lr", "weight_decay", "fused")}
        run(from_torch, data["resume"], batch, advantages)
        led["from_torch"] = export(from_torch)
        del e, other, from_torch
        strict = engine(11, rank0_leads=True, max_nonfinite_steps=0)
        try:  # every rank skips the step and raises (the followers too: the option went with `init`)
            strict.train_step(batch, advantages * float("nan"), loss=PolicyLossConfig())
        except FloatingPointError as err:
            led["nonfinite"] = str(err)
        led["after_nonfinite"] = strict.state_dict()
        del strict
        reset = engine(0, rank0_leads=True)
        run(reset, data["plan"][:1], batch, advantages)
        reset.load_state_dict(led["after_nonfinite"])  # no optimizer state: a fresh AdamW's, on every rank
        run(reset, data["resume"][:1], batch, advantages)
        led["reset"] = export(reset)
        del reset
        fresh = engine(11, rank0_leads=True)
        run(fresh, data["resume"][:1], batch, advantages)
        led["fresh"] = export(fresh)
        stop_followers()
        torch.save({"spmd": spmd, "led": led}, work / "result.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see tests/engines/test_fsdp_train.py)
    """
)

UNTIED = dict(vocab_size=T.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, rope_theta=1000.0)
"""An untied Qwen2 with four query heads over two key/value heads and another rotary base."""
QWEN3 = dict(vocab_size=T.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True)
"""A Qwen3: each query and key head normalised (`q_norm`, `k_norm`), heads wider than hidden / heads."""


def _model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, seed=seed, **MODEL)


def _untied() -> torch.nn.Module:
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # as the worker does before it builds it: the same weights
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**UNTIED))


def _qwen3() -> torch.nn.Module:
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3))


def _left_padded(batch: TokenBatch) -> TokenBatch:
    """`batch` with each row moved right by 3 pad tokens (positions then count from its first real token)."""
    pad = lambda t, value: torch.cat([torch.full((t.shape[0], 3), value, dtype=t.dtype), t], dim=1)
    return TokenBatch(pad(batch.input_ids, T.pad_id), pad(batch.attention_mask, 0), pad(batch.loss_mask, 0), pad(batch.behavior_logprobs, 0), pad(batch.versions, -1))


@pytest.fixture(scope="module")
def reference(six_rows, run_torch) -> dict:
    """The same steps by one `TorchTrainEngine` on all six rows (`conftest.six_row_batch`)."""
    batch, advantages = six_rows
    engine = TorchTrainEngine(_model(0), **ENGINE)
    metrics = run_torch(engine, batch, advantages, PLAN)
    untied = TorchTrainEngine(_untied(), **ENGINE)
    untied_metrics = run_torch(untied, batch, advantages, PLAN[:3])
    qwen3 = TorchTrainEngine(_qwen3(), **ENGINE)
    qwen3_metrics = run_torch(qwen3, batch, advantages, PLAN[:3])
    return {"qwen3_metrics": qwen3_metrics, "qwen3_weights": list(qwen3.named_weights()), "engine": engine, "batch": batch, "advantages": advantages, "metrics": metrics, "logprobs": engine.logprobs(batch), "weights": list(engine.named_weights()), "untied_metrics": untied_metrics, "untied_weights": list(untied.named_weights())}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, reference: dict, spawn, write_data) -> dict:
    """What rank 0 of the worker pair saved, each rank's SPMD metrics, and rank 1's `follow()` summary."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    work = tmp_path_factory.mktemp("megatron")
    torch_state = reference["engine"].state_dict()  # copied now, by torch.save
    for group in torch_state["optimizer"]["param_groups"]:
        group.update(fused=False, lr=0.5, weight_decay=0.5)  # as a run with other settings, on a platform without fused AdamW, saves it
    write_data(
        work, reference["batch"], reference["advantages"], shards=SHARDS, plan=PLAN, resume=RESUME, model=MODEL, engine=ENGINE, vocab_size=T.vocab_size,
        torch_state=torch_state, left_padded=_left_padded(reference["batch"]).tensors(), untied=UNTIED, qwen3=QWEN3,
    )  # fmt: skip
    spawn(work, WORKER)
    result = torch.load(work / "result.pt", weights_only=False)
    return {**result, "rank_metrics": [torch.load(work / f"metrics{rank}.pt") for rank in range(2)], "follower": torch.load(work / "follow1.pt")}


def _assert_same_weights(got: list, want: list) -> None:
    got = dict(got)
    assert got.keys() == dict(want).keys()
    for name, expected in want:
        atol = 1e-3 if name.endswith("k_proj.bias") else 1e-4
        torch.testing.assert_close(got[name], expected, atol=atol, rtol=0, msg=name)


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), step
        for key in ("loss", "grad_norm", "num_tokens", "lr"):  # per-micro-batch diagnostics depend on how rows are cut
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), (step, key)
        assert g.get("skipped_rows") == w.get("skipped_rows"), step
        assert g.get("seq_masked_fraction") == w.get("seq_masked_fraction"), step


def _assert_equal_exports(a: list, b: list) -> None:
    assert [name for name, _ in a] == [name for name, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert torch.equal(x, y), name


def _hf_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Each next token's logprob under the HF model, positions from each row's first real token."""
    with torch.no_grad():
        logits = model.eval()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=padded_positions(batch.attention_mask)).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


def test_logprobs_are_the_hf_models_right_and_left_padded(ranks, reference):
    """Where a real token predicts a real one; 0 where either is padding."""
    rows = SHARDS[0]
    for key, batch in (("first_logprobs", reference["batch"]), ("first_left_logprobs", _left_padded(reference["batch"]))):
        part = batch.select(rows)
        got, want = ranks["spmd"][key], _hf_logprobs(_model(0), part)
        real = (part.attention_mask[:, :-1] != 0) & (part.attention_mask[:, 1:] != 0)
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
        assert not got[~real].any()


def test_exported_weights_are_the_hf_models_state_dict(ranks):
    """Before any step: every `state_dict` name (the tied `lm_head.weight` too), the same tensors,
    after the conversion to megatron-core and back; the specs say so without reading a tensor."""
    for key, model in (("first_weights", _model(0)), ("untied_first", _untied())):
        want = model.state_dict()
        got = dict(ranks["spmd"][key])
        assert got.keys() == want.keys()
        assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
    specs = {s.name: (s.dtype, s.shape) for s in ranks["spmd"]["specs"]}
    assert specs == {name: ("float32", tuple(t.shape)) for name, t in _model(0).state_dict().items()}


def test_spmd_steps_equal_one_full_batch_torch_step(ranks, reference):
    spmd = ranks["spmd"]
    assert spmd["version"] == reference["engine"].version == NUM_RL_STEPS  # sft steps keep the version
    _assert_same_weights(spmd["weights"], reference["weights"])
    _assert_same_metrics(spmd["metrics"], reference["metrics"])
    assert ranks["rank_metrics"][0] == ranks["rank_metrics"][1] == spmd["metrics"]  # every rank reports the whole batch's
    assert spmd["host_device"] == "cpu"  # hal's first host patch, applied by the engine


def test_an_untied_model_trains_as_the_torch_engine_trains_it(ranks, reference):
    """Separate `lm_head` (megatron's `output_layer`), grouped-query attention, another rotary base."""
    _assert_same_weights(ranks["spmd"]["untied_weights"], reference["untied_weights"])
    _assert_same_metrics(ranks["spmd"]["untied_metrics"], reference["untied_metrics"])
    state = ranks["spmd"]["untied_state"]
    engine = TorchTrainEngine(_untied(), **ENGINE)
    engine.load_state_dict(state)  # the torch engine's format: lm_head's moments among the parameters
    assert "lm_head.weight" in state["model"] and len(state["optimizer"]["state"]) == len(list(engine.model.parameters()))


def test_a_qwen3_model_trains_as_the_torch_engine_trains_it(ranks, reference):
    """Per-head query and key norms (megatron's `qk_layernorm`), heads wider than hidden / heads."""
    assert any(name.endswith("q_norm.weight") for name, _ in reference["qwen3_weights"])
    _assert_same_weights(ranks["spmd"]["qwen3_weights"], reference["qwen3_weights"])
    _assert_same_metrics(ranks["spmd"]["qwen3_metrics"], reference["qwen3_metrics"])


def test_led_steps_equal_one_full_batch_torch_step(ranks, reference):
    """Rank 0 alone is called with all six rows; rank 1 trains on its share through `follow()`."""
    led = ranks["led"]
    assert led["version"] == NUM_RL_STEPS
    _assert_same_weights(led["weights"], reference["weights"])
    _assert_same_metrics(led["metrics"], reference["metrics"])
    response = (reference["batch"].loss_mask.cumsum(1) > 0) & (reference["batch"].attention_mask[:, 1:] != 0)
    torch.testing.assert_close(led["logprobs"][response], reference["logprobs"][response], atol=1e-4, rtol=0)
    assert reference["metrics"][-1]["seq_masked_fraction"] == 0.75


def test_a_state_moved_between_engines_goes_on_exactly(ranks):
    """`state_dict()` into a fresh engine (other random weights on every rank): the same weights,
    and the same steps after it, bit for bit, as the engine that saved it."""
    led = ranks["led"]
    assert led["loaded_version"] == NUM_RL_STEPS
    _assert_equal_exports(led["loaded"], led["weights"])
    _assert_equal_exports(led["reloaded"], led["continued"])
    assert led["reloaded_metrics"] == led["resume_metrics"]
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(led["weights"], led["continued"]))  # the resumed steps did train


def test_state_dict_is_the_torch_engines_format_both_ways(ranks, reference, run_torch):
    """A torch engine continues where megatron stopped, and megatron engines that loaded the torch
    engine's state (saved with other settings) continue as megatron did, keeping their own lr."""
    led = ranks["led"]
    state = led["state"]
    want = reference["engine"].state_dict()
    assert state["model"].keys() == want["model"].keys()
    assert state["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    assert state["optimizer"]["param_groups"][0]["params"] == want["optimizer"]["param_groups"][0]["params"]
    engine = TorchTrainEngine(_model(9), **ENGINE)
    engine.load_state_dict(state)
    assert engine.version == NUM_RL_STEPS
    run_torch(engine, reference["batch"], reference["advantages"], RESUME)
    _assert_same_weights(list(engine.named_weights()), led["continued"])
    assert led["from_torch_version"] == NUM_RL_STEPS
    assert led["from_torch_settings"] == {"lr": ENGINE["lr"], "weight_decay": ENGINE["weight_decay"], "fused": True}
    _assert_same_weights(led["from_torch"], led["continued"])


def test_a_state_without_optimizer_state_gives_a_fresh_adamw(ranks):
    """An engine that stepped loads a state saved before any step: its next step is a fresh
    engine's, bit for bit, on every rank (rank 1's moments are cleared too, or the weights part)."""
    assert ranks["led"]["after_nonfinite"]["optimizer"]["state"] == {}
    _assert_equal_exports(ranks["led"]["reset"], ranks["led"]["fresh"])


def test_a_step_with_non_finite_gradients_is_skipped_on_every_rank(ranks):
    assert "at 1 optimizer steps in a row, the last at version 0; train.max_nonfinite_steps=0" in ranks["led"]["nonfinite"]
    state = ranks["led"]["after_nonfinite"]
    assert state["version"] == 0
    initial = _model(11).state_dict()
    assert state["model"].keys() == initial.keys() and all(torch.equal(t, initial[name]) for name, t in state["model"].items())


def test_followers_build_every_engine_and_take_every_step(ranks):
    """Rank 1 built every engine rank 0 built and took each step on its share of the rows that
    ran (rank 0 shares out only rows with advantage: one of two in policy steps, none when all are
    zero or when sequence masks leave one, which an uneven split keeps on rank 0; 3 of 6 in
    supervised ones). Exports are rank 0's alone: every rank holds the whole model."""
    rows = sum(3 if step == "sft" else 0 if step.get("scale") == 0 or "seq_mask_low" in step else 1 for step in PLAN)
    resume_rows = sum(3 if step == "sft" else 1 for step in RESUME)
    assert ranks["follower"] == {
        "engines": 6,  # the first, the one that loaded its state, the one that loaded the torch state, strict, reset, fresh
        "steps": len(PLAN) + 3 * len(RESUME) + 3,  # the strict engine's step raised: not counted
        "rows": rows + 3 * resume_rows + 1 + 2 * 1,
        "exports": 0,
        "critic_steps": 0,  # no critic was built (tests/engines/test_led_critic.py builds one)
    }


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"padding_free": True}, "train.padding_free=true: the megatron engine runs megatron-core's local attention, which takes no packed sequences"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: the megatron engine trains data parallel only"),
        ({"micro_batch_size": 0}, "micro_batch_size must be >= 1"),
    ],
)
def test_settings_it_cannot_run_are_refused_before_anything_starts(options, message):
    """No process group is needed to be told: these raise before the engine joins one."""
    with pytest.raises(ValueError, match=message):
        MegatronTrainEngine(_model(0), **options)


def test_mixed_precision_is_refused_on_the_host():
    """megatron-core's linear layers autocast on CUDA only (`hal.megatron.check_precision`)."""
    from tidal.hal import PlatformError

    with pytest.raises(PlatformError, match="precision=bf16: megatron-core's linear layers take mixed precision on accelerators only"):
        MegatronTrainEngine(_model(0), precision="bf16")


def test_models_it_cannot_build_are_refused_by_what_they_lack():
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=T.vocab_size, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not one of"):
        MegatronTrainEngine(gpt2)
    scaled = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=T.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="the megatron train engine builds plain rotary positions"):
        MegatronTrainEngine(scaled)
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=T.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=16, max_position_embeddings=64))
    with pytest.raises(ValueError, match="sliding window of 16"):
        MegatronTrainEngine(windowed)


def test_a_kl_term_without_a_reference_is_refused_before_anything_runs():
    """An engine built without `kl_reference` holds no reference policy (`tidal run` builds it
    with one for `algorithm.kl_coef > 0`: tests/tools/test_megatron_run.py); the check needs no model."""
    engine = object.__new__(MegatronTrainEngine)
    engine.reference, engine.kl_reference, engine.led, engine.rank = None, False, True, 0
    batch = TokenBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="a loss with kl_coef=0.1 needs a reference policy: build the engine with kl_reference=True"):
        engine.train_step(batch, torch.zeros(1), loss=PolicyLossConfig(kl_coef=0.1))
