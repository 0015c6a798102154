"""LoRA adapters for a train engine (`train.lora_rank` > 0), with the `peft` library.

`add_adapters` injects peft's LoRA layers into the model in place
(`peft.inject_adapter_in_model`): the model stays the transformers model it was, its
linear layers wrapped, and only the adapters' A and B matrices train. B starts at 0, so the
adapted model starts as the base. The base weights stay as they were loaded, so the
reference policy of a KL term is the base with the adapters off (`adapters_off`), no copy.

What leaves the engine is always one set of weights under the base model's names:
`merged_weights` gives each adapted layer's `W + scale * B @ A`, computed one layer at a
time and never written into the base (merging in place and back would change the base by
float rounding). Rollout engines, evaluation, checkpoints' model.safetensors and
`tidal export` see a plain model of the base's shape. An exact resume also needs the base and
the adapters themselves: `base_weights` and `adapter_weights` (the engine's `state_dict`
keeps both; the checkpoint stores them in trainer.pt).

Only linear layers that own their weight take adapters: a tied embedding and output head
(one tensor under two names) would come out as two different merged tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

ADAPTER_SEED = 0
"""The CPU generator's seed while adapters are made (their A matrices are random, B is 0):
every rank of a multi-rank engine, and every engine, makes the same ones from the same
model, which is on the host then."""
TARGETS_ALL_LINEAR = "all-linear"
"""peft's name for every linear layer but the output head."""


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """A recipe's LoRA keys (`train.lora_rank`, `train.lora_alpha`, `train.lora_target_modules`)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = (TARGETS_ALL_LINEAR,)
    """Module names (or the last part of one: `q_proj`) that take adapters; `all-linear`: every
    linear layer but the output head."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"train.lora_rank={self.rank} must be >= 1 to add adapters (0 trains every weight)")
        if not self.alpha > 0:  # `not >`: nan is refused too
            raise ValueError(f"train.lora_alpha={self.alpha} must be > 0: adapters are scaled by lora_alpha / lora_rank")
        if not self.target_modules:
            raise ValueError("train.lora_target_modules is empty: name the modules that take adapters, or all-linear")

    def keys(self) -> dict[str, Any]:
        """The recipe keys these settings came from, and their values (a checkpoint records them)."""
        return {"train.lora_rank": self.rank, "train.lora_alpha": self.alpha, "train.lora_target_modules": list(self.target_modules)}

    def peft_config(self) -> Any:
        """peft's `LoraConfig` for these settings (no dropout: a rollout engine's forward has none)."""
        from peft import LoraConfig  # noqa: PLC0415

        targets: str | list[str] = TARGETS_ALL_LINEAR if self.target_modules == (TARGETS_ALL_LINEAR,) else list(self.target_modules)
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha  # peft and vLLM type it an int
        return LoraConfig(r=self.rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")  # type: ignore[arg-type]  # a fractional alpha scales as well


def lora_settings(rank: int, alpha: float, target_modules: Any) -> LoraSettings | None:
    """The settings of a recipe's LoRA keys; None for `rank` 0 (every weight trains)."""
    if rank == 0:
        return None
    targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    return LoraSettings(rank=rank, alpha=alpha, target_modules=targets)


def check_targets(model: torch.nn.Module, settings: LoraSettings) -> None:
    """That `train.lora_target_modules` names modules of `model` that can take adapters:
    linear layers that own their weight (a tied embedding or output head is one tensor under
    two names, which would merge into two). `all-linear` takes every linear layer but the
    output head, as peft resolves it. Cheap: no adapter is made (`tidal run` checks before
    its warm start).

    Raises:
        ValueError: naming the key, what it matched, and the model's linear layers' names.
    """
    from peft.tuners.tuners_utils import check_target_module_exists  # noqa: PLC0415

    if settings.target_modules == (TARGETS_ALL_LINEAR,):
        return
    key = f"train.lora_target_modules={list(settings.target_modules)}"
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)})
    config, shared = settings.peft_config(), _tied_names(model)
    matched = [(name, module) for name, module in model.named_modules() if name and check_target_module_exists(config, name)]
    if not matched:
        raise ValueError(f"{key} matches no module of the model; its linear layers are {', '.join(linear)} (or name all-linear)")
    for name, module in matched:
        if not isinstance(module, torch.nn.Linear) or f"{name}.weight" in shared:
            raise ValueError(f"{key} takes in {name!r} ({type(module).__name__}), whose weight is not a linear layer's own: name linear layers that own their weights ({', '.join(linear)}), or all-linear")


