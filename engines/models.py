"""Model sources: where a run's policy module, its tokenizer and its first weights come from.

A recipe's `model.source` names one (`tidal.engines.registry.MODEL_SOURCES`), built from the
recipe's `model` section:

- `tiny`: the built-in Qwen2-architecture model with the character tokenizer
  (`tidal.engines.tiny`), freshly initialised from the run's seed;
- `hf`: a local Hugging Face checkpoint directory (`model.path`: config.json, safetensors,
  tokenizer files, chat template) loaded with transformers' Auto classes, with the
  checkpoint's own tokenizer (end ids from it and from generation_config.json).

Every source writes and reads checkpoints the same way: the module's `save_pretrained`
files and the tokenizer's beside them (`save`), loaded back by `load`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch

from tidal.engines.tokenizers import HFTokenizer, Tokenizer


@dataclasses.dataclass
class Policy:
    """A policy module and the tokenizer its ids belong to."""

    module: torch.nn.Module
    tokenizer: Tokenizer


@runtime_checkable
class ModelSource(Protocol):
    """Builds a run's policy, and reads and writes it in checkpoints."""

    built_here: bool
    """Whether the first weights are made by the run from the recipe (the tiny model: from
    its shape keys and seed, so a run keeps a copy in `cache/initial` and a resume compares
    the shape keys with the checkpoint); False for a checkpoint directory, which is its own
    record of both."""

    def build(self, *, seed: int) -> Policy:
        """The policy a new run starts from: the first weights and the tokenizer."""
        ...

    def load(self, folder: Path) -> Policy:
        """The policy `save` wrote to `folder` (a run's checkpoint)."""
        ...

    def load_tokenizer(self, folder: Path) -> Tokenizer:
        """Only the tokenizer `save` wrote to `folder` (a checkpoint checked before a resume)."""
        ...

    def save(self, policy: Policy, folder: Path) -> None:
        """Write the module's weights and config and the tokenizer's files to `folder`, all or none."""
        ...


class TinySource:
    """`model.source: tiny`: `tidal.engines.tiny.build_tiny_qwen2` with the recipe's shape
    keys, and the character tokenizer."""

    built_here = True

    def __init__(self, section: Any) -> None:
        self.section = section

    def build(self, *, seed: int) -> Policy:
        from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2  # noqa: PLC0415

        m, tokenizer = self.section, CharTokenizer()
        module = build_tiny_qwen2(
            tokenizer.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size, max_positions=m.max_positions, seed=seed, attention=_name(m.attention),
        )
        return Policy(module, tokenizer)

    def load(self, folder: Path) -> Policy:
        from tidal.engines.tiny import load_model  # noqa: PLC0415

        return Policy(*load_model(folder, attention=_name(self.section.attention)))

    def load_tokenizer(self, folder: Path) -> Tokenizer:
        from tidal.engines.tiny import CharTokenizer  # noqa: PLC0415

        return CharTokenizer.load(folder)

    def save(self, policy: Policy, folder: Path) -> None:
        save_policy(policy, folder)


DTYPES: dict[str, torch.dtype | str] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": "auto"}
"""`model.dtype` -> what `from_pretrained` takes (auto: the checkpoint's own)."""


class HFSource:
    """`model.source: hf`: the checkpoint directory `model.path`, loaded with
    `AutoModelForCausalLM` (`model.dtype`, `model.attention`, `model.trust_remote_code`) and
    `HFTokenizer`; `model.gradient_checkpointing` turns activation recomputation on."""

    built_here = False

    def __init__(self, section: Any) -> None:
        self.section = section

    def build(self, *, seed: int) -> Policy:
        if not self.section.path:
            raise ValueError("model.source=hf needs model.path: a local Hugging Face checkpoint directory")
        path = Path(self.section.path)
        if not path.is_dir():
            raise ValueError(f"model.path={str(path)!r} does not exist or is not a folder")
        return Policy(self._module(path), self.load_tokenizer(path))

    def load(self, folder: Path) -> Policy:
        return Policy(self._module(folder), self.load_tokenizer(folder))

    def load_tokenizer(self, folder: Path) -> Tokenizer:
        return HFTokenizer.from_pretrained(folder, trust_remote_code=self.section.trust_remote_code)

    def save(self, policy: Policy, folder: Path) -> None:
        save_policy(policy, folder)

    def _module(self, path: Path) -> torch.nn.Module:
        import transformers  # noqa: PLC0415

        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in a run's output
        m = self.section
        try:
            module = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=DTYPES[m.dtype], trust_remote_code=m.trust_remote_code, attn_implementation=_name(m.attention)
            )
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot load a causal LM from {str(path)!r}: {type(e).__name__}: {e}") from e
        if m.gradient_checkpointing:
            recompute_activations(module)
        return module


@contextlib.contextmanager
def _renamed_checkpointing_api() -> Iterator[None]:
    """transformers 5.x renamed `gradient_checkpointing_*` to `activation_checkpointing_*`
    (4.x has only the old names) and warns at each use; the old names work in both until v6."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is deprecated.*activation_checkpointing.*", category=FutureWarning)
        yield


def recompute_activations(module: torch.nn.Module) -> None:
    """Make a transformers model recompute its activations in the backward pass
    (`model.gradient_checkpointing`), with transformers' default checkpointing."""
    with _renamed_checkpointing_api():
        module.gradient_checkpointing_enable()  # type: ignore[operator]  # a transformers PreTrainedModel's


def recomputes_activations(module: torch.nn.Module) -> bool:
    """Whether a transformers model recomputes its activations in the backward pass
    (`model.gradient_checkpointing`); False for any other module."""
    import transformers  # noqa: PLC0415

    if not isinstance(module, transformers.PreTrainedModel):
        return False
    with _renamed_checkpointing_api():
        return bool(module.is_gradient_checkpointing)


def save_policy(policy: Policy, folder: Path) -> None:
    """The module's `save_pretrained` files and the tokenizer's (`tiny.save_model`: all or none)."""
    from tidal.engines.tiny import save_model  # noqa: PLC0415

    save_model(cast(Any, policy.module), policy.tokenizer, folder)  # any model with `save_pretrained`


def _name(value: Any) -> str:
    """An enum member's value (the schema's), or the string itself."""
    return getattr(value, "value", value)


def tiny_source(*, attention: str = "sdpa") -> TinySource:
    """The tiny source as far as reading a checkpoint needs it (the attention implementation;
    the shape comes from the checkpoint's config.json)."""
    import types  # noqa: PLC0415

    return TinySource(types.SimpleNamespace(attention=attention))


def model_source(section: Any) -> ModelSource:
    """The registered source `section.source` names (the recipe's `model` section), built from it."""
    from tidal.engines.registry import load  # noqa: PLC0415

    return load("model.source", section.source)(section)
