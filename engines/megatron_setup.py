"""How the `megatron` train engine builds megatron-core (`MegatronTrainEngine.__init__`) and moves
state between megatron-core's names and the Hugging Face model's.

`megatron_model` turns a transformers Qwen2 / Qwen3 / Llama / Mistral model into megatron-core's
`GPTModel` with the same function: the local layer spec (`get_gpt_layer_local_spec`: megatron's
own modules, no Transformer Engine), RMSNorm, SwiGLU, no linear biases but Qwen2's q/k/v ones, Qwen3's q/k norms,
grouped-query attention, rotary positions with the HF config's base, untied or tied embeddings,
parameters in the HF model's dtype; the weights are the HF model's, converted by
`engines.megatron_convert` (the vocabulary padded with zero rows to a multiple of 128, which
the engine's logits leave out, so those rows never get a gradient). What the converter cannot
map, or megatron's local spec cannot compute the HF way, is refused by name
(`check_hf_config`).

`hf_optimizer_state` / `megatron_optimizer_state` carry AdamW's state between megatron's
parameters and the HF model's: the moments are laid out like the weights they belong to, so
the weight converter converts them too, and a state saved by one engine trains on in another.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist

from tidal.engines.fsdp_setup import TORCHRUN_VARS
from tidal.engines.megatron_convert import GPTShape, hf_shapes, hf_to_megatron, iter_hf_weights
from tidal.hal import Platform

_OPTIONAL_KERNELS = r"(Transformer Engine and )?Apex (is|are) not installed"
"""The start of the warnings megatron-core gives, once per module at import, that it falls back to
torch where Transformer Engine's or Apex's fused kernels are missing."""
SPEC: Literal["te", "local"] = "local"
"""The megatron-core layer spec the engine builds, and whose parameter names it converts."""
_HOST = torch.device("cpu")
_world_of_parallel_state: Any = None
"""The default process group megatron's parallel state was made over (by `init_parallel_state`)."""


@dataclasses.dataclass(frozen=True)
class HFLayout:
    """What the engine keeps of the Hugging Face model it was given: the names its exports and
    state dicts use."""

    shape: GPTShape
    """The model's sizes (`megatron_convert.GPTShape`)."""
    state_names: tuple[str, ...]
    """`state_dict()` names, in order (tied ones included: `lm_head.weight` of a tied model)."""
    param_names: tuple[str, ...]
    """`named_parameters()` names, in order (a tied weight once): how the torch engine's
    AdamW state indexes its parameters."""
    dtype: torch.dtype
    """The weights' dtype."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> HFLayout:
        return cls(GPTShape.from_hf_config(model.config), tuple(model.state_dict()), tuple(n for n, _ in model.named_parameters()), next(model.parameters()).dtype)

    @property
    def tied(self) -> tuple[str, ...]:
        """State-dict names that repeat another weight (a tied `lm_head.weight`), exported beside it."""
        return ("lm_head.weight",) if self.shape.tie_word_embeddings and "lm_head.weight" in self.state_names else ()


def check_hf_config(model: torch.nn.Module) -> None:
    """Raises ValueError naming what of `model`'s config the megatron engine cannot build (before
    any collective): a model type or weight the converter does not map, rotary scaling, a
    sliding attention window."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"the megatron train engine converts a transformers model (Qwen2, Qwen3, Llama, Mistral) with a `config`; {type(model).__name__} has none")
    GPTShape.from_hf_config(config)  # raises for types and weights it does not map
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"the megatron train engine builds plain rotary positions; this model's config scales them ({rope}): use the torch or fsdp engine")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", window is not None) and window is not None and window < config.max_position_embeddings:
        raise ValueError(f"the megatron train engine attends to every earlier token; this model's config has a sliding window of {window}: use the torch or fsdp engine")


def _rope_parameters(config: Any) -> dict[str, Any]:
    """The rotary settings of a transformers config: `rope_parameters` (transformers 5), else `rope_theta` and `rope_scaling` (4.x)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, Mapping):
        return dict(rope)
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}


def quiet_optional_kernels() -> None:
    """Ignore megatron-core's warnings that Transformer Engine and Apex are missing (call it before
    megatron-core is imported): the local layer spec the engine builds uses neither, and each
    warning would fill a run's log once per module that checks."""
    warnings.filterwarnings("ignore", message=_OPTIONAL_KERNELS, category=UserWarning)


