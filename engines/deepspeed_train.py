"""The `deepspeed` train engine: DeepSpeed ZeRO stage 1, 2 or 3 on any hal platform, data parallel.

One process per rank, over the process group hal sets up (DeepSpeed wraps it and starts
none of its own; `engines.deepspeed_setup`), DeepSpeed's accelerator the one hal's
platform computes on (`PlatformDescriptor.deepspeed_accelerator`, as `DS_ACCELERATOR`).
`zero_stage` (`train.zero_stage`) picks what is sharded over the ranks: 1 the optimizer
state (AdamW's moments and the fp32 master weights), 2 also the gradients, 3 also the
weights. The model is built whole by the caller (from its weights or its config) and
DeepSpeed partitions it when the engine starts; DeepSpeed then broadcasts rank 0's weights,
so every rank starts from them. The optimizer is torch's AdamW with the platform's
`optimizer_options()`, stepped by DeepSpeed over each rank's flat slices; weights,
gradients and optimizer state are fp32 and `precision="bf16"` runs forward passes under
`platform.autocast` (not DeepSpeed's bf16 mode), as in the other engines.

A step equals one `TorchTrainEngine` step over all ranks' rows, as the `fsdp` engine's does
and by the same bookkeeping: each rank trains on its own rows, micro-batch losses are
weighted by their share of the *global* batch's loss tokens, sequences or rows (counted with
one all-gather), and multiplied by the number of ranks, since DeepSpeed averages gradients
over the ranks where the weights already divide by the global batch. Micro-batches are cut
by tidal (`engines.micro_batches`, padded or padding-free: `engines.padding_free`), each
`backward()` accumulates (DeepSpeed's `managed_gradient_accumulation: false`), and one
`step()` reduces what is left, clips to `grad_clip` and steps AdamW. Ranks run the same
number of forwards and backwards (ZeRO-2 reduces gradients during each backward, ZeRO-3
gathers weights in each forward): a rank with fewer micro-batches, or one whose micro-batch
has no loss token, runs a zero-weight dummy pass. Rows whose advantage is zero on every
loss token get no pass when there is no KL or entropy term (`skipped_rows`). A step whose
gradient norm is not finite is skipped by DeepSpeed on every rank, and counted by
`train_steps.NonfiniteGuard`, which raises after `max_nonfinite_steps` in a row.

Weights: `named_weights()` is a `WeightSource` (`tidal.hal.transfer`) whose specs need no
gather, and whose passes yield one whole weight at a time (ZeRO-3: one gathered parameter,
a collective; ZeRO-1 and -2: each rank's own full weights, no collective), under the
un-sharded model's names. `state_dict()` is the whole state in `TorchTrainEngine`'s format
(rank 0 holds the tensors), so `tidal run` checkpoints move between the engines, and
`load_state_dict` sets the weights and AdamW's moments and step exactly (`engines.deepspeed_state`).

Two ways to drive the ranks, as with the `fsdp` engine: SPMD (every rank calls every
method with its own rows), or led by rank 0 (`rank0_leads=True`, what `tidal run` uses on
several ranks): only rank 0 is called; each call sends a command and every other rank its
share of the rows, and the other ranks run `tidal.engines.deepspeed_lead.follow()`.

Colocated and multiplexed layouts (rollout time-sharing the trainer's devices): the engine
`ParksItself` (`flow.protocols`): `park()` is DeepSpeed's `offload_states()` (its flat
buffers leave the device whole; moving its parameters one by one, as `hal` offload moves a
module's, would cut them from those buffers) and `unpark()` its `reload_states()`, with two
mends: under ZeRO-3 DeepSpeed moves the fp32 master slices and AdamW's state only for its own
FusedAdam, so tidal moves those (`deepspeed_state.move_zero3_optimizer`); under ZeRO-1 and -2
`reload_states` drops the views checkpoints read AdamW's moments through, so tidal makes them
again (`deepspeed_state.relink_optimizer_views`).

A loss with a KL term (`kl_reference=True`) reads its reference logprobs from a frozen copy
of the model taken before `deepspeed.initialize`, set from rank 0's at build and load, in
`state_dict()` as the torch engine's `reference`. Under ZeRO-1 and -2 it is whole on every
rank, as the policy's weights are (its passes are local), and parked with the platform's
offload. Under ZeRO-3 it is partitioned as the policy is: a second DeepSpeed engine with no
optimizer (OpenRLHF's way), whose passes gather its weights, so every rank makes one
reference pass per micro-batch in step (a dummy pass makes one too); `park()` moves its
slices to host memory (`deepspeed_state.move_zero3_params`).

With `lora_rank` > 0 only LoRA adapters train (`engines.lora`, peft), as in the torch and
`fsdp` engines: every rank adds the same adapters (from a fixed seed) before DeepSpeed
takes the model, AdamW (and so DeepSpeed's flat buffers, its master weights and moments)
holds the adapters only, and the base weights stay as loaded (under ZeRO-3 partitioned like
the rest). A weight pass yields the base's names, each adapted layer's weight merged
(`W + scale * B @ A`; under ZeRO-3 its weight, A and B gathered when it is reached), the KL
reference is the model with its adapters off (no copy), and `state_dict()` is the torch
engine's LoRA format ("lora": base, adapters, settings), so checkpoints move between the
three engines. `park()` also moves the base (`move_zero3_params(frozen_only=True)`), which
`offload_states` leaves where it is. Under ZeRO-3 every pass that gathers starts by letting go
of what this rank still holds gathered (`_release_gathered`), so a follower whose seat parked
between two commands where rank 0's did not gathers as rank 0 does (tests/engines/test_led_critic.py).

Run for real: CPU with gloo (DeepSpeed's CPU accelerator), 2 processes, ZeRO-1, -2 and -3
(tests/engines/test_deepspeed_train.py: equality with the torch engine, a KL step among
them, exported weights, state round trips, non-finite steps, ZeRO-3's reference in slices;
LoRA under each stage: tests/engines/test_deepspeed_lora.py), and `tidal run train.backend=deepspeed` (one process
locally; 2 rank actors under `runtime: ray` on a fake GPU cluster, ZeRO-2 and ZeRO-3:
tests/tools/test_deepspeed_run.py), parking (every stage: the whole state after `park()` /
`unpark()` equals the state before and the steps after it those of an engine that never
parked; a colocated `tidal run` on a fake GPU equals the disaggregated run bit for bit; on
the CPU the moves are in place, so what a GPU's memory gains was not measured);
`precision="bf16"` by hand only (one process, CPU autocast). Not run: GPU or NPU (the code asks hal for the device, the backend and DeepSpeed's
accelerator name; nothing here names a vendor).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tidal.engines import lora as lora_
from tidal.engines import rank_steps
from tidal.engines.deepspeed_setup import deepspeed_config, ensure_process_group, import_deepspeed, local_device_index
from tidal.engines.deepspeed_state import (
    full_state,
    load_full_state,
    load_whole_weights,
    move_zero3_params,
    offload_engine,
    reload_engine,
    trained,
    weight_pass,
    weight_specs,
    whole,
    whole_weights,
)
from tidal.engines.fsdp_commands import model_recipe, send_command
from tidal.engines.lr_schedule import LRSchedule, load_position, lr_scheduler
from tidal.engines.micro_batches import pack, real_lengths, row_lengths
from tidal.engines.padding_free import keeps_logits, no_kv_cache, padding_free_for
from tidal.engines.rank_steps import COVERED, sum_over_ranks, summed_counts
from tidal.engines.train_steps import (
    MicroLoss,
    NonfiniteGuard,
    add_metrics,
    average_metrics,
    broadcast_from_rank0,
    check_settings,
    evaluating,
    padded_positions,
    padded_token_stats,
)
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform
from tidal.hal.transfer import LazyWeights, TensorSpec

_HOST = torch.device("cpu")


class _StepTaken:
    """What `NonfiniteGuard.step` is given to step: DeepSpeed's `step()` has clipped and stepped
    already, or skipped a non-finite step on every rank, so the guard only counts."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class DeepSpeedTrainEngine:
    """A `TrainEngine` for a transformers-style causal LM, trained with DeepSpeed ZeRO over all ranks.

    `rank0_leads=True`: only rank 0 is called; the other ranks run `deepspeed_lead.follow()`.
    """

    distributed = True
    """Needs an initialised process group: `tidal run` makes a one-process group when none exists."""
    collective = True
    """`state_dict`, `load_state_dict` and ZeRO-3's weight passes are collectives over every rank."""
    train_keys = ("zero_stage", "lora_rank", "lora_alpha", "lora_target_modules")
    """Recipe `train.*` keys its constructor takes besides those every train engine takes."""

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
        zero_stage: int = 2,
        kl_reference: bool = False,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: Sequence[str] | str = lora_.TARGETS_ALL_LINEAR,
    ) -> None:
        check_settings(micro_batch_size=micro_batch_size, grad_clip=grad_clip, temperature=temperature, top_k=top_k, top_p=top_p, max_nonfinite_steps=max_nonfinite_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        if any(hasattr(p, "ds_id") or getattr(p, "_hp_mapping", None) is not None for p in model.parameters()):
            raise ValueError("the model is DeepSpeed's already (another engine wraps it): build this engine from an un-wrapped copy")
        self.lora = lora_.lora_settings(lora_rank, lora_alpha, lora_target_modules)
        """The LoRA adapters' settings (`engines.lora`); None: every weight trains."""
        if self.lora is not None:
            lora_.add_adapters(model, self.lora)  # on every rank, from the same seed: before DeepSpeed partitions anything
        config = deepspeed_config(zero_stage=zero_stage, grad_clip=grad_clip, model=model)  # raises before any collective
        self.padding_free = padding_free_for(model, padding_free)  # None: micro-batches padded (`engines.padding_free`)
        self._no_kv_cache, self._keeps_logits = no_kv_cache(model), keeps_logits(model)  # every training forward's
        self.platform = platform or current_platform()
        self.platform.autocast(precision)  # raises before any collective where the platform lacks it
        self.precision, self.zero_stage = precision, zero_stage
        ensure_process_group(self.platform)
        deepspeed = import_deepspeed(self.platform)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.led = rank0_leads and self.world_size > 1
        """Only rank 0 is called; it sends every call to the other ranks."""
        if self.led and self.rank == 0:
            options = dict(lr=lr, weight_decay=weight_decay, betas=betas, grad_clip=grad_clip, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch, temperature=temperature, top_k=top_k, top_p=top_p, precision=precision, max_nonfinite_steps=max_nonfinite_steps, lr_schedule=lr_schedule, version=version, padding_free=padding_free, zero_stage=zero_stage, kl_reference=kl_reference, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules)
            send_command("init", model=model_recipe(model), options=options)
        index = local_device_index(self.platform)
        self.device = self.platform.device(index)
        self.platform.set_device(self.device)
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if kl_reference and self.lora is None else None
        """A frozen copy of the weights the engine was built with (rank 0's, taken before ZeRO
        partitions them), the reference policy of a loss with `kl_coef > 0` (`kl_reference=True`).
        Under ZeRO-1 and -2 a plain module DeepSpeed does not manage, whole on every rank (its
        passes are local); under ZeRO-3 the module of `_reference_engine`, partitioned. Kept in
        `state_dict()` as the torch engine's `reference`, parked with the model. With LoRA the
        reference is the model with its adapters off (`engines.lora.adapters_off`), no copy."""
        self.kl_reference = kl_reference
        self._parked_reference: Any = None
        optimizer = torch.optim.AdamW(trained(model), lr=lr, weight_decay=weight_decay, betas=betas, **self.platform.optimizer_options())
        self.deepspeed, self.zero, _, _ = deepspeed.initialize(args=SimpleNamespace(device_rank=index), model=model, optimizer=optimizer, config=config, dist_init_required=False)
        """DeepSpeed's engine (what forwards, backwards and steps) and its ZeRO optimizer."""
        self._reference_engine: Any = None
        """ZeRO-3's reference: a DeepSpeed engine with no optimizer over `reference` (made after
        the policy is partitioned, so the two are never whole on the device together)."""
        if self.reference is not None and zero_stage == 3:
            reference_config = deepspeed_config(zero_stage=3, grad_clip=grad_clip, model=self.reference)
            self._reference_engine, *_ = deepspeed.initialize(args=SimpleNamespace(device_rank=index), model=self.reference, config=reference_config, dist_init_required=False)  # rank 0's weights, partitioned
            self._reference_engine.eval()
        elif self.reference is not None:
            self.reference.to(self.device)
            if self.world_size > 1:
                broadcast_from_rank0(self.reference)  # the followers built theirs from random weights
        self.module = self.deepspeed.module.train()
        """The model DeepSpeed wraps (its parameters DeepSpeed's views, or ZeRO-3's slices)."""
        self.optimizer: torch.optim.Optimizer = self.zero.optimizer
        """The torch AdamW DeepSpeed steps, over this rank's flat fp32 slices."""
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
        """A follower (`deepspeed_lead.follow`): the collective calls of rank 0's `command`
        (what rank 0 gets back is dropped)."""
        if rank_steps.follow_rows(self, command, self.rank, self._logprobs):
            return
        op = command["op"]
        if op == "named_weights":
            for _ in self._named_weights():
                pass
        elif op == "state_dict":
            self._state_dict()
        elif op == "load_state_dict":
            self._load_state_dict({}, {} if command["with_optimizer"] else None, version=command["version"], lr_scheduler=command["lr_scheduler"], reference={} if command.get("has_reference") else None)
        else:
            raise RuntimeError(f"rank 0 sent an unknown command {op!r}")

    def _release_gathered(self) -> None:
        """Under ZeRO-3, let go of every weight this rank holds gathered, the model's and a ZeRO-3
        reference's (`empty_partition_cache`: local, no collective). Every pass that gathers
        starts with it, on every rank: a rank whose seat parked its state between two commands
        (which lets go of them too) then gathers what the others gather. Without it a weight one
        rank still held while another gathered it put their all-gathers out of step (gloo:
        "1024 vs 32" bytes, DeepSpeed 0.19.8)."""
        if self.zero_stage == 3:
            self.zero.empty_partition_cache()
            if self._reference_engine is not None:
                self._reference_engine.empty_partition_cache()

    # Forward passes --------------------------------------------------------------------
    def token_stats(self, batch: TokenBatch, *, entropy: str | None = None, module: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each next token's logprob, and its distribution's entropy with `entropy`
        (`next_token_stats`), under `module` (default: DeepSpeed's engine, the trained model)."""
        module = module or self.deepspeed
        batch = batch.to(self.device)
        packed = self.padding_free.pack(batch) if self.padding_free is not None else None
        if self.padding_free is not None and packed is not None:
            return self.padding_free.token_stats(module, packed, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy, autocast=self.platform.autocast(self.precision))
        left_padded = bool((batch.attention_mask[:, 0] == 0).any())  # positions count from each row's first real token
        inputs = {"attention_mask": batch.attention_mask, **({"position_ids": padded_positions(batch.attention_mask)} if left_padded else {}), **self._no_kv_cache}
        return padded_token_stats(module, batch, inputs=inputs, keeps_logits=self._keeps_logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy, autocast=self.platform.autocast(self.precision))

    def _dummy_pass(self, *, backward: bool, reference: bool = False) -> None:
        """A forward (and zero-gradient backward) that joins the other ranks' collectives; with
        `reference`, a ZeRO-3 reference's forward between them, as a KL micro-batch makes."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with self.platform.autocast(self.precision):
            logits = self.deepspeed(input_ids=ids, attention_mask=torch.ones_like(ids), **self._no_kv_cache).logits
            if reference:
                with torch.no_grad(), self._reference() as module:
                    module(input_ids=ids, attention_mask=torch.ones_like(ids), **self._no_kv_cache)
        if backward:
            self.deepspeed.backward(logits.float().sum() * 0.0)

    def _dummy_reference_pass(self) -> None:
        """A reference forward alone, that joins the other ranks' under ZeRO-3 (`logprobs_under_reference`)."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with torch.no_grad(), self._reference() as module, self.platform.autocast(self.precision):
            module(input_ids=ids, attention_mask=torch.ones_like(ids), **self._no_kv_cache)

    def _micro_batches(self, batch: TokenBatch) -> list[slice]:
        """This rank's runs of rows, in order, within `micro_batch_size` rows and
        `max_tokens_per_micro_batch` tokens (`engines.micro_batches.pack`); their number may
        differ between ranks (`step_counts` takes the most; the others make it up with dummy passes)."""
        padded = self.padding_free is None
        return pack((row_lengths(batch) if padded else real_lengths(batch)).tolist(), max_rows=self.micro_batch_size, max_tokens=self.max_tokens_per_micro_batch, padded=padded)

    def _part(self, batch: TokenBatch, mb: slice) -> TokenBatch:
        """Rows `mb` of `batch`; with a token budget cut to the longest of them (the padded size `pack` counted)."""
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
        """`logprobs` under the frozen KL reference (`LogprobsUnderReference`; an engine built
        with `kl_reference=True`), every rank's rows on every rank (`reference_logprobs`)."""
        if not self.kl_reference:
            raise ValueError("logprobs under the reference need one: build the engine with kl_reference=True")
        return rank_steps.lead_logprobs(batch, lambda rows: self._logprobs(rows, reference=True), leading=self._leading, world_size=self.world_size, reference=True)

    @torch.no_grad()
    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        """In eval mode (no dropout), as a rollout engine computes them; under the KL reference with `reference`."""
        self._release_gathered()
        num_micro = int(self.step_counts(batch)["micro_batches"])
        with evaluating(self.module):
            slices = self._micro_batches(batch)
            parts = [(self.reference_logprobs(part) if reference else self.token_stats(part)[0]).cpu() for part in (self._part(batch, mb) for mb in slices)]
            for _ in range(num_micro - len(slices)):
                if reference:
                    self._dummy_reference_pass()
                else:
                    self._dummy_pass(backward=False)
        if self.zero_stage == 3:  # a forward without backward leaves prefetched weights gathered, or still arriving
            self.zero.empty_partition_cache()  # local, on every rank at the same point: a later gather starts from slices
            if reference and self._reference_engine is not None:
                self._reference_engine.empty_partition_cache()
        width = batch.input_ids.shape[1] - 1  # each part was cut to its longest row: padded back with 0
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]) if parts else torch.zeros((0, width))

    # Steps -----------------------------------------------------------------------------
    def run_step(self, batch: TokenBatch, counts: dict[str, float], micro_loss: MicroLoss, weight_of: Callable[[TokenBatch], float], *, kl: bool = False) -> dict[str, float]:
        """One optimizer step; "loss" (and "kl") are the global batch's, the other metrics are
        means over the loss tokens of the rows that ran (on every rank). With no rows to run
        anywhere, one dummy pass gives every parameter a zero gradient, so AdamW still steps.
        `kl`: each micro-batch makes one reference pass (`micro_loss` does), so under ZeRO-3
        each dummy pass makes one too."""
        self._release_gathered()
        totals: dict[str, float] = {"loss": 0.0, COVERED: 0.0}
        slices = self._micro_batches(batch)
        gathers_reference = kl and self.zero_stage == 3  # the reference's engine, or with LoRA this one's adapters off
        for k in range(max(int(counts["micro_batches"]), 1)):  # as many on every rank: ZeRO's collectives need it
            part = self._part(batch, slices[k]) if k < len(slices) else None
            weight = weight_of(part) if part is not None else 0.0
            if part is None or weight == 0:
                self._dummy_pass(backward=True, reference=gathers_reference)
                continue
            loss, metrics = micro_loss(part, slices[k])
            self.deepspeed.backward(loss * (weight * self.world_size))  # DeepSpeed averages over the ranks: this sums
            totals[COVERED] += add_metrics(totals, part, loss, metrics, weight=weight)
        self.deepspeed.step()  # reduces, clips, steps AdamW; skips a non-finite norm on every rank
        if gathers_reference and self._reference_engine is not None:  # forwards without backward leave prefetched weights gathered, or still arriving
            self._reference_engine.empty_partition_cache()  # local, on every rank at the same point
        norm = self.deepspeed.get_global_grad_norm()
        grad_norm = torch.tensor(math.nan if norm is None else float(norm))
        step_metrics = self.nonfinite.step(_StepTaken(), [], grad_norm, grad_clip=self.grad_clip, version=self.version)  # type: ignore[arg-type]
        summed = sum_over_ranks(totals, self.world_size)
        average_metrics(summed, summed.pop(COVERED))
        summed.update(step_metrics, lr=self.optimizer.param_groups[0]["lr"])
        return summed

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over every rank's rows; version += 1 (`rank_steps.train_step`: SPMD,
        or led by rank 0). `seq_masked_fraction` is the whole batch's on every rank.

        Raises:
            ValueError: a loss with `kl_coef > 0` on an engine built without `kl_reference`, or
                advantages or proximal logprobs not shaped like the batch, before any rank runs anything.
        """
        return rank_steps.train_step(self, batch, advantages, loss=loss, proximal_logprobs=proximal_logprobs, leading=self._leading)

    @torch.no_grad()
    def reference_logprobs(self, part: TokenBatch) -> torch.Tensor:
        """Local under ZeRO-1 and -2 (every rank holds the whole reference); under ZeRO-3 a
        pass of the reference's engine (with LoRA: of this one, its adapters off), gathering
        its weights with every rank."""
        with self._reference() as module:
            return self.token_stats(part, module=module)[0]

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The KL reference to run a forward of: the frozen copy (under ZeRO-3 its engine), or
        with LoRA DeepSpeed's engine with the adapters off."""
        if self.reference is not None:
            yield self._reference_engine or self.reference
            return
        assert self.lora is not None and self.kl_reference  # train_step checked it
        with lora_.adapters_off(self.module), evaluating(self.module):
            yield self.deepspeed

    def frozen_step(self) -> None:
        """A step the policy sits out (`algorithm.critic_warmup`: `TakesFrozenSteps`): version += 1,
        nothing else changes (led by rank 0, followers are not told: their version is never read)."""
        self.version += 1

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One supervised step over every rank's rows (`rank_steps.sft_step`; led by rank 0:
        `batch` is every row); the version is unchanged."""
        return rank_steps.sft_step(self, batch, leading=self._leading)

    # Weights and state -----------------------------------------------------------------
    def named_weights(self) -> LazyWeights:
        """Every weight, whole, under the un-sharded model's `state_dict` names, one at a time: a
        `WeightSource` a transport streams bucket by bucket.

        Its `specs()` need no gather. Under ZeRO-3 each pass gathers one parameter when it is
        reached (a collective: SPMD, every rank makes it, in the same order; led by rank 0,
        each pass rank 0 starts makes the followers make one in step, and a pass stopped early
        gathers the rest without yielding them). Under ZeRO-1 and -2 a pass yields this rank's
        own weights, which every rank holds whole, and involves no other rank.
        """
        return LazyWeights(self._weight_specs, self._weight_pass)

    def _weight_specs(self) -> list[TensorSpec]:
        specs = weight_specs(self.module)
        if self.lora is None:
            return specs
        metas = {s.name: torch.empty(s.shape, dtype=s.torch_dtype, device="meta") for s in specs}
        return [TensorSpec.of(name, meta) for name, meta in lora_.base_weights(self.module, metas).items()]  # merged ones keep the base's shape and dtype

    def _named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights a pass yields, gathering as it goes under ZeRO-3 (what a follower runs too)."""
        self._release_gathered()
        if self.lora is None:
            return weight_pass(self.module)
        return lora_.merged_weights(self.module, self.module.state_dict(keep_vars=True), full=whole)  # a layer's weight, A and B gathered when the weight is reached

    def _weight_pass(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.zero_stage < 3:
            yield from self._named_weights()
            return
        if self._leading:
            send_command("named_weights")
        weights = self._named_weights()
        try:
            for item in weights:  # noqa: UP028 - not `yield from`: closing this would close `weights` too
                yield item
        finally:
            for _ in weights:  # stopped early: make the remaining gathers (a generator that raised yields nothing)
                pass

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer (AdamW's moments and step per parameter), lr schedule and version,
        whole on the host, in `TorchTrainEngine.state_dict`'s format.

        A collective (led by rank 0: rank 0 calls it). Rank 0 gets the tensors; the other
        ranks get empty model and optimizer state (only rank 0 writes `tidal run`'s checkpoint).
        """
        if self._leading:
            send_command("state_dict")
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        self._release_gathered()
        model, optimizer = full_state(self.module, self.optimizer, rank=self.rank)
        state = {"model": model, "optimizer": optimizer, "lr_scheduler": self.scheduler.state_dict(), "version": self.version}
        if self.reference is not None:  # ZeRO-3: gathered, a collective; else whole on every rank
            state["reference"] = whole_weights(self.reference, rank=self.rank)
        if self.lora is not None:  # rank 0's whole state, in the torch engine's LoRA format (other ranks': empty)
            state.update(lora_.state_entries(self.module, model, self.lora))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a whole state (`state_dict()` of any train engine): rank 0's copy is broadcast.
        The optimizer keeps this engine's settings (lr, weight decay, betas); its moments and
        step count come from `state`.

        SPMD: a collective; every rank passes a state (only rank 0's is read). Led by rank
        0: rank 0 calls it.
        """
        position = state.get("lr_scheduler") or {"last_epoch": int(state["version"])}  # from before schedules: a step per version
        reference = state.get("reference") if self.reference is not None else None  # else the reference stays the weights the engine was built with
        model = state["model"] if self.lora is None else lora_.saved_weights(self.module, state, self.lora)  # LoRA: the base and adapters, exactly
        if self._leading:
            send_command("load_state_dict", with_optimizer=state.get("optimizer") is not None, version=int(state["version"]), lr_scheduler=position, has_reference=reference is not None)
        self._load_state_dict(dict(model), state.get("optimizer"), version=int(state["version"]), lr_scheduler=position, reference=reference)

    # Time-sharing devices: `ParksItself` -------------------------------------------------
    def park(self) -> None:
        """Move this rank's DeepSpeed state (its weights, gradients and AdamW's state, in
        DeepSpeed's flat buffers) to host memory (`deepspeed_state.offload_engine`). A KL reference goes through the platform's offload, or under ZeRO-3 its
        slices are moved here (`move_zero3_params`). Local to this rank,
        no collective: in a led group each rank's seat parks its own."""
        if self._reference_engine is not None and self.reference is not None and self._parked_reference is None:
            move_zero3_params(self.reference, _HOST)
            self._parked_reference = True
        elif self.reference is not None and self._parked_reference is None:
            self._parked_reference = self.platform.offload(module=self.reference)
        if self.lora is not None:
            move_zero3_params(self.module, _HOST, frozen_only=True)
        offload_engine(self.deepspeed, self.zero, zero_stage=self.zero_stage, frozen=self.lora is not None)

    def unpark(self) -> None:
        """Bring the state back to the device (`deepspeed_state.reload_engine`)."""
        reload_engine(self.deepspeed, self.zero, zero_stage=self.zero_stage, device=self.device)
        if self.lora is not None:
            move_zero3_params(self.module, self.device, frozen_only=True)
        if self._reference_engine is not None and self.reference is not None and self._parked_reference is not None:
            move_zero3_params(self.reference, self.device)
        elif self._parked_reference is not None:
            self._parked_reference.onload()
        self._parked_reference = None

    def _load_state_dict(self, model: dict[str, Any], optimizer: dict[str, Any] | None, *, version: int, lr_scheduler: dict[str, Any], reference: dict[str, Any] | None = None) -> None:
        """Rank 0's whole state on every rank; with `reference` (rank 0's whole weights, the
        other ranks' empty) every rank's reference set from rank 0's."""
        self._release_gathered()
        if reference is not None:
            assert self.reference is not None
            load_whole_weights(self.reference, rank=self.rank, weights=reference)
        load_full_state(self.module, self.zero, rank=self.rank, model=model, optimizer=optimizer)
        load_position(self.scheduler, lr_scheduler)
        self.version = version
