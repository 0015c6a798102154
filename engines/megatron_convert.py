"""Hugging Face <-> megatron-core weight conversion for Qwen2 / Llama-family models: pure
functions, torch tensors in and out, megatron-core never imported.

`hf_to_megatron` turns a transformers state dict (`Qwen2ForCausalLM`, `LlamaForCausalLM`,
`MistralForCausalLM`) into one state dict per tensor-parallel rank of megatron-core's
`GPTModel`, named and laid out as `GPTModel.named_parameters()` has them on that rank;
`megatron_to_hf` and `iter_hf_weights` (one tensor at a time, in HF names: what a trainer
hands tidal's weight transports for a vLLM rollout engine) go back; `Qwen3ForCausalLM` too,
whose per-head RMSNorms of the queries and keys (`q_norm`, `k_norm`) are megatron's
`q_layernorm` / `k_layernorm` (`qk_layernorm=True`: applied to each head's `hn` values
after the qkv projection and before the rotary embedding, where transformers' Qwen3 applies
them). One pipeline stage holds every layer (pipeline parallelism is not handled); no MoE.

Layout, as checked in NVIDIA/Megatron-LM (core_v0.16 .. main) and the converters of
ISEEKYAN/mbridge (`mbridge/core/bridge.py`, `_weight_to_mcore_format`,
`_weight_split_across_tp`, `_weight_merge_across_tp`; names in `mbridge/models/llama.py`)
and volcengine/verl (`verl/models/mcore/weight_converter.py`):

- Names follow the Transformer Engine layer spec (`get_gpt_layer_with_transformer_engine_spec`,
  megatron/core/models/gpt/gpt_layer_specs.py): the input layernorm is fused into
  `self_attention.linear_qkv` (TE `LayerNormLinear`, whose RMSNorm weight is
  `layer_norm_weight`: transformer_engine/pytorch/module/layernorm_linear.py) and the
  post-attention one into `mlp.linear_fc1`. `spec="local"` gives the names of the local spec
  (`get_gpt_layer_local_spec`): `input_layernorm.weight` and `pre_mlp_layernorm.weight` on
  the layer (megatron/core/transformer/transformer_layer.py). Outside the layers:
  `embedding.word_embeddings.weight` (common/embeddings/language_model_embedding.py),
  `decoder.final_layernorm.weight` (transformer/transformer_block.py) and `output_layer.weight`
  (models/gpt/gpt_model.py), the last absent when embeddings are tied
  (`share_embeddings_and_output_weights` with one pipeline stage: `skip_weight_param_allocation`).
- `linear_qkv` (transformer/attention.py, `SelfAttention.get_query_key_value_tensors`) holds,
  per query group (= key/value head), that group's query heads, then its key head, then its
  value head: `[sq, b, ng * (np/ng + 2) * hn]` viewed as `[.., ng, (np/ng + 2) * hn]` and
  split `[np/ng * hn, hn, hn]`. HF query head h belongs to key/value head h // (np/ng)
  (transformers' `repeat_kv`). It is column parallel: rank r holds rows r/tp .. (r+1)/tp of
  that fused weight (and bias), i.e. whole query groups when tp divides num_key_value_heads.
  When tp is a multiple of num_key_value_heads larger than it, megatron-core >= 0.16
  (commit f7dfb99 "Support TP greater than num_kv_heads by supporting QKV activation
  sub-sharding") still splits those rows evenly, all-gathers the activations and picks its
  group and query heads; older versions refuse such a tp when building the model. Key/value
  heads are never replicated in the weights.
- `linear_fc1` (transformer/mlp.py): the SwiGLU `glu` chunks each rank's output in two,
  activation on the first half, so rank r holds [its slice of gate_proj; its slice of up_proj]
  (`apply_swiglu_sharded_factory` writes the two halves to the global [gate; up] checkpoint).
- `linear_proj` and `linear_fc2` are row parallel (split along dim 1), layernorm weights are
  replicated, and the embedding and `output_layer` are vocab parallel (dim 0,
  tensor_parallel/utils.py `vocab_range_from_global_vocab_size`), the vocabulary padded with
  zero rows to a multiple of `make_vocab_size_divisible_by * tp`
  (megatron/core/tokenizers/utils/build_tokenizer.py `vocab_size_with_padding`; the
  `--make-vocab-size-divisible-by` default is 128). The padding rows are dropped on the way
  back (an output layer trains them, so they need not be zero any more).

The megatron model this matches: RMSNorm, `gated_linear_unit=True` with silu,
`add_bias_linear=False`, `add_qkv_bias=shape.qkv_bias`, `kv_channels=head_dim`,
`num_query_groups=num_key_value_heads`, `layernorm_zero_centered_gamma=False` and
`rotary_interleaved=False` (megatron's `_rotate_half` then is transformers' `rotate_half`, so
no row permutation of q/k is needed). Megatron's `model.state_dict()` also has
`*._extra_state` entries (TE / fp8 metadata, `None` without fp8): they are not weights,
`hf_to_megatron` makes none and the way back skips them. Load the shards with
`load_state_dict(strict=False)` or by copying into `named_parameters()`.

Returned tensors may share memory with the input (and replicated ones with each other
across ranks): clone before changing one in place. The tests compare against transformers'
Qwen2, and run real megatron-core (on CPU over gloo, patched for the host, which it
has no path for) on the converted shards at tensor parallel 2, comparing its
logits with transformers'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

LayerSpec = Literal["te", "local"]
"""Which megatron-core layer spec's parameter names: Transformer Engine's (`te`, layernorms
fused into `linear_qkv` / `linear_fc1`) or megatron-core's own modules (`local`)."""

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
"""transformers `model_type`s whose weights are exactly the ones converted here."""

