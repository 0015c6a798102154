"""The `megatron` train engine: megatron-core's `GPTModel` trained data parallel, on any hal platform.

The caller builds a transformers Qwen2 / Qwen3 / Llama / Mistral model whole; the engine builds
megatron-core's `GPTModel` from its config with the local layer spec and loads its weights
through `engines.megatron_convert` (`engines.megatron_setup`), then drops it. Before megatron-core
is imported, `tidal.hal.megatron.prepare_megatron` applies what the platform needs: MindSpeed's
adaptor on NPUs, two recorded patches where tensors live in host memory, nothing on GPUs.
megatron's parallel state is made over the process group hal set up, every rank a
data-parallel rank: tensor (and pipeline) parallel size 1, and `tensor_parallel_size` > 1 is
refused. Every rank holds the whole model and trains on its own rows; after the backward passes
the gradients are summed over the ranks (`all_reduce`, in buckets), so each rank clips the same
norm and steps torch's AdamW (with the platform's `optimizer_options()`, as the other engines)
to the same weights. megatron's own DDP and distributed optimizer are not used: with whole
weights on every rank they would add buffers and a CUDA-only path, not a different result.
Weights, gradients and optimizer state are in the model's dtype (fp32 unless `model.dtype`
says otherwise); `precision="bf16"` runs forward passes under `platform.autocast`, on
accelerators only (`hal.megatron.check_precision`: megatron's linear layers autocast on CUDA).

A step equals one `TorchTrainEngine` step over all ranks' rows, by the `deepspeed` engine's
bookkeeping: micro-batch losses are weighted by their share of the *global* batch's loss tokens,
sequences or rows (counted with one all-reduce), and the weighted gradients summed. Within a
rank, micro-batches hold rows of similar length cut to the longest (`engines.micro_batches`),
always padded: megatron-core's local attention takes no packed sequences, so
`padding_free=True` is refused (None runs padded). Rows are fed right-aligned (a left-padded
row is shifted to start at 0, then its logprobs shifted back), since megatron's rotary
positions count from each row's first column, under an explicit causal mask. Logits of the
padded vocabulary rows are dropped before the softmax. Rows whose advantage is zero on every
loss token get no pass (`skipped_rows`); a step whose gradient norm is not finite is skipped on
every rank (`train_steps.NonfiniteGuard`).

Weights: `named_weights()` is a `WeightSource` in the Hugging Face model's names (megatron's
fused q/k/v and gate/up split back: `megatron_convert.iter_hf_weights`), specs computed without
reading a tensor, one weight at a time, local on every rank. `state_dict()` is the torch engine's
format (HF names; AdamW's moments converted like their weights, indexed by the HF model's
parameters), so checkpoints move between the engines both ways; `load_state_dict` loads rank 0's
copy and broadcasts it.

Driving the ranks: SPMD (every rank calls every method with its own rows), or led by rank 0
(`rank0_leads=True`, what `tidal run` uses on several ranks): only rank 0 is called, and sends
each call's command and rows to the others, which run `tidal.engines.megatron_lead.follow()`
(the `fsdp` engine's command loop). Colocated and multiplexed layouts: the engine parks itself
(`ParksItself`: its `GPTModel` and AdamW through the platform's `offload`). A loss with a KL
term (`kl_reference=True`): a second, frozen `GPTModel` of the weights the engine was built
with, in `state_dict()` (HF names, as the torch engine's `reference`) and parked with the
model; `logprobs_under_reference` reads it for a KL penalty in the reward. PPO's critic on this
backend is the `fsdp` backend's (`engines.fsdp_critic`, a transformers value model). Not here: tensor or pipeline parallelism, Transformer Engine layers.

Run for real: megatron-core 0.16.1 on CPU with gloo (the host patches), 2 processes, SPMD and
led (tests/engines/test_megatron_train.py: equality with the torch engine's steps, logprobs
equal to the HF model's, exported weights, state round trips with this engine and the torch
engine), and `tidal run train.backend=megatron` in one process (a checkpoint that resumes exactly)
and as two rank actors under `runtime: ray` on a fake GPU cluster, which learn the quickstart
(tests/tools/test_megatron_run.py); colocated with its rollout on a fake GPU, equal to the
disaggregated run bit for bit (parks copy for real there). Not run: GPU (megatron-core unpatched), NPU with MindSpeed,
`precision="bf16"`; the code asks hal for the device and nothing here names a vendor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.engines import rank_steps
from tidal.engines.fsdp_commands import model_recipe, send_command
from tidal.engines.lr_schedule import LRSchedule, load_position, lr_scheduler
from tidal.engines.megatron_setup import (
    HFLayout,
    check_hf_config,
    ensure_process_group,
    hf_optimizer_state,
    hf_weight_shapes,
    hf_weights,
    init_parallel_state,
    load_hf_weights,
    megatron_model,
    megatron_optimizer_state,
    quiet_optional_kernels,
)
from tidal.engines.micro_batches import pack, row_lengths
from tidal.engines.rank_steps import COVERED, sum_over_ranks, summed_counts
from tidal.engines.train_steps import (
    MicroLoss,
    NonfiniteGuard,
    add_metrics,
    average_metrics,
    check_settings,
    evaluating,
    grads_of,
    next_token_stats,
    own_settings,
)
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform
from tidal.hal.megatron import check_precision, prepare_megatron, seed_megatron
from tidal.hal.transfer import LazyWeights, TensorSpec

_HOST = torch.device("cpu")
BUCKET_NUMEL = 1 << 24
"""Gradient elements summed over the ranks per `all_reduce` (one flat buffer of at most this many)."""


class MegatronTrainEngine:
    """A `TrainEngine` for a transformers Qwen2 / Qwen3 / Llama / Mistral model, trained as megatron-core's
    `GPTModel`, data parallel over all ranks.

    `rank0_leads=True`: only rank 0 is called; the other ranks run `megatron_lead.follow()`.
    """

    distributed = True
    """Needs an initialised process group: `tidal run` makes a one-process group when none exists."""
    collective = True
    """`load_state_dict` is a collective over every rank (weight passes and `state_dict` are local)."""

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
        tensor_parallel_size: int = 1,
        kl_reference: bool = False,
    ) -> None:
        check_settings(micro_batch_size=micro_batch_size, grad_clip=grad_clip, temperature=temperature, top_k=top_k, top_p=top_p, max_nonfinite_steps=max_nonfinite_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        if padding_free:
            raise ValueError("train.padding_free=true: the megatron engine runs megatron-core's local attention, which takes no packed sequences: set train.padding_free=false or null (padded micro-batches)")
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: the megatron engine trains data parallel only (every rank holds the whole model); tensor parallelism is not built yet")
        check_hf_config(model)  # all of these raise before any collective
        self.layout = HFLayout.of(model)
        """The HF model's names and sizes: what exports and state dicts are in."""
        self.platform = platform or current_platform()
        self.platform.autocast(precision)
        check_precision(self.platform, precision)  # mixed precision on accelerators only
        self.precision = precision
        ensure_process_group(self.platform)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.led = rank0_leads and self.world_size > 1
        """Only rank 0 is called; it sends every call to the other ranks."""
        if self.led and self.rank == 0:
            options = dict(lr=lr, weight_decay=weight_decay, betas=betas, grad_clip=grad_clip, micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch, temperature=temperature, top_k=top_k, top_p=top_p, precision=precision, max_nonfinite_steps=max_nonfinite_steps, lr_schedule=lr_schedule, version=version, padding_free=padding_free, kl_reference=kl_reference)
            send_command("init", model=model_recipe(model), options=options)
        self.device = self.platform.device(int(os.environ.get("LOCAL_RANK", "0")) if self.platform.device_count() > 1 else 0)
        self.platform.set_device(self.device)
        quiet_optional_kernels()
        prepare_megatron(self.platform)  # before megatron-core is imported (MindSpeed's adaptor on NPUs)
        from megatron.core import parallel_state  # noqa: PLC0415 - after `prepare_megatron`

        init_parallel_state(tensor_parallel_size)
        seed_megatron(self.platform, torch.initial_seed() % 2**31)
        self.group = parallel_state.get_data_parallel_group()
        """The ranks that sum their gradients (all of them)."""
        self.module = megatron_model(model, self.layout).to(self.device).train()
        """megatron-core's `GPTModel` (not `model`: the engine parks itself, with its AdamW: `park`)."""
        self._vocab_size = self.layout.shape.vocab_size
        self.reference = megatron_model(model, self.layout).to(self.device).eval().requires_grad_(False) if kl_reference else None
        """A frozen `GPTModel` of the weights the engine was built with, the reference policy of a
        loss with `kl_coef > 0` (`kl_reference=True`); kept in `state_dict()`, parked with the model."""
        self.kl_reference = kl_reference
        if self.world_size > 1:
            with torch.no_grad():
                for p in self._weights():
                    dist.broadcast(p.data, src=0)  # every rank starts from rank 0's weights
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, **self.platform.optimizer_options())
        self.scheduler = lr_scheduler(self.optimizer, lr_schedule)  # stepped once per train_step on every rank
        self.grad_clip, self.micro_batch_size, self.temperature = grad_clip, micro_batch_size, temperature
        self.top_k, self.top_p = top_k, top_p  # rollout's truncation: logprobs are taken under it (`engines.sampling`)
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch  # None: micro-batches bounded by rows only
        self.version = version
        self.nonfinite = NonfiniteGuard(max_nonfinite_steps)
        self._parked: Any = None
        """The platform's offload handle while a colocated rollout has the device (`park`)."""

    def _weights(self) -> list[torch.Tensor]:
        """The model's parameters, then the reference's (where the engine holds one)."""
        return [*self.module.parameters(), *(self.reference.parameters() if self.reference is not None else ())]

    @property
    def _leading(self) -> bool:
        return self.led and self.rank == 0

    # Rows of a led group ---------------------------------------------------------------------
    def follow_command(self, command: dict[str, Any]) -> None:
        """A follower (`megatron_lead.follow`): the collective calls of rank 0's `command` (what
        rank 0 gets back is dropped)."""
        if rank_steps.follow_rows(self, command, self.rank, self._logprobs):
            return
        op = command["op"]
        if op == "load_state_dict":
            self._load_state_dict(None, version=command["version"], lr_scheduler=command["lr_scheduler"])
        else:
            raise RuntimeError(f"rank 0 sent an unknown command {op!r}")

    # Forward passes --------------------------------------------------------------------
    def token_stats(self, batch: TokenBatch, *, entropy: str | None = None, module: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each next token's logprob ([rows, seq - 1]; 0 where it or its predictor is padding), and
        its distribution's entropy with `entropy` (`next_token_stats`), under `module` (default:
        the trained model)."""
        batch = batch.to(self.device)
        ids, mask = batch.input_ids, batch.attention_mask != 0
        width = ids.shape[1]
        shift = mask.to(torch.uint8).argmax(1)  # each row's first real token: megatron's positions count from column 0
        columns = torch.arange(width, device=self.device)
        aligned = ids.gather(1, (columns + shift[:, None]).clamp(max=width - 1)) if bool(shift.any()) else ids
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).triu(1)[None, None]  # True: not attended
        with self.platform.autocast(self.precision):
            logits = (module or self.module)(aligned, None, causal)[:, :-1, : self._vocab_size]  # the padded vocabulary rows left out
        logprobs, entropies = next_token_stats(logits, aligned[:, 1:], temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy)
        if bool(shift.any()):  # position t of the batch is t - shift of the aligned rows
            back = (columns[None, :-1] - shift[:, None]).clamp(min=0)
            logprobs = logprobs.gather(1, back)
            entropies = None if entropies is None else entropies.gather(1, back)
        real = mask[:, :-1] & mask[:, 1:]
        return torch.where(real, logprobs, 0.0), None if entropies is None else torch.where(real, entropies, 0.0)

    def _micro_batches(self, batch: TokenBatch) -> Iterator[tuple[torch.Tensor, TokenBatch]]:
        """(rows, micro-batch): this rank's rows sorted by length (stable), in runs within
        `micro_batch_size` rows and `max_tokens_per_micro_batch` padded tokens, each cut to its longest row."""
        lengths = row_lengths(batch)
        order = torch.sort(lengths, stable=True).indices
        for part in pack(lengths[order].tolist(), max_rows=self.micro_batch_size, max_tokens=self.max_tokens_per_micro_batch):
            rows = order[part]
            yield rows, batch.select(rows).crop(max(int(lengths[rows].max()), 2))

    def step_counts(self, batch: TokenBatch, running: TokenBatch | None = None, masked: tuple[int, int] | None = None) -> dict[str, float]:
        """`rank_steps.summed_counts` (its ranks need not make as many micro-batches: data parallel
        sums the gradients once, after them)."""
        return summed_counts(batch, running, masked, world_size=self.world_size)

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[batch, seq - 1] logprob of each next token of this rank's rows (0 where it or its
        predictor is padding); led by rank 0: of every row of `batch`, computed by all ranks."""
        return rank_steps.lead_logprobs(batch, self._logprobs, leading=self._leading, world_size=self.world_size)

    def logprobs_under_reference(self, batch: TokenBatch) -> torch.Tensor:
        """`logprobs` under the frozen KL reference (`LogprobsUnderReference`; an engine built with
        `kl_reference=True`): each rank's share of the rows through its own whole copy."""
        if self.reference is None:
            raise ValueError("logprobs under the reference need one: build the engine with kl_reference=True")
        return rank_steps.lead_logprobs(batch, lambda rows: self._logprobs(rows, reference=True), leading=self._leading, world_size=self.world_size, reference=True)

    @torch.no_grad()
    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> torch.Tensor:
        """In eval mode (no dropout), as a rollout engine computes them (under the KL reference
        with `reference`); local to this rank."""
        module = self.reference if reference else self.module
        assert module is not None  # `logprobs_under_reference` checked there is a reference
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        with evaluating(module):
            for rows, part in self._micro_batches(batch):
                out[rows, : part.loss_mask.shape[1]] = self.token_stats(part, module=module)[0].float().cpu()
        return out

    # Steps -----------------------------------------------------------------------------
    def run_step(self, batch: TokenBatch, counts: dict[str, float], micro_loss: MicroLoss, weight_of: Callable[[TokenBatch], float], *, kl: bool = False) -> dict[str, float]:
        """One optimizer step; "loss" (and "kl") are the global batch's, the other metrics means
        over the loss tokens of the rows that ran (on every rank). A parameter no micro-batch
        reached (none ran on any rank) gets a zero gradient, so AdamW still steps. `counts` and
        `kl` change nothing here (the reference is local to each rank)."""
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0, COVERED: 0.0}
        for rows, part in self._micro_batches(batch):
            weight = weight_of(part)
            if weight == 0:
                continue
            loss, metrics = micro_loss(part, rows)
            (loss * weight).backward()
            totals[COVERED] += add_metrics(totals, part, loss, metrics, weight=weight)
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._sum_gradients(grads_of(params))
        grad_norm = torch.nn.utils.get_total_norm(grads_of(params))  # the same on every rank
        step_metrics = self.nonfinite.step(self.optimizer, params, grad_norm, grad_clip=self.grad_clip, version=self.version)
        summed = sum_over_ranks(totals, self.world_size)
        average_metrics(summed, summed.pop(COVERED))
        summed.update(step_metrics, lr=self.optimizer.param_groups[0]["lr"])
        return summed

    def _sum_gradients(self, grads: list[torch.Tensor]) -> None:
        """Each gradient summed over the ranks, in place: one `all_reduce` per bucket of at most
        `BUCKET_NUMEL` elements, in parameter order (the same on every rank)."""
        if self.world_size == 1:
            return
        bucket: list[torch.Tensor] = []
        for k, grad in enumerate(grads):
            bucket.append(grad)
            if k + 1 == len(grads) or sum(g.numel() for g in bucket) + grads[k + 1].numel() > BUCKET_NUMEL:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=self.group)
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
                bucket = []

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
        assert self.reference is not None  # train_step checked it
        return self.token_stats(part, module=self.reference)[0]

    def frozen_step(self) -> None:
        """A step the policy sits out (`algorithm.critic_warmup`: `TakesFrozenSteps`): version += 1,
        nothing else changes (led by rank 0, followers are not told: their version is never read)."""
        self.version += 1

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One supervised step over every rank's rows (`rank_steps.sft_step`; led by rank 0:
        `batch` is every row); the version is unchanged."""
        return rank_steps.sft_step(self, batch, leading=self._leading)

    # Time-sharing devices: `ParksItself` -------------------------------------------------
    def park(self) -> None:
        """Move this rank's weights, gradients and AdamW's state to host memory with the
        platform's `offload` (they live in `GPTModel`'s parameters and torch's AdamW: nothing
        of megatron's own holds them between steps), so a colocated rollout engine has the
        device. Local to this rank, no collective: in a led group each rank's seat parks its
        own."""
        assert self._parked is None, "parked twice without an unpark"
        parked = self.module if self.reference is None else torch.nn.ModuleList([self.module, self.reference])  # holds both, changes neither
        self._parked = self.platform.offload(module=parked, optimizer=self.optimizer)

    def unpark(self) -> None:
        """Bring them back to the device, in place (after a park that raised before moving
        anything, nothing); one that raises can be called again."""
        if self._parked is not None:
            self._parked.onload()
            self._parked = None

    # Weights and state -----------------------------------------------------------------
    def named_weights(self) -> LazyWeights:
        """Every weight in the Hugging Face model's `state_dict` names (a tied `lm_head.weight`
        too), one at a time in model order: a `WeightSource` whose specs read no tensor. Local:
        every rank holds the whole model."""
        dtype = str(self.layout.dtype).removeprefix("torch.")
        return LazyWeights(lambda: [TensorSpec(name, dtype, shape) for name, shape in hf_weight_shapes(self.layout)], lambda: hf_weights(self.module, self.layout))

    def state_dict(self) -> dict[str, Any]:
        """Model (HF names), optimizer (AdamW's moments and step per HF parameter), lr schedule and
        version, on the host, in `TorchTrainEngine.state_dict`'s format. Local: any rank's is the
        group's (rank 0's is what `tidal run` writes)."""
        model = {name: tensor.to(_HOST, copy=True) for name, tensor in hf_weights(self.module, self.layout)}
        state = {"model": model, "optimizer": hf_optimizer_state(self.optimizer, self.module, self.layout), "lr_scheduler": self.scheduler.state_dict(), "version": self.version}
        if self.reference is not None:
            state["reference"] = {name: tensor.to(_HOST, copy=True) for name, tensor in hf_weights(self.reference, self.layout)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a whole state (`state_dict()` of any train engine) on rank 0 and broadcast it. The
        optimizer keeps this engine's settings (lr, weight decay, betas); its moments and step
        count come from `state` (none there: a fresh AdamW's).

        SPMD: a collective; every rank passes a state (only rank 0's is read). Led by rank 0:
        rank 0 calls it.

        Raises:
            ValueError: on rank 0, before any collective, a weight or moment is missing or of another shape.
        """
        position = state.get("lr_scheduler") or {"last_epoch": int(state["version"])}  # from before schedules: a step per version
        if self._leading:
            send_command("load_state_dict", version=int(state["version"]), lr_scheduler=position)
        self._load_state_dict(state if self.rank == 0 else None, version=int(state["version"]), lr_scheduler=position)

    def _load_state_dict(self, state: dict[str, Any] | None, *, version: int, lr_scheduler: dict[str, Any]) -> None:
        if state is not None:  # rank 0
            optimizer = state.get("optimizer")
            converted = None if optimizer is None else megatron_optimizer_state(optimizer, self.module, self.layout)  # raises before anything changed
            if self.reference is not None and state.get("reference") is not None:  # else the reference stays the weights the engine was built with
                load_hf_weights(self.reference, self.layout, state["reference"])
            load_hf_weights(self.module, self.layout, state["model"])
            if converted is not None:  # else AdamW's state stays
                with own_settings(self.optimizer):
                    self.optimizer.load_state_dict(converted)
        if self.world_size > 1:
            self._broadcast_state()
        load_position(self.scheduler, lr_scheduler)
        self.version = version

    def _broadcast_state(self) -> None:
        """Rank 0's weights (the reference's too) and AdamW state on every rank (a collective)."""
        params = list(self.module.parameters())
        first = self.optimizer.state.get(params[0], {})
        box = [float(first["step"]) if self.rank == 0 and "step" in first else None]  # rank 0's step count; None: no step taken
        dist.broadcast_object_list(box, src=0, device=_HOST)
        with torch.no_grad():
            for p in self._weights():
                dist.broadcast(p.data, src=0)
        step = box[0]
        if step is None:  # a fresh AdamW everywhere
            self.optimizer.state.clear()
            return
        for p in params:
            state = self.optimizer.state[p]
            if self.rank != 0 and "exp_avg" not in state:
                group = self.optimizer.param_groups[0]
                on_device = bool(group.get("fused") or group.get("capturable"))
                state.update(step=torch.tensor(step, dtype=torch.float32, device=p.device if on_device else _HOST), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"].fill_(step)
            for key in ("exp_avg", "exp_avg_sq"):
                dist.broadcast(state[key], src=0)