def ensure_process_group(platform: Platform) -> None:
    """Use the initialised default process group, or initialise it through hal from torchrun's variables."""
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            "the megatron train engine needs an initialised torch.distributed process group: call "
            "platform.init_process_group(rank=..., world_size=...) (tidal.hal) before building it, "
            f"or launch with torchrun; no process group is initialised and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set"
        )
    platform.init_process_group(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def init_parallel_state(tensor_parallel_size: int) -> None:
    """megatron's parallel state over the default process group: every rank a data-parallel rank
    (tensor and pipeline parallel size 1). Made once per default group; a collective the first
    time (megatron makes its groups), local after."""
    global _world_of_parallel_state
    from megatron.core import parallel_state  # noqa: PLC0415 - imported after `prepare_megatron`

    world = dist.group.WORLD
    if parallel_state.model_parallel_is_initialized():
        if _world_of_parallel_state is world:
            return
        parallel_state.destroy_model_parallel()  # made over a group that has gone (a test's earlier group)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size, create_gloo_process_groups=False)
    _world_of_parallel_state = world


def megatron_model(model: torch.nn.Module, layout: HFLayout) -> torch.nn.Module:
    """megatron-core's `GPTModel` computing what `model` (a transformers causal LM) computes, with
    its weights, on the host (the caller moves it), after `prepare_megatron(platform)` and
    `init_parallel_state`."""
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415 - after `prepare_megatron` (MindSpeed's adaptor goes first)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415

    config: Any = model.config  # a transformers config (a module's attribute types as Tensor | Module)
    shape = layout.shape
    transformer = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        attention_dropout=float(getattr(config, "attention_dropout", 0.0)),
        hidden_dropout=0.0,  # Qwen2, Qwen3 and Llama have none
        params_dtype=layout.dtype,
        use_cpu_initialization=True,  # built on the host and filled with the HF weights, then moved
        perform_initialization=False,  # every weight is overwritten
        tensor_model_parallel_size=1,
        cuda_graph_scope=[],  # (its default "full" is deprecated and warns)
    )
    weights = hf_to_megatron(model.state_dict(), shape, spec=SPEC)[0]
    built = GPTModel(
        config=transformer,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_layernorm),
        vocab_size=weights["embedding.word_embeddings.weight"].shape[0],
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=_rope_parameters(config)["rope_theta"],
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
    )
    result = built.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)  # the converter names what GPTModel allocates (tested)
    return built


def hf_weights(module: torch.nn.Module, layout: HFLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s weights in HF names, one at a time in model order, a tied `lm_head.weight` last
    (the embedding again); fused q/k/v and gate/up weights are split into new tensors, the
    others are the module's own (detached)."""
    state = {name: p.detach() for name, p in module.named_parameters()}
    embedding = None
    for name, tensor in iter_hf_weights([state], layout.shape, spec=SPEC):
        if name == "model.embed_tokens.weight":
            embedding = tensor
        yield name, tensor
    for name in layout.tied:
        assert embedding is not None  # a tied model has its embedding, yielded first
        yield name, embedding


def hf_weight_shapes(layout: HFLayout) -> list[tuple[str, tuple[int, ...]]]:
    """Each name `hf_weights` yields, in its order, with its shape (computed: nothing is read)."""
    shapes = hf_shapes(layout.shape)  # in model order (`iter_hf_weights`'), lm_head last when untied
    return [*shapes.items(), *((n, shapes["model.embed_tokens.weight"]) for n in layout.tied)]


def load_hf_weights(module: torch.nn.Module, layout: HFLayout, state: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named weights (a train engine's `state_dict()["model"]`) into `module`'s parameters.

    Raises:
        ValueError: a weight is missing, unexpected or of another shape (`hf_to_megatron`).
    """
    converted = hf_to_megatron(dict(state), layout.shape, spec=SPEC)[0]
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, tensor in converted.items():
            params[name].copy_(tensor)


def hf_optimizer_state(optimizer: torch.optim.Optimizer, module: torch.nn.Module, layout: HFLayout) -> dict[str, Any]:
    """`optimizer`'s state (torch's AdamW over `module.parameters()`) in the torch engine's format:
    indexed by the HF model's parameters (`layout.param_names`), each moment converted like its
    weight, on the host. Without a step taken, no state (as the torch engine's)."""
    saved = optimizer.state_dict()
    names = [name for name, _ in module.named_parameters()]
    group = {key: value for key, value in saved["param_groups"][0].items() if key != "params"}
    groups = [{**group, "params": list(range(len(layout.param_names)))}]
    if not saved["state"]:
        return {"state": {}, "param_groups": groups}
    first = saved["state"][0]
    keys = sorted(key for key, value in first.items() if torch.is_tensor(value) and value.dim() > 0)  # AdamW's moments
    moments = {key: dict(iter_hf_weights([{names[i]: s[key] for i, s in saved["state"].items()}], layout.shape, spec=SPEC)) for key in keys}
    step = first["step"]
    state = {index: {"step": step.to(_HOST, copy=True), **{key: moments[key][name].to(_HOST, copy=True) for key in keys}} for index, name in enumerate(layout.param_names)}
    return {"state": state, "param_groups": groups}


def megatron_optimizer_state(saved: Mapping[str, Any], module: torch.nn.Module, layout: HFLayout) -> dict[str, Any]:
    """A torch-engine-format AdamW state (`hf_optimizer_state`'s, or the torch engine's own) for
    torch's AdamW over `module.parameters()`: what its `load_state_dict` takes.

    Raises:
        ValueError: the state's parameters are not the HF model's (a weight missing or of another shape).
    """
    names = [name for name, _ in module.named_parameters()]
    group = {key: value for key, value in saved["param_groups"][0].items() if key != "params"}
    groups = [{**group, "params": list(range(len(names)))}]
    if not saved["state"]:
        return {"state": {}, "param_groups": groups}
    if len(saved["state"]) != len(layout.param_names):
        raise ValueError(f"the optimizer state has {len(saved['state'])} parameters' moments; the model has {len(layout.param_names)} parameters")
    first = saved["state"][min(saved["state"])]
    keys = sorted(key for key, value in first.items() if torch.is_tensor(value) and value.dim() > 0)
    moments = {key: hf_to_megatron({name: saved["state"][i][key] for i, name in enumerate(layout.param_names)}, layout.shape, spec=SPEC)[0] for key in keys}
    # copies, a step count each: AdamW updates them in place, and torch's `load_state_dict` keeps
    # the tensors it is given (the converter hands replicated ones through)
    state = {i: {"step": torch.as_tensor(first["step"]).clone(), **{key: moments[key][name].clone() for key in keys}} for i, name in enumerate(names)}
    return {"state": state, "param_groups": groups}