EXTRA_STATE = "._extra_state"
"""Suffix of megatron / Transformer Engine state-dict entries that are metadata, not weights."""

_REPLICATED, _QKV, _ROW, _GATED, _VOCAB = "replicated", "qkv", "row", "gated", "vocab"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTShape:
    """The sizes a conversion needs, in Hugging Face terms (megatron's in brackets)."""

    num_layers: int
    """Decoder layers (`num_hidden_layers`)."""
    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (megatron's `num_query_groups`); equal to the query heads for MHA."""
    head_dim: int
    """Width of one head (megatron's `kv_channels`)."""
    ffn_hidden_size: int
    """MLP width (`intermediate_size`), of gate_proj and of up_proj each."""
    vocab_size: int
    """Rows of the HF embedding, before megatron pads them."""
    tie_word_embeddings: bool
    """The output layer is the embedding (megatron's `share_embeddings_and_output_weights`)."""
    qkv_bias: bool
    """q/k/v projections have biases (Qwen2; megatron's `add_qkv_bias`)."""
    qk_layernorm: bool = False
    """Each query and key head is RMS-normalised before the rotary embedding (Qwen3's
    `q_norm` / `k_norm`; megatron's `qk_layernorm`)."""

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "ffn_hidden_size", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTShape.{field} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"GPTShape.num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}")

    @property
    def heads_per_group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused `linear_qkv` weight over all ranks: (heads + 2 * kv heads) * head_dim."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> GPTShape:
        """The shape of a transformers config (a `PretrainedConfig` or its dict, e.g. a parsed config.json).

        Raises:
            ValueError: the model type is not one of `SUPPORTED_MODEL_TYPES`, or the config asks for
                weights this converter does not map (an o_proj or MLP bias, an activation other than silu).
        """
        values = dict(config) if isinstance(config, Mapping) else config.to_dict()
        model_type = values.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        if values.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={values['hidden_act']!r}: megatron's SwiGLU (gated_linear_unit with silu) needs 'silu'")
        if values.get("mlp_bias"):
            raise ValueError("mlp_bias=True: MLP biases (megatron's add_bias_linear) are not converted")
        if model_type == "qwen2":
            qkv_bias = True
        elif values.get("attention_bias"):  # Llama's and Qwen3's attention_bias put a bias on o_proj too
            raise ValueError(f"attention_bias=True: {model_type}'s o_proj bias (megatron's linear_proj.bias, add_bias_linear) is not converted")
        else:
            qkv_bias = False
        heads = values["num_attention_heads"]
        return cls(
            num_layers=values["num_hidden_layers"],
            hidden_size=values["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=values.get("num_key_value_heads") or heads,
            head_dim=values.get("head_dim") or values["hidden_size"] // heads,
            ffn_hidden_size=values["intermediate_size"],
            vocab_size=values["vocab_size"],
            tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_layernorm=model_type == "qwen3",
        )


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One megatron tensor: its name, how it is laid out and split, and the HF tensors it holds."""

    megatron: str
    kind: str
    hf: tuple[str, ...]


def _entries(shape: GPTShape, spec: LayerSpec) -> list[_Entry]:
    """Every megatron tensor of `shape`, in model order (embedding, layer 0, 1, .., final norm, output)."""
    if spec not in ("te", "local"):
        raise ValueError(f"spec must be 'te' or 'local', got {spec!r}")
    out = [_Entry("embedding.word_embeddings.weight", _VOCAB, ("model.embed_tokens.weight",))]
    for i in range(shape.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn, mlp = f"{h}self_attn.", f"{h}mlp."
        out.append(_Entry(m + ("self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"), _REPLICATED, (h + "input_layernorm.weight",)))
        out.append(_Entry(m + "self_attention.linear_qkv.weight", _QKV, (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight")))
        if shape.qkv_bias:
            out.append(_Entry(m + "self_attention.linear_qkv.bias", _QKV, (f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias")))
        out.append(_Entry(m + "self_attention.linear_proj.weight", _ROW, (f"{attn}o_proj.weight",)))
        if shape.qk_layernorm:
            out.append(_Entry(m + "self_attention.q_layernorm.weight", _REPLICATED, (f"{attn}q_norm.weight",)))
            out.append(_Entry(m + "self_attention.k_layernorm.weight", _REPLICATED, (f"{attn}k_norm.weight",)))
        out.append(_Entry(m + ("mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight"), _REPLICATED, (h + "post_attention_layernorm.weight",)))
        out.append(_Entry(m + "mlp.linear_fc1.weight", _GATED, (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")))
        out.append(_Entry(m + "mlp.linear_fc2.weight", _ROW, (f"{mlp}down_proj.weight",)))
    out.append(_Entry("decoder.final_layernorm.weight", _REPLICATED, ("model.norm.weight",)))
    if not shape.tie_word_embeddings:
        out.append(_Entry("output_layer.weight", _VOCAB, ("lm_head.weight",)))
    return out


def padded_vocab_size(vocab_size: int, *, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: `vocab_size` rounded up to a multiple of `make_vocab_size_divisible_by * tp_size`."""
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be >= 1, got {make_vocab_size_divisible_by}")
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def check_tp_size(shape: GPTShape, tp_size: int) -> None:
    """Raise ValueError, naming the size, where megatron-core cannot split `shape` over `tp_size` ranks."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    groups = shape.num_key_value_heads
    if shape.num_attention_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide num_attention_heads={shape.num_attention_heads}")
    if tp_size <= groups and groups % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide num_key_value_heads={groups}")
    if tp_size > groups and (tp_size % groups or shape.qkv_rows % tp_size):
        raise ValueError(f"tp_size={tp_size} is larger than num_key_value_heads={groups} and megatron-core cannot sub-shard its query groups over it (tp must be a multiple of the kv heads)")
    if shape.ffn_hidden_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide ffn_hidden_size={shape.ffn_hidden_size}")


def hf_shapes(shape: GPTShape) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of `shape` and its size (without `lm_head.weight` when embeddings are tied)."""
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    out: dict[str, tuple[int, ...]] = {}
    for entry in _entries(shape, "te"):
        for name in entry.hf:
            module, kind = name.split(".")[-2:]
            if module in sizes:
                out[name] = (sizes[module], shape.hidden_size) if kind == "weight" else (sizes[module],)
            elif module == "o_proj":
                out[name] = (shape.hidden_size, q)
            elif module in ("gate_proj", "up_proj"):
                out[name] = (shape.ffn_hidden_size, shape.hidden_size)
            elif module == "down_proj":
                out[name] = (shape.hidden_size, shape.ffn_hidden_size)
            elif module in ("embed_tokens", "lm_head"):
                out[name] = (shape.vocab_size, shape.hidden_size)
            elif module in ("q_norm", "k_norm"):  # one head's width: each head is normalised alone
                out[name] = (shape.head_dim,)
            else:  # the layernorms
                out[name] = (shape.hidden_size,)
    return out


def megatron_shard_shapes(shape: GPTShape, *, tp_size: int = 1, make_vocab_size_divisible_by: int = 128, spec: LayerSpec = "te") -> dict[str, tuple[int, ...]]:
    """Every megatron tensor one tensor-parallel rank holds and its size there (the same on every rank).

    Raises:
        ValueError: `tp_size` cannot split `shape` (see `check_tp_size`).
    """
    check_tp_size(shape, tp_size)
    hidden, tp = shape.hidden_size, tp_size
    vocab = padded_vocab_size(shape.vocab_size, tp_size=tp, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    out: dict[str, tuple[int, ...]] = {}
    for entry in _entries(shape, spec):
        if entry.kind == _VOCAB:
            out[entry.megatron] = (vocab // tp, hidden)
        elif entry.kind == _QKV:
            out[entry.megatron] = (shape.qkv_rows // tp, hidden) if entry.megatron.endswith("weight") else (shape.qkv_rows // tp,)
        elif entry.kind == _GATED:
            out[entry.megatron] = (2 * shape.ffn_hidden_size // tp, hidden)
        elif entry.kind == _ROW:
            inner = shape.num_attention_heads * shape.head_dim if "linear_proj" in entry.megatron else shape.ffn_hidden_size
            out[entry.megatron] = (hidden, inner // tp)
        else:
            out[entry.megatron] = (shape.head_dim,) if entry.megatron.endswith(("q_layernorm.weight", "k_layernorm.weight")) else (hidden,)
    return out


def _check_names(have: set[str], want: set[str], where: str) -> None:
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing:
        raise ValueError(f"{where}: missing {len(missing)} tensor(s): {', '.join(missing[:8])}{' ..' if len(missing) > 8 else ''}")
    if unexpected:
        raise ValueError(f"{where}: unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}{' ..' if len(unexpected) > 8 else ''}")


def _check_shape(name: str, tensor: Any, want: tuple[int, ...], where: str) -> None:
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{where}: {name} is a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != want:
        raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, expected {want}")


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: GPTShape) -> Tensor:
    """[q; k; v] (HF) -> per query group [its q heads; its k head; its v head] (megatron)."""
    groups, rest = shape.num_key_value_heads, tuple(q.shape[1:])
    q = q.reshape(groups, shape.heads_per_group * shape.head_dim, *rest)
    k = k.reshape(groups, shape.head_dim, *rest)
    v = v.reshape(groups, shape.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(shape.qkv_rows, *rest)


def _split_qkv(fused: Tensor, shape: GPTShape) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of `_fuse_qkv`."""
    groups, rest, hn = shape.num_key_value_heads, tuple(fused.shape[1:]), shape.head_dim
    grouped = fused.reshape(groups, (shape.heads_per_group + 2) * hn, *rest)
    q, k, v = torch.split(grouped, [shape.heads_per_group * hn, hn, hn], dim=1)
    return q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()


def _to_shards(entry: _Entry, hf: list[Tensor], shape: GPTShape, tp: int, padded_vocab: int) -> list[Tensor]:
    """One megatron tensor, split over `tp` ranks, from its HF tensors."""
    if entry.kind == _REPLICATED:
        return [hf[0]] * tp
    if entry.kind == _QKV:
        q, k, v = hf
        return [t.contiguous() for t in _fuse_qkv(q, k, v, shape).chunk(tp, dim=0)]
    if entry.kind == _ROW:
        return [t.contiguous() for t in hf[0].chunk(tp, dim=1)]
    if entry.kind == _GATED:
        gate, up = hf
        return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    table = hf[0]
    padding = table.new_zeros(padded_vocab - table.shape[0], table.shape[1])
    return [t.contiguous() for t in torch.cat([table, padding], dim=0).chunk(tp, dim=0)]


def _from_shards(entry: _Entry, shards: list[Tensor], shape: GPTShape) -> list[Tensor]:
    """The HF tensors of one megatron tensor, from its shards on every rank (rank order)."""
    if entry.kind == _REPLICATED:
        for rank, other in enumerate(shards[1:], 1):
            if not torch.equal(other, shards[0]):
                raise ValueError(f"{entry.megatron} is replicated over tensor-parallel ranks, but rank {rank}'s differs from rank 0's")
        return [shards[0]]
    if entry.kind == _QKV:
        return list(_split_qkv(torch.cat(shards, dim=0), shape))
    if entry.kind == _ROW:
        return [torch.cat(shards, dim=1)]
    if entry.kind == _GATED:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)]
    return [torch.cat(shards, dim=0)[: shape.vocab_size].contiguous()]


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    shape: GPTShape,
    *,
    tp_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    spec: LayerSpec = "te",
) -> list[dict[str, Tensor]]:
    """Convert a transformers state dict into megatron-core `GPTModel` state dicts, one per tensor-parallel rank.

    Args:
        hf_state: the HF model's tensors by name (`model.state_dict()`, or a safetensors
            checkpoint's). With tied embeddings `lm_head.weight` may be there or not; if it is,
            it must equal `model.embed_tokens.weight`.
        shape: the model's sizes (`GPTShape.from_hf_config`).
        tp_size: tensor-parallel ranks.
        make_vocab_size_divisible_by: megatron's `--make-vocab-size-divisible-by`; the vocabulary
            is padded with zero rows to a multiple of this times `tp_size`.
        spec: which layer spec's names (`te` or `local`).

    Returns:
        For each rank, its tensors by megatron name (no `_extra_state` entries).

    Raises:
        ValueError: a tensor is missing or unexpected, has a shape other than `shape`'s, or
            `tp_size` cannot split `shape`; the message names it.
    """
    want = hf_shapes(shape)
    have = dict(hf_state)
    if shape.tie_word_embeddings and "lm_head.weight" in have:
        lm_head = have.pop("lm_head.weight")
        embed = have.get("model.embed_tokens.weight")
        if embed is not None and not (isinstance(lm_head, Tensor) and lm_head.shape == embed.shape and torch.equal(lm_head, embed)):
            raise ValueError("lm_head.weight differs from model.embed_tokens.weight, but shape.tie_word_embeddings is True")
    _check_names(set(have), set(want), "hf_state")
    for name, size in want.items():
        _check_shape(name, have[name], size, "hf_state")
    shard_shapes = megatron_shard_shapes(shape, tp_size=tp_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by, spec=spec)
    padded = padded_vocab_size(shape.vocab_size, tp_size=tp_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    out: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]
    for entry in _entries(shape, spec):
        for rank, tensor in enumerate(_to_shards(entry, [have[n] for n in entry.hf], shape, tp_size, padded)):
            assert tuple(tensor.shape) == shard_shapes[entry.megatron], (entry.megatron, tuple(tensor.shape))
            out[rank][entry.megatron] = tensor
    return out


def _checked_shards(shards: Sequence[Mapping[str, Tensor]], shape: GPTShape, make_vocab_size_divisible_by: int, spec: LayerSpec) -> list[dict[str, Tensor]]:
    """`shards` without `_extra_state` entries, after checking every rank's names and shapes."""
    if isinstance(shards, Mapping) or not len(shards):
        raise ValueError("shards must be a non-empty sequence of state dicts, one per tensor-parallel rank")
    want = megatron_shard_shapes(shape, tp_size=len(shards), make_vocab_size_divisible_by=make_vocab_size_divisible_by, spec=spec)
    out = []
    for rank, shard in enumerate(shards):
        where = f"tensor-parallel rank {rank} of {len(shards)}"
        weights = {name: tensor for name, tensor in shard.items() if not name.endswith(EXTRA_STATE)}
        _check_names(set(weights), set(want), where)
        for name, size in want.items():
            _check_shape(name, weights[name], size, where)
        out.append(weights)
    return out


def iter_hf_weights(
    shards: Sequence[Mapping[str, Tensor]],
    shape: GPTShape,
    *,
    make_vocab_size_divisible_by: int = 128,
    spec: LayerSpec = "te",
) -> Iterator[tuple[str, Tensor]]:
    """The HF tensors of a megatron-core model, one at a time in model order (embedding, layer
    0's, layer 1's, .., final norm, lm_head), each gathered from the ranks only when it is
    reached: the (name, tensor) pairs tidal's weight transports take.

    Every rank's names and shapes are checked before the first pair comes out. Arguments as
    for `megatron_to_hf`.

    Raises:
        ValueError: see `megatron_to_hf`.
    """
    checked = _checked_shards(shards, shape, make_vocab_size_divisible_by, spec)  # before the generator: errors come at the call
    return _iter_checked(checked, shape, spec)


def _iter_checked(shards: list[dict[str, Tensor]], shape: GPTShape, spec: LayerSpec) -> Iterator[tuple[str, Tensor]]:
    for entry in _entries(shape, spec):
        tensors = _from_shards(entry, [shard[entry.megatron] for shard in shards], shape)
        yield from zip(entry.hf, tensors)


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    shape: GPTShape,
    *,
    make_vocab_size_divisible_by: int = 128,
    spec: LayerSpec = "te",
) -> dict[str, Tensor]:
    """Convert megatron-core `GPTModel` state dicts, one per tensor-parallel rank in rank order, into a transformers state dict.

    Args:
        shards: each rank's tensors by megatron name (`model.state_dict()`; `*._extra_state`
            entries are skipped). Their number is the tensor-parallel size.
        shape: the model's sizes; its `vocab_size` is the HF one the padding is cut back to.
        make_vocab_size_divisible_by: as it was for `hf_to_megatron` (megatron's setting).
        spec: which layer spec's names (`te` or `local`).

    Returns:
        The HF tensors by name. With tied embeddings there is no `lm_head.weight`, as in HF
        checkpoints (load with `strict=False`; vLLM skips it for tied models anyway).

    Raises:
        ValueError: a rank misses a tensor or has an unexpected one, a shape is not what
            `shape` and the tensor-parallel size make, the number of ranks cannot split
            `shape`, or a replicated tensor differs between ranks; the message names it.
    """
    return dict(iter_hf_weights(shards, shape, make_vocab_size_divisible_by=make_vocab_size_divisible_by, spec=spec))