def add_adapters(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject LoRA layers into `model` in place, freeze every other weight; returns `model`.
    The adapters are made from the CPU generator seeded with `ADAPTER_SEED`, in float32
    over a half-precision base too (peft computes each adapter's part in its dtype).

    Raises:
        ImportError: peft is not installed (naming the extra that installs it).
        ValueError: the targets cannot take adapters (`check_targets`); nothing is changed then.
    """
    try:
        import peft  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"train.lora_rank={settings.rank} needs peft: pip install 'tidal-rl[lora]' -c constraints.txt ({e})") from None
    check_targets(model, settings)
    with torch.random.fork_rng(devices=[]):  # the same A on every rank and in every engine; the run's RNG untouched
        torch.manual_seed(ADAPTER_SEED)
        peft.inject_adapter_in_model(settings.peft_config(), model)
    for name, param in model.named_parameters():  # as peft's get_peft_model (autocast_adapter_dtype): AdamW on float32 adapters over a half-precision base
        if _is_adapter(name) and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    return model


def _layers(model: torch.nn.Module) -> dict[str, Any]:
    """The model's LoRA layers by module name."""
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def _tied_names(model: torch.nn.Module) -> set[str]:
    """The names of weights that share their tensor with another name."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name for names in by_tensor.values() if len(names) > 1 for name in names}


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def _base_name(name: str) -> str:
    """An adapted model's name for a base weight -> the base model's name for it."""
    return name.replace(".base_layer.", ".")


def base_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's weights (adapters left out), under its own names: the tensors of
    `state` (the adapted model's by its names; default: `model.state_dict()`), no copies."""
    return {_base_name(name): tensor for name, tensor in (model.state_dict() if state is None else state).items() if not _is_adapter(name)}


def adapter_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapters' A and B matrices under the adapted model's names: the tensors of `state`
    (default: `model.state_dict()`), no copies."""
    return {name: tensor for name, tensor in (model.state_dict() if state is None else state).items() if _is_adapter(name)}


def merged_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None, *, full: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the base model, by its name and in its order, with each adapted layer's
    weight merged: `W + scale * B @ A`, a new tensor in `W`'s dtype; every other weight is
    `full(tensor)` (the model's own tensor, by default).

    `state`: the adapted model's weights by its names (default: `model.state_dict()`), each
    passed through `full` when reached (a sharded engine gathers it there: every rank makes
    the same calls in the same order). One merged tensor at a time: a consumer that copies
    each before taking the next holds one layer's extra memory.
    """
    state = model.state_dict() if state is None else state
    scales = {f"{name}.base_layer.weight": (name, layer.scaling["default"]) for name, layer in _layers(model).items()}
    for name, tensor in state.items():
        if _is_adapter(name):
            continue
        if name not in scales:
            yield _base_name(name), full(tensor)
            continue
        layer, scale = scales[name]
        with torch.no_grad():
            weight, a, b = (full(t) for t in (tensor, state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]))
            yield _base_name(name), weight + ((b @ a) * scale).to(weight.dtype)  # as peft's get_delta_weight computes it


def adapted_state(model: torch.nn.Module, base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapted model's weights by its own names, from its base weights (by the base's
    names, as `base_weights` gives them) and adapters (as `adapter_weights` does); strict:
    every weight of both is given, and nothing else.

    Raises:
        ValueError: a name is missing or unknown, naming it.
    """
    own = list(model.state_dict())
    wanted = {_base_name(name): name for name in own if not _is_adapter(name)}
    adapter_names = {name for name in own if _is_adapter(name)}
    missing = sorted({*wanted} - {*base} | adapter_names - {*adapters})
    unknown = sorted({*base} - {*wanted} | {*adapters} - adapter_names)
    if missing or unknown:
        raise ValueError(f"the LoRA state does not fit this model (train.lora_rank, train.lora_target_modules): missing {missing[:3]}, unknown {unknown[:3]}")
    return {**{wanted[name]: tensor for name, tensor in base.items()}, **adapters}


def state_entries(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], settings: LoraSettings) -> dict[str, Any]:
    """A train engine's `state_dict()` entries with LoRA, from the adapted model's whole weights
    by its names (empty on a rank that saves nothing): "model", the merged weights under the
    base's names (what users and rollout load), and "lora", the base, the adapters and the
    settings an exact resume loads."""
    lora = {"base": base_weights(model, weights), "adapters": adapter_weights(model, weights), "settings": settings.keys()}
    return {"model": dict(merged_weights(model, weights, full=lambda t: t)), "lora": lora}


def saved_weights(model: torch.nn.Module, state: Mapping[str, Any], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """The adapted model's weights by its names from a train engine's state: its "lora" base
    and adapters ("model", merged, follows from them).

    Raises:
        ValueError: a state without "lora" (an engine's that trained every weight), or whose
            names do not fit the model (`adapted_state`).
    """
    if not isinstance(state.get("lora"), dict):
        raise ValueError(f"train.lora_rank={settings.rank}: the state has no LoRA base and adapters (it comes from training every weight)")
    return adapted_state(model, state["lora"]["base"], state["lora"]["adapters"])


def peft_adapter(settings: LoraSettings, adapters: dict[str, torch.Tensor], *, base: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """`adapters` (as `adapter_weights` gives them) as peft saves a causal LM's adapter: its
    `LoraConfig` (`base` as `base_model_name_or_path`) and the weights by the names in
    adapter_model.safetensors (`base_model.model.` first, no adapter name), which
    `PeftModel.from_pretrained` and vLLM's LoRA loading read.

    Raises:
        ImportError: peft is not installed (naming the extra that installs it).
    """
    try:
        from peft import LoraConfig  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(f"pip install 'tidal-rl[lora]' -c constraints.txt ({e})") from None
    config: LoraConfig = settings.peft_config()
    config.task_type, config.base_model_name_or_path = "CAUSAL_LM", base or None
    config.target_modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in adapters})  # as peft resolves all-linear
    weights = {"base_model.model." + name.replace(".default.", "."): tensor.contiguous() for name, tensor in adapters.items()}
    return config, weights


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside the block (its adapters bypassed), the adapted one after."""
    layers = list(_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
