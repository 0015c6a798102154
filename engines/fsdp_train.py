"""The `fsdp` train engine: torch FSDP2 (`fully_shard`) on any hal platform, data parallel.

One process per rank. Every decoder layer (the model's `_no_split_modules` classes) and
the root are sharded with `fully_shard` over a 1-D mesh of all ranks, on the device the
hal platform gives; the optimizer is AdamW over the sharded (DTensor) parameters, with
the platform's `optimizer_options()` (fused where its kernels allow). With
`precision="bf16"` forward passes run under `platform.autocast` (mixed precision by
autocast, not FSDP2's `MixedPrecisionPolicy`: shards, all-gathers and gradient
reductions stay fp32, and so does the optimizer's state). Each
rank trains on its own rows of the batch; micro-batch losses are weighted by their share
of the *global* batch's loss tokens, sequences or rows (counted with one all-gather) and the
gradient reduce-scatter sums instead of averaging, so a step over N ranks equals one
`TorchTrainEngine` step over all of their rows. As in that engine, rows whose advantage
is zero on every loss token get no forward or backward pass when there is no KL term
(`skipped_rows`; each rank skips its own). Ranks run the same number of forwards and
backwards (FSDP's collectives demand it): a rank with fewer micro-batches, or one whose
micro-batch has no loss token, runs a zero-weight dummy pass. A step whose global gradient
norm is not finite is skipped on every rank (`train_steps.NonfiniteGuard`). A loss with a KL
term (`kl_reference=True`) reads its reference logprobs from a frozen copy of the weights the
engine was built with, sharded as the policy is (a model's weights over the ranks: each
reference pass all-gathers a layer at a time, every rank in step, a dummy one with a dummy
pass), in `state_dict()` whole as the torch engine's `reference`, set from rank 0's at build
and load, and parked with the model by a seat (`HoldsReference`).

With `lora_rank` > 0 only LoRA adapters train (`engines.lora`): every rank adds the same
ones (from a fixed seed; led, rank 0's are broadcast with its weights) before sharding, so
the base and the adapters are sharded alike, and AdamW holds the adapters' state only. The
KL reference is the model with its adapters off (no copy); a weight pass gathers each
adapted layer's weight, A and B and yields the merged weight under the base model's name;
`state_dict()` has the torch engine's LoRA format ("lora": base, adapters, settings).

Micro-batches run padding-free where the model can (`padding_free=None`; True insists,
False pads), as in the torch engine and with its code (`engines.padding_free`): only their
rows' real tokens go through the model, and a token budget counts those. Padded, a
micro-batch is as wide as the rank's rows, or with a token budget cut to its longest row.

Weights: `named_weights()` is a `WeightSource` (`tidal.hal.transfer`): its specs come from
the shards' global shapes without gathering, and each pass all-gathers one parameter at
a time (`full_tensor()`) and yields it under the un-sharded model's name, so the full
model never sits on the device beside its shards, and a transport streams it bucket by
bucket. A pass is a collective: every rank makes it, in the same order.
Checkpoints: `save_checkpoint(dir)` / `load_checkpoint(dir)` write and read sharded model
and optimizer state (and the lr schedule's step) with torch.distributed.checkpoint (every rank, same directory);
`state_dict()` is the full, un-sharded state in `TorchTrainEngine`'s format (rank 0
holds the tensors), so `tidal run` checkpoints are interchangeable between the engines.

The process group is the one hal sets up (`platform.init_process_group`). When none is
initialised the engine initialises it through hal from torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or raises, naming what is missing.

Two ways to drive the ranks:

- SPMD (the default): every rank calls every method, each with its own rows.
- Led by rank 0 (`rank0_leads=True`, what `tidal run` uses): only rank 0 is called, by a
  program that sees one `TrainEngine` (the workflow). Each call on rank 0 first
  broadcasts a small command (`broadcast_object_list`), then sends every other rank its
  share of the batch's rows, even in tokens rather than rows (`micro_batches.rank_shares`:
  a long-tail response does not make one rank the step's straggler), as `send`/`recv` of
  CPU tensors, so gloo carries them on every platform, and runs its own share; `logprobs`
  gathers the shares back into the batch's order. The other ranks run `follow()`
  (`tidal.engines.fsdp_lead`): receive a command, make the same collective calls,
  repeat, until `stop_followers()`. Rows with no advantage
  are dropped before the rows are shared out. Building an engine on rank 0 is a command too
  (the followers rebuild the model from `type(model)(model.config)` and take rank 0's
  weights), so rank 0 may build several engines (a warm start's, then RL's) and the
  followers build them in step. Weights exported by `named_weights()` and the full
  `state_dict()` arrive on rank 0; the followers compute their part and drop it. A
  follower that time-shares its devices with a rollout guest runs each command in a
  turn (`follow(share)`); `after_offload_move` lets its seat park the shards
  (`flow.timeshare.Offloader`).

Run for real: CPU with gloo, 2 processes (tests/engines/test_fsdp_train.py: equality with
the torch engine, exported weights, the weight source's specs and passes streamed over
the host transport, checkpoint/resume, the led mode), and `tidal run
train.backend=fsdp` (one process locally; 2 rank actors under `runtime: ray`). Not run:
GPU or NPU (the code only asks hal for the device and the backend; nothing here names a
vendor).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tidal.engines import lora as lora_
from tidal.engines import rank_steps
from tidal.engines.fsdp_checkpoint import FROM_RANK0, full_state, load_full_state, load_sharded, save_sharded
from tidal.engines.fsdp_commands import model_recipe, send_command
from tidal.engines.fsdp_setup import TORCHRUN_VARS as TORCHRUN_VARS  # where tests and launchers look for it
from tidal.engines.fsdp_setup import ensure_process_group, rank_device, reset_sharded_params, reshard, shard
from tidal.engines.lr_schedule import LRSchedule, load_position, lr_scheduler
from tidal.engines.micro_batches import pack, real_lengths, row_lengths
from tidal.engines.padding_free import keeps_logits, no_kv_cache, padding_free_for
from tidal.engines.rank_steps import COVERED, sum_over_ranks, summed_counts
from tidal.engines.train_steps import (
    MicroLoss,
    NonfiniteGuard,
    add_metrics,
    average_metrics,
    check_settings,
    evaluating,
    grads_of,
    padded_positions,
    padded_token_stats,
)
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform
from tidal.hal.transfer import LazyWeights, TensorSpec


class FSDPTrainEngine:
    """A `TrainEngine` for a transformers-style causal LM, sharded over all ranks with FSDP2.

    `rank0_leads=True`: only rank 0 is called; the other ranks run `follow()` (see the module).
    """

    train_keys = ("lora_rank", "lora_alpha", "lora_target_modules")
    """The recipe's LoRA keys (`TakesTrainKeys`)."""
    distributed = True
    """Needs an initialised process group: `tidal run` makes a one-process group when none exists."""
    collective = True
    """Weight passes, `state_dict` and `load_state_dict` are collectives over every rank's shards
    (a rank that time-shares its devices takes a turn for them: `flow.timeshare`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        max_tokens_per_micro_batch: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        precision: str = "fp32",
        max_nonfinite_steps: int = 5,
        lr_schedule: LRSchedule | None = None,
        platform: Platform | None = None,
        version: int = 0,
        rank0_leads: bool = False,
        padding_free: bool | None = None,
        kl_reference: bool = False,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: Sequence[str] | str = lora_.TARGETS_ALL_LINEAR,
    ) -> None:
        check_settings(micro_batch_size=micro_batch_size, grad_clip=grad_clip, temperature=temperature, top_k=top_k, top_p=top_p, max_nonfinite_steps=max_nonfinite_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        if isinstance(model, FSDPModule):
            raise ValueError("the model is sharded already (another engine wraps it): build this engine from an un-sharded copy")
        self.padding_free = padding_free_for(model, padding_free)  # None: micro-batches padded (`engines.padding_free`)
        self._no_kv_cache, self._keeps_logits = no_kv_cache(model), keeps_logits(model)  # every training forward's
        self.platform = platform or current_platform()
        self.platform.autocast(precision)  # raises before any collective where the platform lacks it
        self.precision = precision
        """Forward passes run under `platform.autocast(precision)` (the shards, their
        all-gathers and the gradients stay fp32); logprobs come from fp32 logits."""
        ensure_process_group(self.platform)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.led = rank0_leads and self.world_size > 1
        """Only rank 0 is called; it sends every call to the other ranks."""
        if self.led and self.rank == 0:
            options = dict(lr=lr, weight_decay=weight_decay, betas=betas, grad_clip=grad_clip, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch, temperature=temperature, top_k=top_k, top_p=top_p, precision=precision, max_nonfinite_steps=max_nonfinite_steps, lr_schedule=lr_schedule, version=version, padding_free=padding_free, kl_reference=kl_reference, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules)
            send_command("init", model=model_recipe(model), options=options)  # the followers add the same adapters to theirs
        self.lora = lora_.lora_settings(lora_rank, lora_alpha, lora_target_modules)
        """The LoRA adapters' settings (`engines.lora`); None: every weight trains."""
        if self.lora is not None:
            lora_.add_adapters(model, self.lora)
        weights = model.state_dict() if self.led and self.rank == 0 else {}  # the un-sharded tensors, kept alive for the broadcast
        self.device = rank_device(self.platform)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if kl_reference and self.lora is None else None
        """A frozen copy of the weights the engine was built with (rank 0's, when led), the
        reference policy of a loss with `kl_coef > 0` (`kl_reference=True`), sharded as the
        model is: its forward passes are collectives, as the model's. Kept in `state_dict()`
        and in the sharded `save_checkpoint`; a seat parks it with the model. With LoRA the
        reference is the base with the adapters off (`engines.lora.adapters_off`), no copy."""
        self.kl_reference = kl_reference
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        shard(model, mesh)
        if self.reference is not None:
            shard(self.reference, mesh)  # frozen: no gradient to reduce
        self.model = model.train()  # fully_shard moved parameters and buffers to the mesh's device
        if self.led:
            for module in (self.model, self.reference):
                if module is not None:
                    set_model_state_dict(module, dict(weights), options=FROM_RANK0)  # the followers built theirs from random weights; a dict of its own: the call puts the shards in it
        del weights
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, betas=betas, **self.platform.optimizer_options())
        self.scheduler = lr_scheduler(self.optimizer, lr_schedule)  # stepped once per train_step on every rank
        self.grad_clip, self.micro_batch_size, self.temperature = grad_clip, micro_batch_size, temperature
        self.top_k, self.top_p = top_k, top_p  # rollout's truncation: logprobs are taken under it (`engines.sampling`)
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch  # None: micro-batches bounded by rows only
        self.version = version
        self.nonfinite = NonfiniteGuard(max_nonfinite_steps)

    @property
    def _leading(self) -> bool:
        return self.led and self.rank == 0

    # Rows of a led group ---------------------------------------------------------------------
    def follow_command(self, command: dict[str, Any]) -> None:
        """A follower: the collective calls of rank 0's `command` (what rank 0 gets back is dropped)."""
        if rank_steps.follow_rows(self, command, self.rank, self._logprobs):
            return
        op = command["op"]
        if op == "named_weights":
            for _ in self._named_weights():
                pass
        elif op == "state_dict":
            self._state_dict()
        elif op == "load_state_dict":
            self._load_state_dict({}, {}, has_optimizer_state=command["has_optimizer_state"], version=command["version"], lr_scheduler=command["lr_scheduler"], has_reference=command.get("has_reference", False))
        elif op == "save_checkpoint":
            self._save_checkpoint(command["directory"])
        elif op == "load_checkpoint":
            self._load_checkpoint(command["directory"])
        else:
            raise RuntimeError(f"rank 0 sent an unknown command {op!r}")

    # Forward passes --------------------------------------------------------------------
    def token_stats(self, batch: TokenBatch, *, entropy: str | None = None, module: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each next token's logprob, and its distribution's entropy with `entropy`
        (`next_token_stats`), under `module` (default: the trained, sharded model)."""
        module = module or self.model
        batch = batch.to(self.device)
        if self.padding_free is not None and (packed := self.padding_free.pack(batch)) is not None:
            return self.padding_free.token_stats(module, packed, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy, autocast=self.platform.autocast(self.precision))
        left_padded = bool((batch.attention_mask[:, 0] == 0).any())  # positions count from each row's first real token
        inputs = {"attention_mask": batch.attention_mask, **({"position_ids": padded_positions(batch.attention_mask)} if left_padded else {}), **self._no_kv_cache}
        return padded_token_stats(module, batch, inputs=inputs, keeps_logits=self._keeps_logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy, autocast=self.platform.autocast(self.precision))

    def _dummy_pass(self, *, backward: bool, reference: bool = False) -> None:
        """A forward (and zero-gradient backward) that joins the other ranks' FSDP collectives;
        with `reference`, a reference forward between them, as a KL micro-batch makes."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with self.platform.autocast(self.precision):
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **self._no_kv_cache).logits
        if reference:
            with torch.no_grad(), self._reference() as module, self.platform.autocast(self.precision):
                module(input_ids=ids, attention_mask=torch.ones_like(ids), **self._no_kv_cache)
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _micro_batches(self, batch: TokenBatch) -> list[slice]:
        """This rank's runs of rows, in order, within `micro_batch_size` rows and
        `max_tokens_per_micro_batch` tokens, padded or padding-free (`engines.micro_batches.pack`):
        their number may differ between ranks (`step_counts` takes the most; the others make it
        up with dummy passes)."""
        padded = self.padding_free is None
        return pack((row_lengths(batch) if padded else real_lengths(batch)).tolist(), max_rows=self.micro_batch_size, max_tokens=self.max_tokens_per_micro_batch, padded=padded)

    def _part(self, batch: TokenBatch, mb: slice) -> TokenBatch:
        """Rows `mb` of `batch`; with a token budget cut to the longest of them (the padded
        size `pack` counted). Without one they keep the batch's width, as they always did:
        cutting changes float32 sums' rounding, which equality tests of runs would see."""
        part = batch.select(mb)
        return part if self.max_tokens_per_micro_batch is None else part.crop(max(int(row_lengths(part).max()), 2))

    def step_counts(self, batch: TokenBatch, running: TokenBatch | None = None, masked: tuple[int, int] | None = None) -> dict[str, float]:
        """`rank_steps.summed_counts`, with the most micro-batches any rank makes of its rows (`running`)."""
        return summed_counts(batch, running, masked, world_size=self.world_size, micro_batches=len(self._micro_batches(batch if running is None else running)))

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[batch, seq - 1] logprob of each next token of this rank's rows (SPMD: a collective,
        every rank calls it); led by rank 0: of every row of `batch`, computed by all ranks."""
        return rank_steps.lead_logprobs(batch, self._logprobs, leading=self._leading, world_size=self.world_size)

    def logprobs_under_reference(self, batch: TokenBatch) -> torch.Tensor:
        """`logprobs` under the frozen KL reference (`LogprobsUnderReference`; an engine built with
        `kl_reference=True`): its forward passes, sharded as the model's, on every rank."""
        if not self.kl_reference:
            raise ValueError("logprobs under the reference need one: build the engine with kl_reference=True")
        return rank_steps.lead_logprobs(batch, lambda rows: self._logprobs(rows, reference=True), leading=self._leading, world_size=self.world_size, reference=True)

    @torch.no_grad()
    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        """In eval mode (no dropout), as a rollout engine computes them; under the KL reference with `reference`."""
        num_micro = int(self.step_counts(batch)["micro_batches"])
        with evaluating(self.model):
            slices = self._micro_batches(batch)
            parts = [self._predicted(self._part(batch, mb), reference=reference) for mb in slices]
            for _ in range(num_micro - len(slices)):
                if reference:
                    self._dummy_reference_pass()
                else:
                    self._dummy_pass(backward=False)
        self._reshard()
        width = batch.input_ids.shape[1] - 1  # each part was cut to its longest row: padded back with 0
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]) if parts else torch.zeros((0, width))

    def _predicted(self, part: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        """A micro-batch's logprobs on the host (under the KL reference with `reference`), 0 where
        padding is predicted (as padding-free ones and the torch engine's are)."""
        logprobs = self.reference_logprobs(part) if reference else self.token_stats(part)[0]
        return torch.where(part.attention_mask[:, 1:].cpu() != 0, logprobs.cpu(), 0.0)

    def _dummy_reference_pass(self) -> None:
        """A reference forward alone that joins the other ranks' (`logprobs_under_reference`)."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with torch.no_grad(), self._reference() as module, self.platform.autocast(self.precision):
            module(input_ids=ids, attention_mask=torch.ones_like(ids), **self._no_kv_cache)

    # Steps -----------------------------------------------------------------------------
    def run_step(self, batch: TokenBatch, counts: dict[str, float], micro_loss: MicroLoss, weight_of: Callable[[TokenBatch], float], *, kl: bool = False) -> dict[str, float]:
        """One optimizer step; "loss" (and "kl") are the global batch's, the other metrics are
        means over the loss tokens of the rows that ran (on every rank; `LOSS_METRICS`). With
        no rows to run anywhere, one dummy pass gives every parameter a zero gradient, so
        AdamW still steps; every rank makes `counts["micro_batches"]` passes, as FSDP's
        collectives need. `kl`: each micro-batch makes a reference pass (a KL term), so each
        dummy pass makes one too."""
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0, COVERED: 0.0}
        slices = self._micro_batches(batch)
        for k in range(max(int(counts["micro_batches"]), 1)):
            part = self._part(batch, slices[k]) if k < len(slices) else None
            weight = weight_of(part) if part is not None else 0.0
            if part is None or weight == 0:
                self._dummy_pass(backward=True, reference=kl)
                continue
            loss, metrics = micro_loss(part, slices[k])
            (loss * weight).backward()
            totals[COVERED] += add_metrics(totals, part, loss, metrics, weight=weight)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads_of(params), norm_type=2.0)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()  # all-reduced: every rank steps, or skips a non-finite norm, alike
        step_metrics = self.nonfinite.step(self.optimizer, params, grad_norm, grad_clip=self.grad_clip, version=self.version)
        summed = sum_over_ranks(totals, self.world_size)
        average_metrics(summed, summed.pop(COVERED))
        summed.update(step_metrics, lr=self.optimizer.param_groups[0]["lr"])
        return summed

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over every rank's rows; version += 1 (`rank_steps.train_step`: SPMD,
        or led by rank 0). `seq_masked_fraction` is the whole batch's on every rank (the
        counts ride along `step_counts`' all-gather).

        Raises:
            ValueError: a loss with `kl_coef > 0` on an engine built without `kl_reference`, or
                advantages or proximal logprobs not shaped like the batch, before any rank runs anything.
        """
        return rank_steps.train_step(self, batch, advantages, loss=loss, proximal_logprobs=proximal_logprobs, leading=self._leading)

    @torch.no_grad()
    def reference_logprobs(self, part: TokenBatch) -> torch.Tensor:
        """A collective, as the model's forward: every rank makes it for each of its micro-batches (or a dummy pass)."""
        with self._reference() as module:
            return self.token_stats(part, module=module)[0]

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference for a forward without backward, resharded after it (a root keeps its
        gathered parameters then): the frozen copy, or with LoRA the model with its adapters off."""
        if self.reference is not None:
            try:
                yield self.reference
            finally:
                reshard(self.reference)
            return
        assert self.lora is not None and self.kl_reference  # train_step checked it
        with lora_.adapters_off(self.model), evaluating(self.model):
            yield self.model

    def frozen_step(self) -> None:
        """A step the policy sits out (`algorithm.critic_warmup`: `TakesFrozenSteps`): version += 1,
        nothing else changes (led by rank 0, followers are not told: their version is never read)."""
        self.version += 1

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One supervised step over every rank's rows (`rank_steps.sft_step`; led by rank 0:
        `batch` is every row); the version is unchanged."""
        return rank_steps.sft_step(self, batch, leading=self._leading)

    # Time-sharing the devices (`flow.timeshare.Offloader` calls this after each move) ------
    def _reshard(self) -> None:
        """Reshard the model's FSDP modules (`fsdp_setup.reshard`: local, no collective)."""
        reshard(self.model)

    def after_offload_move(self) -> None:
        """The offload moved each parameter's local shard, the reference's too (to host memory or
        back): point FSDP's flat shard buffers at them (`fsdp_setup.reset_sharded_params`)."""
        reset_sharded_params(self.model, self.reference)

    # Weights and state -----------------------------------------------------------------
    def named_weights(self) -> LazyWeights:
        """Every weight, un-sharded, under the un-sharded model's `state_dict` names, one at a time:
        a `WeightSource` (`tidal.hal.transfer`) a transport streams bucket by bucket.

        Its `specs()` are the un-sharded names, shapes and dtypes, read from the shards
        without gathering. Each pass (`tensors()`, or iterating it) all-gathers one tensor
        when it is reached, on this engine's device; keep only what you need (a consumer
        that keeps them all holds one full copy). A pass is a collective: SPMD, every rank
        makes it, in the same order; led by rank 0, rank 0 makes it and each pass it starts
        makes the followers make one in step (so a version sent again is gathered again).
        A pass stopped early (its iterator closed) gathers the rest without yielding them,
        so the ranks stay in step.
        """
        return LazyWeights(self._weight_specs, self._weight_pass)

    def _weight_specs(self) -> list[TensorSpec]:
        weights = self.model.state_dict() if self.lora is None else lora_.base_weights(self.model)  # LoRA: merged ones keep the base's shape and dtype
        return [TensorSpec.of(name, tensor) for name, tensor in weights.items()]  # a DTensor's shape is global

    def _weight_pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._leading:
            send_command("named_weights")
        weights = self._named_weights()
        try:
            for item in weights:  # noqa: UP028 - not `yield from`: closing this pass must not close `weights` through it
                yield item
        finally:
            for _ in weights:  # stopped early: make the remaining gathers (a generator that raised yields nothing)
                pass

    def _named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is not None:  # each adapted layer merged: its weight, A and B gathered when the weight is reached
            yield from lora_.merged_weights(self.model, full=_gathered)
            return
        for name, tensor in self.model.state_dict().items():
            yield name, _gathered(tensor)

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and version (and the KL reference, where the engine holds one), un-sharded on CPU, in `TorchTrainEngine.state_dict`'s format.

        A collective (led by rank 0: rank 0 calls it). Rank 0 gets the tensors; the other
        ranks get empty model and optimizer state (only rank 0 writes `tidal run`'s checkpoint).
        """
        if self._leading:
            send_command("state_dict")
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        model, optimizer, reference = full_state(self.model, self.optimizer, frozen=self.reference)
        state = {"model": model, "optimizer": optimizer, "lr_scheduler": self.scheduler.state_dict(), "version": self.version, **({} if reference is None else {"reference": reference})}
        if self.lora is not None:  # rank 0's full state, in the torch engine's LoRA format (other ranks': empty)
            state.update(lora_.state_entries(self.model, model, self.lora))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state (`state_dict()` of either engine): rank 0's copy is broadcast.

        SPMD: a collective; every rank passes a state (only rank 0's is read). Led by rank
        0: rank 0 calls it.
        """
        saved, position = state["optimizer"], state.get("lr_scheduler") or {"last_epoch": int(state["version"])}  # from before schedules: a step per version
        model = state["model"] if self.lora is None else lora_.saved_weights(self.model, state, self.lora)  # LoRA: the base and adapters, exactly
        reference = state.get("reference") if self.reference is not None else None  # else the reference stays the weights the engine was built with
        if self._leading:
            send_command("load_state_dict", has_optimizer_state=bool(saved["state"]), version=int(state["version"]), lr_scheduler=position, has_reference=reference is not None)
        self._load_state_dict(dict(model), saved, has_optimizer_state=bool(saved["state"]), version=int(state["version"]), lr_scheduler=position, has_reference=reference is not None, reference=reference)

    def _load_state_dict(
        self, model: dict[str, Any], optim: dict[str, Any], *, has_optimizer_state: bool, version: int, lr_scheduler: dict[str, Any], has_reference: bool = False, reference: dict[str, Any] | None = None
    ) -> None:
        """Set the model (and optimizer) state from rank 0's full `model` / `optim` (torch's
        format; empty on other ranks), and with `has_reference` the reference from rank 0's
        full `reference` (`fsdp_checkpoint.load_full_state`)."""
        if has_reference:
            assert self.reference is not None
            set_model_state_dict(self.reference, (reference or {}) if self.rank == 0 else {}, options=FROM_RANK0)
        load_full_state(self.model, self.optimizer, model, optim if has_optimizer_state else None, rank=self.rank)
        load_position(self.scheduler, lr_scheduler)
        self.version = version

    def save_checkpoint(self, directory: str | Path) -> None:
        """Sharded model + optimizer + version (+ the KL reference) with torch.distributed.checkpoint; every rank, same directory."""
        if self._leading:
            send_command("save_checkpoint", directory=str(directory))
        self._save_checkpoint(directory)

    def _save_checkpoint(self, directory: str | Path) -> None:
        save_sharded(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, version=self.version, reference=self.reference)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load what `save_checkpoint` wrote (any number of ranks may have written it)."""
        if self._leading:
            send_command("load_checkpoint", directory=str(directory))
        self._load_checkpoint(directory)

    def _load_checkpoint(self, directory: str | Path) -> None:
        self.version = load_sharded(directory, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, reference=self.reference)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor all-gathered (a collective), or a plain one detached."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
