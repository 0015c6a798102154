"""The `fsdp` train engine: torch FSDP2 (`fully_shard`) on any hal platform, data parallel.

One process per rank. Every decoder layer (the model's `_no_split_modules` classes) and
the root are sharded with `fully_shard` over a 1-D mesh of all ranks, on the device the
hal platform gives; the optimizer is AdamW over the sharded (DTensor) parameters. Each
rank trains on its own rows of the batch; micro-batch losses are weighted by their share
of the *global* batch's loss tokens or sequences (counted with one all-gather) and the
gradient reduce-scatter sums instead of averaging, so a step over N ranks equals one
`TorchTrainEngine` step over all of their rows. Ranks run the same number of forwards and
backwards (FSDP's collectives demand it): a rank with fewer micro-batches, or one whose
micro-batch has no loss token, runs a zero-weight dummy pass.

Weights: `named_weights()` all-gathers one parameter at a time (`full_tensor()`) and
yields it under the un-sharded model's name, so the full model never sits on the device
beside its shards. It is a collective: every rank iterates it, in the same order.
Checkpoints: `save_checkpoint(dir)` / `load_checkpoint(dir)` write and read sharded model
and optimizer state with torch.distributed.checkpoint (every rank, same directory);
`state_dict()` is the full, un-sharded state in `TorchTrainEngine`'s format (rank 0
holds the tensors), so `tidal run` checkpoints are interchangeable between the engines.

The process group is the one hal sets up (`platform.init_process_group`). When none is
initialised the engine initialises it through hal from torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or raises, naming what is missing.

Run for real: CPU with gloo, 2 processes (tests/engines/test_fsdp_train.py: equality with
the torch engine, exported weights, checkpoint/resume). Not run: GPU or NPU (the code
only asks hal for the device and the backend; nothing here names a vendor).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from tidal.flow.algorithms import PolicyLossConfig, policy_loss
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def ensure_process_group(platform: Platform) -> None:
    """Use the initialised default process group, or initialise it through hal from torchrun's variables."""
    if not dist.is_available():
        raise RuntimeError("the fsdp train engine needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            "the fsdp train engine needs an initialised torch.distributed process group: call "
            "platform.init_process_group(rank=..., world_size=...) (tidal.hal) before building it, "
            f"or launch with torchrun; no process group is initialised and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set"
        )
    platform.init_process_group(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: the model's `_no_split_modules` classes (HF decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class FSDPTrainEngine:
    """A `TrainEngine` for a transformers-style causal LM, sharded over all ranks with FSDP2."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        platform: Platform | None = None,
        version: int = 0,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.platform = platform or current_platform()
        ensure_process_group(self.platform)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = self.platform.device(local_rank if self.platform.device_count() > 1 else 0)
        self.platform.set_device(self.device)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a plain sum: the loss weights already divide by the global batch
                module.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1.0), which gloo lacks
        self.model = model.train()  # fully_shard moved parameters and buffers to the mesh's device
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.grad_clip, self.micro_batch_size, self.temperature = grad_clip, micro_batch_size, temperature
        self.version = version

    # Forward passes --------------------------------------------------------------------
    def _token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        batch = batch.to(self.device)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        return logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)

    def _dummy_pass(self, *, backward: bool) -> None:
        """A forward (and zero-gradient backward) that joins the other ranks' FSDP collectives."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _micro_batches(self, n: int) -> list[slice]:
        return [slice(start, min(start + self.micro_batch_size, n)) for start in range(0, n, self.micro_batch_size)]

    def _global(self, batch: TokenBatch) -> tuple[dict[str, float], int]:
        """Loss tokens, sequences with a loss token and rows summed over ranks; the most micro-batches of any rank."""
        local = torch.tensor(
            [float(batch.loss_mask.sum()), float((batch.loss_mask.sum(1) > 0).sum()), float(len(batch)), float(len(self._micro_batches(len(batch))))],
            dtype=torch.float64,
        )
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)  # a CPU tensor: gloo carries it on every platform
        stacked = torch.stack(parts)
        tokens, sequences, rows = stacked[:, :3].sum(0).tolist()
        return {"tokens": tokens, "sequences": sequences, "rows": rows}, int(stacked[:, 3].max())

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[batch, seq - 1] logprob of each next token of this rank's rows (a collective: every rank calls it)."""
        _, num_micro = self._global(batch)
        out = [self._token_logprobs(batch.select(mb)).cpu() for mb in self._micro_batches(len(batch))]
        for _ in range(num_micro - len(out)):
            self._dummy_pass(backward=False)
        return torch.cat(out) if out else torch.zeros((0, batch.input_ids.shape[1] - 1))

    # Steps -----------------------------------------------------------------------------
    def _step(self, batch: TokenBatch, num_micro: int, micro_loss: Callable[..., Any], weight_of: Callable[[TokenBatch], float]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        slices = self._micro_batches(len(batch))
        for k in range(num_micro):
            part = batch.select(slices[k]) if k < len(slices) else None
            weight = weight_of(part) if part is not None else 0.0
            if weight == 0:
                self._dummy_pass(backward=True)
                continue
            loss, metrics = micro_loss(part, slices[k])
            (loss * weight).backward()
            for key, value in {"loss": float(loss.detach()), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + weight * float(value)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, grad_norm)
        self.optimizer.step()
        summed = self._sum_over_ranks(totals)
        summed.update(grad_norm=float(grad_norm), lr=self.optimizer.param_groups[0]["lr"])
        return summed

    def _sum_over_ranks(self, totals: dict[str, float]) -> dict[str, float]:
        """Each rank's share-weighted metrics summed: the metrics of the whole batch."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, totals)  # small dicts of floats, inside this job only
        out: dict[str, float] = {}
        for part in gathered:
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over every rank's rows (`batch` is this rank's); version += 1.

        A collective: every rank calls it, each with its own rows (possibly a different
        number of them), advantages and proximal logprobs for those rows.
        """
        counts, num_micro = self._global(batch)
        by_sequence = loss.aggregation.startswith("seq_") or loss.aggregation == "token_sum_norm"

        def weight_of(part: TokenBatch) -> float:
            if by_sequence:
                if loss.aggregation == "token_sum_norm":
                    return len(part) / counts["rows"]
                return float((part.loss_mask.sum(1) > 0).sum()) / max(counts["sequences"], 1.0)
            return float(part.loss_mask.sum()) / max(counts["tokens"], 1.0)

        def micro_loss(part: TokenBatch, mb: slice) -> tuple[torch.Tensor, dict[str, float]]:
            return policy_loss(
                self._token_logprobs(part),
                advantages[mb].to(self.device),
                behavior_logprobs=part.behavior_logprobs.to(self.device),
                mask=part.loss_mask.to(self.device),
                proximal_logprobs=None if proximal_logprobs is None else proximal_logprobs[mb].to(self.device),
                config=loss,
            )

        metrics = self._step(batch, num_micro, micro_loss, weight_of)
        metrics["num_tokens"] = counts["tokens"]
        self.version += 1
        return metrics

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One supervised step over every rank's rows: next-token cross-entropy on `loss_mask` tokens."""
        counts, num_micro = self._global(batch)

        def micro_loss(part: TokenBatch, mb: slice) -> tuple[torch.Tensor, dict[str, float]]:
            mask = part.loss_mask.to(self.device)
            return -(self._token_logprobs(part) * mask).sum() / mask.sum().clamp(min=1), {}

        metrics = self._step(batch, num_micro, micro_loss, lambda part: float(part.loss_mask.sum()) / max(counts["tokens"], 1.0))
        metrics["num_tokens"] = counts["tokens"]
        return metrics

    # Weights and state -----------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, un-sharded, under the un-sharded model's `state_dict` names, one at a time.

        Each tensor is all-gathered when it is reached and lives on this engine's device;
        keep only what you need (a consumer that keeps them all holds one full copy). A
        collective: every rank iterates it to the end, in the same order.
        """
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()

    def _fqns(self) -> list[str]:
        """The name of each optimizer parameter, in the optimizer's order (torch's integer ids)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and version, un-sharded on CPU, in `TorchTrainEngine.state_dict`'s format.

        A collective. Rank 0 gets the tensors; the other ranks get empty model and
        optimizer state (only rank 0 writes `tidal run`'s checkpoint).
        """
        if not self.optimizer.state:  # nothing to gather; asking would create zero moments
            model = get_model_state_dict(self.model, options=_FULL)
            optimizer = self.optimizer.state_dict()
            return {"model": model, "optimizer": optimizer, "version": self.version}
        model, optim = get_state_dict(self.model, self.optimizer, options=_FULL)
        index = {name: i for i, name in enumerate(self._fqns())}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim.get("param_groups", [])]
        state = {index[n]: self._unshared(s) for n, s in optim.get("state", {}).items()}
        return {"model": self._unshared(model), "optimizer": {"state": state, "param_groups": groups}, "version": self.version}

    def _unshared(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` with copies of the tensors that are live engine state (on CPU, "offloading" returns
        the optimizer's `step` itself), so the result is a snapshot, not a view that later steps change."""
        live = [self.model.state_dict().values(), *(s.values() for s in self.optimizer.state.values())]
        pointers = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for group in live for t in group if torch.is_tensor(t)}
        return {k: v.clone() if torch.is_tensor(v) and v.untyped_storage().data_ptr() in pointers else v for k, v in state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state (`state_dict()` of either engine).

        A collective: every rank passes the whole state (the shards are scattered from rank
        0's copy), as `tidal run` does when each rank reads the checkpoint file.
        """
        names = self._fqns()
        saved = state["optimizer"]
        options = StateDictOptions(full_state_dict=True)
        if saved["state"]:
            optim = {
                "state": {names[int(i)]: s for i, s in saved["state"].items()},
                "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]],
            }
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=optim, options=options)
        else:
            set_model_state_dict(self.model, state["model"], options=options)
            self.optimizer.state.clear()
            for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"]):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.version = int(state["version"])

    def save_checkpoint(self, directory: str | Path) -> None:
        """Sharded model + optimizer + version with torch.distributed.checkpoint; every rank, same directory."""
        state: dict[str, Any] = {"version": torch.tensor(self.version, dtype=torch.int64)}
        if self.optimizer.state:
            state["model"], state["optimizer"] = get_state_dict(self.model, self.optimizer)
        else:
            state["model"] = get_model_state_dict(self.model)
        dcp.save(state, checkpoint_id=str(directory))

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load what `save_checkpoint` wrote (any number of ranks may have written it)."""
        stored = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
        has_optimizer = any(key.startswith("optimizer.") for key in stored)
        state: dict[str, Any] = {"version": torch.tensor(0, dtype=torch.int64)}
        if has_optimizer:
            state["model"], state["optimizer"] = get_state_dict(self.model, self.optimizer)
        else:
            state["model"] = get_model_state_dict(self.model)
        dcp.load(state, checkpoint_id=str(directory))
        if has_optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            set_model_state_dict(self.model, state["model"])
            self.optimizer.state.clear()
        self.version = int(state["version"])

