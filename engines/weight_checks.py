"""The check every rollout engine's `load_weights` makes before it takes a version: the named
tensors against the engine's own names, shapes and dtypes (`hf` against its model, `vllm`
against the checkpoint's manifest)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

Specs = Mapping[str, tuple[Sequence[int], torch.dtype]]
"""Name -> (shape, dtype) of every tensor an engine takes."""


def collect_weights(version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], specs: Specs, *, about_missing: Callable[[list[str]], str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors by name, once every name of `specs` is given exactly once with its shape; a
    floating tensor may have any floating dtype, any other must match.

    Raises:
        ValueError: naming (up to five of) the missing, unknown, misshapen, mistyped and
            repeated names, and `about_missing(missing)`'s words where given.
    """
    given: dict[str, torch.Tensor] = {}
    repeated = []
    for name, tensor in named_tensors:
        if name in given:
            repeated.append(name)
        given[name] = tensor
    missing = sorted(set(specs) - set(given))
    unknown = sorted(set(given) - set(specs))
    both = sorted(set(specs) & set(given))
    wrong = [n for n in both if tuple(given[n].shape) != tuple(specs[n][0])]
    dtype = [n for n in both if given[n].dtype != specs[n][1] and not (specs[n][1].is_floating_point and given[n].dtype.is_floating_point)]
    if missing or unknown or wrong or dtype or repeated:
        raise ValueError(
            f"weights for version {version} do not match the model: missing {missing[:5]}, unknown {unknown[:5]}, wrong shape {wrong[:5]}, "
            f"wrong dtype {dtype[:5]}, given twice {repeated[:5]}" + (about_missing(missing) if about_missing is not None and missing else "")
        )
    return given
