"""Hugging Face <-> megatron-core weight conversion (`tidal.engines.megatron_convert`), against
transformers' Qwen2 with random weights: exact round trips, the names and shard shapes
megatron-core allocates, the per-query-group qkv and per-rank [gate; up] layouts checked row
by row, q/k/v projections and the MLP recomputed the way megatron-core's attention.py and
mlp.py do, and the errors. Where megatron-core is importable, it runs the converted weights
(patched onto CPU) and its logits must be HF's."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tidal.engines.megatron_convert import GPTShape, hf_to_megatron, iter_hf_weights, megatron_shard_shapes, megatron_to_hf, padded_vocab_size

HIDDEN, HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 16, 96, 100, 2


def _config(*, kv_heads: int = 2, tie: bool = False) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM, num_hidden_layers=LAYERS,
        intermediate_size=FFN, vocab_size=VOCAB, tie_word_embeddings=tie,
    )


def _qwen2(*, kv_heads: int = 2, tie: bool = False, seed: int = 0) -> Qwen2ForCausalLM:
    """A small Qwen2 whose every tensor (norms and biases too, which start as ones and zeros) is random."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_config(kv_heads=kv_heads, tie=tie)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _qwen3(*, kv_heads: int = 2, tie: bool = False, seed: int = 0) -> Qwen3ForCausalLM:
    """A small Qwen3 (per-head q/k norms, no biases; a head width other than hidden / heads, as
    Qwen3-0.6B's 128 against 1024 / 16), every tensor random."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=2 * HEAD_DIM, num_hidden_layers=LAYERS,
        intermediate_size=FFN, vocab_size=VOCAB, tie_word_embeddings=tie,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


CASES = [(2, False), (2, True), (HEADS, False), (HEADS, True)]
"""(kv heads, tied embeddings): GQA and MHA, untied and tied."""


@pytest.mark.parametrize("build", [_qwen2, _qwen3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("kv_heads", "tie"), CASES)
def test_round_trip_is_exact(kv_heads, tie, tp, spec, build):
    model = build(kv_heads=kv_heads, tie=tie)
    shape = GPTShape.from_hf_config(model.config)
    hf = model.state_dict()
    shards = hf_to_megatron(hf, shape, tp_size=tp, spec=spec)
    assert len(shards) == tp
    back = megatron_to_hf(shards, shape, spec=spec)
    want = {k: v for k, v in hf.items() if not (tie and k == "lm_head.weight")}  # tied: as HF checkpoints, no lm_head
    assert set(back) == set(want)
    for name, tensor in want.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_tied_result_loads_into_a_fresh_model_and_gives_the_same_logits():
    model = _qwen2(tie=True)
    shape = GPTShape.from_hf_config(model.config)
    back = megatron_to_hf(hf_to_megatron(model.state_dict(), shape, tp_size=2), shape)
    fresh = Qwen2ForCausalLM(_config(tie=True)).eval()
    result = fresh.load_state_dict(back, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {"lm_head.weight"}
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def _te_layer_names(i: int) -> list[str]:
    p = f"decoder.layers.{i}."
    return [p + s for s in (
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
    )]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("kv_heads", "tie"), CASES)
def test_shards_have_megatron_core_names_and_shapes(kv_heads, tie, tp):
    model = _qwen2(kv_heads=kv_heads, tie=tie)
    shards = hf_to_megatron(model.state_dict(), GPTShape.from_hf_config(model.config), tp_size=tp)
    padded = -(-VOCAB // (128 * tp)) * 128 * tp  # megatron's vocab_size_with_padding
    assert padded == 128 * tp  # 100 rows pad to 128 per rank
    qkv_rows = (HEADS + 2 * kv_heads) * HEAD_DIM
    want = {"embedding.word_embeddings.weight": (padded // tp, HIDDEN), "decoder.final_layernorm.weight": (HIDDEN,)}
    if not tie:
        want["output_layer.weight"] = (padded // tp, HIDDEN)
    for i in range(LAYERS):
        sizes = [(HIDDEN,), (qkv_rows // tp, HIDDEN), (qkv_rows // tp,), (HIDDEN, HEADS * HEAD_DIM // tp), (HIDDEN,), (2 * FFN // tp, HIDDEN), (HIDDEN, FFN // tp)]
        want.update(zip(_te_layer_names(i), sizes))
    for shard in shards:
        assert {k: tuple(v.shape) for k, v in shard.items()} == want
    assert megatron_shard_shapes(GPTShape.from_hf_config(model.config), tp_size=tp) == want


def test_local_spec_names_its_layernorms_on_the_layer():
    model = _qwen2()
    shard = hf_to_megatron(model.state_dict(), GPTShape.from_hf_config(model.config), spec="local")[0]
    layer = {k.removeprefix("decoder.layers.0.") for k in shard if k.startswith("decoder.layers.0.")}
    assert layer == {
        "input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
    }
    hf = model.state_dict()
    assert torch.equal(shard["decoder.layers.0.input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"])
    assert torch.equal(shard["decoder.layers.0.pre_mlp_layernorm.weight"], hf["model.layers.0.post_attention_layernorm.weight"])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv_heads", [2, HEADS])
def test_each_query_groups_rows_are_its_q_heads_then_its_k_then_its_v(kv_heads, tp):
    model = _qwen2(kv_heads=kv_heads)
    hf = model.state_dict()
    shards = hf_to_megatron(hf, GPTShape.from_hf_config(model.config), tp_size=tp)
    per_group_q = HEADS // kv_heads * HEAD_DIM
    group_rows = per_group_q + 2 * HEAD_DIM
    groups_per_rank = kv_heads // tp
    for group in range(kv_heads):
        rank, local = divmod(group, groups_per_rank)
        for kind in ("weight", "bias"):
            fused = shards[rank][f"decoder.layers.1.self_attention.linear_qkv.{kind}"]
            rows = fused[local * group_rows : (local + 1) * group_rows]
            attn = "model.layers.1.self_attn."
            assert torch.equal(rows[:per_group_q], hf[f"{attn}q_proj.{kind}"][group * per_group_q : (group + 1) * per_group_q])
            assert torch.equal(rows[per_group_q : per_group_q + HEAD_DIM], hf[f"{attn}k_proj.{kind}"][group * HEAD_DIM : (group + 1) * HEAD_DIM])
            assert torch.equal(rows[per_group_q + HEAD_DIM :], hf[f"{attn}v_proj.{kind}"][group * HEAD_DIM : (group + 1) * HEAD_DIM])


@pytest.mark.parametrize("tp", [1, 2])
def test_fc1_on_each_rank_is_its_gate_slice_then_its_up_slice(tp):
    model = _qwen2()
    hf = model.state_dict()
    shards = hf_to_megatron(hf, GPTShape.from_hf_config(model.config), tp_size=tp)
    part = FFN // tp
    for rank, shard in enumerate(shards):
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:part], hf["model.layers.0.mlp.gate_proj.weight"][rank * part : (rank + 1) * part])
        assert torch.equal(fc1[part:], hf["model.layers.0.mlp.up_proj.weight"][rank * part : (rank + 1) * part])


@pytest.mark.parametrize("tie", [False, True])
def test_row_parallel_and_vocab_parallel_splits(tie):
    model = _qwen2(tie=tie)
    hf = model.state_dict()
    shards = hf_to_megatron(hf, GPTShape.from_hf_config(model.config), tp_size=2, make_vocab_size_divisible_by=32)
    assert [s["embedding.word_embeddings.weight"].shape[0] for s in shards] == [64, 64]  # 100 -> 128 = a multiple of 32 * 2
    table = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert torch.equal(table[:VOCAB], hf["model.embed_tokens.weight"]) and not table[VOCAB:].any()
    assert ("output_layer.weight" in shards[0]) is not tie
    for rank, shard in enumerate(shards):
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_proj.weight"], hf["model.layers.0.self_attn.o_proj.weight"][:, rank * 32 : (rank + 1) * 32])
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.0.mlp.down_proj.weight"][:, rank * 48 : (rank + 1) * 48])
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"], hf["model.layers.0.post_attention_layernorm.weight"])
    assert padded_vocab_size(VOCAB, tp_size=2, make_vocab_size_divisible_by=32) == 128


def _megatron_qkv(shards: list[dict], x: torch.Tensor, layer: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v heads `[tokens, heads, head_dim]` over all ranks, each rank's computed as
    megatron-core's `SelfAttention.get_query_key_value_tensors` (transformer/attention.py) does,
    then put together in head order (rank r holds query heads r*np/tp ..)."""
    tp = len(shards)
    name = f"decoder.layers.{layer}.self_attention.linear_qkv."
    outs = [x @ s[name + "weight"].T + s[name + "bias"] for s in shards]  # linear_qkv on each rank
    groups_per_rank = max(kv_heads // tp, 1)  # num_query_groups_per_partition
    heads_per_rank = HEADS // kv_heads if kv_heads < tp else HEADS // tp  # num_attention_heads_per_partition
    per_group = heads_per_rank // groups_per_rank
    qs, ks, vs = [], [], []
    for rank, mixed in enumerate(outs):
        if kv_heads < tp:  # all-gather the ranks' outputs, keep this rank's query group
            mixed = torch.cat(outs, dim=-1)
            size = mixed.shape[-1] // kv_heads
            idx = rank // (tp // kv_heads)
            mixed = mixed[:, idx * size : (idx + 1) * size]
        mixed = mixed.view(x.shape[0], groups_per_rank, (per_group + 2) * HEAD_DIM)
        q, k, v = torch.split(mixed, [per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=2)
        q = q.reshape(x.shape[0], -1, HEAD_DIM)
        if kv_heads < tp:  # this rank's share of its group's query heads
            size = heads_per_rank // (tp // kv_heads)
            idx = rank % (tp // kv_heads)
            q = q[:, idx * size : (idx + 1) * size]
        qs.append(q)
        if kv_heads >= tp or rank % (tp // kv_heads) == 0:  # ranks sharing a group hold the same k/v
            ks.append(k)
            vs.append(v)
    return torch.cat(qs, dim=1), torch.cat(ks, dim=1), torch.cat(vs, dim=1)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [1, 2, HEADS])
def test_qkv_projections_match_hf_attention(kv_heads, tp):
    model = _qwen2(kv_heads=kv_heads)
    shards = hf_to_megatron(model.state_dict(), GPTShape.from_hf_config(model.config), tp_size=tp)
    x = torch.randn(5, HIDDEN)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        q, k, v = _megatron_qkv(shards, x, 1, kv_heads)
        assert q.shape == (5, HEADS, HEAD_DIM) and k.shape == v.shape == (5, kv_heads, HEAD_DIM)
        torch.testing.assert_close(q, attn.q_proj(x).view(5, HEADS, HEAD_DIM))
        torch.testing.assert_close(k, attn.k_proj(x).view(5, kv_heads, HEAD_DIM))
        torch.testing.assert_close(v, attn.v_proj(x).view(5, kv_heads, HEAD_DIM))
        # linear_proj is row parallel: each rank's heads through its columns, summed (the all-reduce)
        heads = torch.randn(5, HEADS * HEAD_DIM)
        part = HEADS * HEAD_DIM // tp
        out = sum(heads[:, r * part : (r + 1) * part] @ s["decoder.layers.1.self_attention.linear_proj.weight"].T for r, s in enumerate(shards))
        torch.testing.assert_close(out, attn.o_proj(heads))


@pytest.mark.parametrize("tp", [1, 2])
def test_mlp_computed_as_megatron_does_matches_hf(tp):
    model = _qwen2()
    shards = hf_to_megatron(model.state_dict(), GPTShape.from_hf_config(model.config), tp_size=tp)
    x = torch.randn(5, HIDDEN)
    out = 0
    for s in shards:  # transformer/mlp.py: linear_fc1, glu (chunk in two, silu on the first), linear_fc2, all-reduce
        x_glu, x_linear = torch.chunk(x @ s["decoder.layers.0.mlp.linear_fc1.weight"].T, 2, dim=-1)
        out = out + (functional.silu(x_glu) * x_linear) @ s["decoder.layers.0.mlp.linear_fc2.weight"].T
    with torch.no_grad():
        torch.testing.assert_close(out, model.model.layers[0].mlp(x))


def test_iter_hf_weights_streams_in_model_order():
    model = _qwen2()
    shape = GPTShape.from_hf_config(model.config)
    shards = hf_to_megatron(model.state_dict(), shape, tp_size=2)
    pairs = list(iter_hf_weights(shards, shape))
    names = [n for n, _ in pairs]
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers) and len(names) == len(set(names))
    assert dict(pairs).keys() == megatron_to_hf(shards, shape).keys()
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in pairs)


def test_extra_state_entries_of_a_megatron_state_dict_are_skipped():
    model = _qwen2()
    shape = GPTShape.from_hf_config(model.config)
    shards = hf_to_megatron(model.state_dict(), shape)
    shards[0]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    assert set(megatron_to_hf(shards, shape)) == set(model.state_dict())


def test_from_hf_config():
    shape = GPTShape.from_hf_config(_config(tie=True))
    assert shape == GPTShape(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM, ffn_hidden_size=FFN,
        vocab_size=VOCAB, tie_word_embeddings=True, qkv_bias=True,
    )
    assert GPTShape.from_hf_config(_config(tie=True).to_dict()) == shape
    raw = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 100}
    llama = GPTShape.from_hf_config(raw)  # an old config.json: no head_dim, no kv heads (MHA), no biases
    assert (llama.head_dim, llama.num_key_value_heads, llama.qkv_bias, llama.tie_word_embeddings) == (16, 4, False, False)
    with pytest.raises(ValueError, match="attention_bias"):
        GPTShape.from_hf_config({**raw, "attention_bias": True})
    with pytest.raises(ValueError, match="mlp_bias"):
        GPTShape.from_hf_config({**raw, "mlp_bias": True})
    with pytest.raises(ValueError, match="hidden_act"):
        GPTShape.from_hf_config({**raw, "hidden_act": "gelu"})
    qwen3 = GPTShape.from_hf_config({**raw, "model_type": "qwen3", "head_dim": 32})
    assert (qwen3.qk_layernorm, qwen3.qkv_bias, qwen3.head_dim, llama.qk_layernorm) == (True, False, 32, False)
    with pytest.raises(ValueError, match="attention_bias=True: qwen3's o_proj bias"):
        GPTShape.from_hf_config({**raw, "model_type": "qwen3", "attention_bias": True})
    with pytest.raises(ValueError, match="qwen3_moe"):
        GPTShape.from_hf_config({**raw, "model_type": "qwen3_moe"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        GPTShape.from_hf_config({**raw, "num_key_value_heads": 3})


def test_hf_side_errors_name_the_tensor():
    model = _qwen2()
    shape = GPTShape.from_hf_config(model.config)
    hf = model.state_dict()
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.self_attn\.k_proj\.bias"):
        hf_to_megatron(missing, shape)
    with pytest.raises(ValueError, match=r"unexpected .*model\.layers\.0\.self_attn\.o_proj\.bias"):
        hf_to_megatron({**hf, "model.layers.0.self_attn.o_proj.bias": torch.zeros(HIDDEN)}, shape)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(95, 64\)"):
        hf_to_megatron({**hf, "model.layers.0.mlp.up_proj.weight": torch.zeros(FFN - 1, HIDDEN)}, shape)
    with pytest.raises(ValueError, match=r"unexpected .*model\.layers\.1\."):  # weights of more layers than the shape says
        hf_to_megatron(hf, dataclasses.replace(shape, num_layers=1))
    tied_model = _qwen2(tie=True)
    tied_shape = GPTShape.from_hf_config(tied_model.config)
    tied = tied_model.state_dict()
    assert len(hf_to_megatron({k: v for k, v in tied.items() if k != "lm_head.weight"}, tied_shape)) == 1  # a checkpoint without lm_head
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_to_megatron({**tied, "lm_head.weight": tied["lm_head.weight"] + 1}, tied_shape)


@pytest.mark.parametrize(("kv_heads", "tp", "match"), [
    (2, 3, "tp_size=3 does not divide num_attention_heads=4"),
    (HEADS, 8, "tp_size=8 does not divide num_attention_heads=4"),
    (2, 0, "tp_size must be a positive int"),
])
def test_bad_tp_sizes_are_refused(kv_heads, tp, match):
    model = _qwen2(kv_heads=kv_heads)
    with pytest.raises(ValueError, match=match):
        hf_to_megatron(model.state_dict(), GPTShape.from_hf_config(model.config), tp_size=tp)


def test_tp_that_does_not_divide_the_kv_heads_is_refused():
    shape = GPTShape(num_layers=1, hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=16, ffn_hidden_size=96, vocab_size=100, tie_word_embeddings=False, qkv_bias=True)
    with pytest.raises(ValueError, match="tp_size=2 does not divide num_key_value_heads=3"):
        megatron_shard_shapes(shape, tp_size=2)
    shape = GPTShape(num_layers=1, hidden_size=64, num_attention_heads=12, num_key_value_heads=4, head_dim=16, ffn_hidden_size=96, vocab_size=100, tie_word_embeddings=False, qkv_bias=True)
    with pytest.raises(ValueError, match="tp_size=6 is larger than num_key_value_heads=4"):
        megatron_shard_shapes(shape, tp_size=6)
    with pytest.raises(ValueError, match="tp_size=2 does not divide ffn_hidden_size=97"):
        megatron_shard_shapes(dataclasses.replace(shape, ffn_hidden_size=97), tp_size=2)


def test_megatron_side_errors_name_the_rank_and_tensor():
    model = _qwen2()
    shape = GPTShape.from_hf_config(model.config)
    shards = hf_to_megatron(model.state_dict(), shape, tp_size=2)
    name = "decoder.layers.1.mlp.linear_fc2.weight"
    with pytest.raises(ValueError, match=rf"rank 1 of 2: missing .*{name}"):
        megatron_to_hf([shards[0], {k: v for k, v in shards[1].items() if k != name}], shape)
    with pytest.raises(ValueError, match=r"rank 0 of 2: unexpected .*decoder\.layers\.0\.self_attention\.linear_proj\.bias"):
        megatron_to_hf([{**shards[0], "decoder.layers.0.self_attention.linear_proj.bias": torch.zeros(HIDDEN)}, shards[1]], shape)
    with pytest.raises(ValueError, match=rf"rank 1 of 2: {name} has shape \(64, 96\), expected \(64, 48\)"):
        megatron_to_hf([shards[0], {**shards[1], name: torch.zeros(HIDDEN, FFN)}], shape)
    with pytest.raises(ValueError, match=r"embedding\.word_embeddings\.weight has shape \(128, 64\), expected \(64, 64\)"):
        megatron_to_hf(shards, shape, make_vocab_size_divisible_by=32)  # a padding other than the one the shards were made with
    norm = "decoder.final_layernorm.weight"
    with pytest.raises(ValueError, match=rf"{norm} is replicated .* rank 1's differs"):
        megatron_to_hf([shards[0], {**shards[1], norm: shards[1][norm] + 1}], shape)
    with pytest.raises(ValueError, match="tp_size=3 does not divide"):
        megatron_to_hf([shards[0]] * 3, shape)
    with pytest.raises(ValueError, match="non-empty sequence"):
        megatron_to_hf([], shape)
    with pytest.raises(ValueError, match="missing"):  # the error comes at the call, before any pair
        iter_hf_weights([{}], shape)


MEGATRON_SCRIPT = textwrap.dedent('''
    """One tensor-parallel rank: HF Qwen2 or Qwen3 -> tidal's conversion -> megatron-core GPTModel
    (local spec, CPU, gloo) -> logits, which must be HF's."""
    import contextlib, os, sys
    import torch, torch.nn.functional as F
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from tidal.engines.megatron_convert import GPTShape, hf_to_megatron, megatron_to_hf

    tp, kv_heads, tie, family = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
    qwen3 = family == "qwen3"
    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import TransformerConfig

    # megatron-core has no CPU path: its rotary embedding moves inv_freq to the current CUDA
    # device, and attention forks a CUDA RNG tracker around dropout (0 here)
    torch.cuda.current_device = lambda: "cpu"
    mcore_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)

    torch.manual_seed(0)
    head_dim = 32 if qwen3 else 16  # Qwen3's heads are wider than hidden / heads
    config = (Qwen3Config if qwen3 else Qwen2Config)(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                         num_hidden_layers=2, intermediate_size=96, vocab_size=100, tie_word_embeddings=tie)
    hf_model = (Qwen3ForCausalLM if qwen3 else Qwen2ForCausalLM)(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.2)
    shape = GPTShape.from_hf_config(config)
    shards = hf_to_megatron(hf_model.state_dict(), shape, tp_size=tp, spec="local")

    mcore_config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=kv_heads, kv_channels=head_dim, ffn_hidden_size=96,
        normalization="RMSNorm", layernorm_epsilon=config.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=not qwen3, qk_layernorm=qwen3, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=tp,
    )
    model = GPTModel(config=mcore_config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qwen3),
                     vocab_size=shards[0]["embedding.word_embeddings.weight"].shape[0] * tp, max_sequence_length=64,
                     position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=tie).eval()
    state = model.state_dict()
    weights = {k for k in state if not k.endswith("._extra_state")}
    assert weights == set(shards[rank]), (sorted(weights ^ set(shards[rank])))
    for name, tensor in shards[rank].items():
        assert state[name].shape == tensor.shape, (name, state[name].shape, tensor.shape)
    result = model.load_state_dict(shards[rank], strict=False)
    assert not result.unexpected_keys and all(k.endswith("._extra_state") for k in result.missing_keys), result

    ids = torch.randint(0, 100, (2, 7))
    positions = torch.arange(7).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, 7, 7, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(ids, positions, mask)  # [batch, seq, vocab / tp]: this rank's vocabulary slice
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits.contiguous())
        want = hf_model(ids).logits
    torch.testing.assert_close(torch.cat(parts, dim=-1)[..., :100], want, rtol=1e-4, atol=1e-4)

    # and back: the model's own state dicts, gathered, convert to the HF weights
    gathered = [None] * tp
    torch.distributed.all_gather_object(gathered, {k: v for k, v in model.state_dict().items()})
    back = megatron_to_hf(gathered, shape, spec="local")
    for name, tensor in back.items():
        assert torch.equal(tensor, hf_model.state_dict()[name]), name
    print("ok", rank)
''')


def _has_megatron_core() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _has_megatron_core(), reason="megatron-core is not installed")
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize(("tp", "kv_heads", "tie"), [(2, 2, True)])  # vocab-parallel with a tied output (tp 1 runs in tests/engines/test_megatron_train.py; tp above the kv heads is checked against megatron's attention code in test_qkv_projections_match_hf_attention)
def test_megatron_core_gives_hf_logits_from_converted_weights(tmp_path, tp, kv_heads, tie, family):
    script = tmp_path / "rank.py"
    script.write_text(MEGATRON_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(tp), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(tp), str(kv_heads), str(int(tie)), family], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(tp)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"ok {rank}" in out, f"rank {rank}:\n{out[-4000:]}"
