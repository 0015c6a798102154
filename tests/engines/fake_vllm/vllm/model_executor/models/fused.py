"""A vLLM-layout causal LM for the fake workers: vLLM's fused parameters, Hugging Face compute.

Parameters are named and shaped as vLLM's Qwen2 / Llama implementations hold them:
`model.layers.N.self_attn.qkv_proj.{weight,bias}` (q, k and v rows stacked),
`model.layers.N.mlp.gate_up_proj.weight` (gate then up), and, for a tied checkpoint, an
`lm_head.weight` that is the embedding's own parameter (`named_parameters()` lists it
once). `load_weights` takes Hugging Face names as vLLM's `AutoWeightsLoader` does with
Qwen2's `hf_to_vllm_mapper`: a `q_proj` / `k_proj` / `v_proj` / `gate_proj` / `up_proj`
tensor goes into its slice of the fused parameter, a tied twin (`lm_head.weight`) is
skipped, an unknown name raises, a shape mismatch raises, and it returns the vLLM names it
wrote. The forward pass splits the fused parameters back into Hugging Face names and runs
the transformers model of the same config on them (`torch.func.functional_call`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"), ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
"""Qwen2Model.hf_to_vllm_mapper's `orig_to_new_stacked` in vLLM 0.32.0."""
SKIPPED = ("rotary_emb.inv_freq", "rotary_pos_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class FusedCausalLM(nn.Module):
    """The model a fake worker's model runner holds (float32, on the host)."""

    def __init__(self, model_dir: str | Path, *, trust_remote_code: bool = False) -> None:
        super().__init__()
        import transformers

        config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)  # vLLM's get_config: transformers refuses custom code unless trusted
        self.config = config
        skeleton = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code).float().eval()
        self._skeleton = [skeleton]  # a list: not a submodule (its parameters are not this model's)
        self._hf_names = list(skeleton.state_dict())
        self._slices: dict[str, tuple[str, int, int]] = {}  # HF name -> (vLLM name, start row, rows)
        self.aliases: dict[str, str] = {}  # tied vLLM name -> the name it aliases
        hf = skeleton.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in hf.items():
            tied = first.setdefault(id(tensor), name)
            if tied != name:
                self.aliases[name] = tied
                continue
            target = name
            for orig, (new, _) in STACKED.items():
                if orig + "." in name:
                    target = name.replace(orig + ".", new + ".")
                    break
            parts.setdefault(target, []).append((name, tensor))
        for target, members in parts.items():
            start = 0
            for name, tensor in members:
                self._slices[name] = (target, start, tensor.shape[0])
                start += tensor.shape[0]
            fused = torch.cat([t.detach().float() for _, t in members]) if len(members) > 1 else members[0][1].detach().float().clone()
            self._put(target, nn.Parameter(fused, requires_grad=False))
        for alias, canonical in self.aliases.items():
            self._put(alias, self._param(self._slices[canonical][0]))
        self.released = False
        """Level-2 sleep: the weights' memory is gone (loading into it would crash a real worker)."""

    def _put(self, dotted: str, param: nn.Parameter) -> None:
        *path, leaf = dotted.split(".")
        module: nn.Module = self
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]  # type: ignore[assignment]
        module.register_parameter(leaf, param)

    def _param(self, dotted: str) -> nn.Parameter:
        return self.get_parameter(dotted)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Hugging Face named tensors into the fused parameters; returns the vLLM names written."""
        if self.released:
            raise RuntimeError("the weights are asleep: their device memory is released (wake_up(tags=['weights']) first)")
        loaded: set[str] = set()
        skipped: dict[str, str] = {}
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if any(s in name for s in SKIPPED):
                continue
            if name in self.aliases:
                skipped[name] = self.aliases[name]
                continue
            target = name
            for orig, (new, _) in STACKED.items():
                if orig + "." in name:
                    target = name.replace(orig + ".", new + ".")
                    break
            if target not in params:
                raise ValueError(f"There is no module or parameter named {target!r} in {type(self).__name__}")
            param = params[target]
            if target != name:
                _, start, rows = self._slices[name]
                shard = param.data[start : start + rows]
                assert shard.shape == tensor.shape, f"Attempted to load weight ({tensor.size()}) into shard of ({shard.size()})"
                shard.copy_(tensor)
            else:
                assert param.size() == tensor.size(), f"Attempted to load weight ({tensor.size()}) into parameter ({param.size()})"
                param.data.copy_(tensor)
            loaded.add(target)
        for alias, canonical in skipped.items():
            if self._slices[canonical][0] not in loaded:
                raise ValueError(f"{alias!r} was skipped because it is tied to {canonical!r}, but {canonical!r} was not found in the checkpoint")
        return loaded

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names (views of the fused parameters)."""
        out = {}
        for name in self._hf_names:
            canonical = self.aliases.get(name, name)
            target, start, rows = self._slices[canonical]
            out[name] = self._param(target)[start : start + rows]
        return out

    @torch.no_grad()
    def next_token_logits(self, ids: list[int]) -> torch.Tensor:
        """[vocab] logits of the token after `ids`."""
        out = torch.func.functional_call(self._skeleton[0], self.hf_state(), (torch.tensor([ids]),), tie_weights=False)
        return out.logits[0, -1].float()
