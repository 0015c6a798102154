"""The steps the multi-rank train engines (`fsdp`, `deepspeed`, `megatron`) share.

Each engine keeps what is its own: a micro-batch's forward pass (`RankedTrainer.token_stats`),
how its ranks sum a step's counts (`step_counts`) and how the micro-batches' gradients become
one optimizer step over its sharding (`run_step`). What a policy step is does not differ
between them and lives here: the checks, sequence masking, rank 0 dropping the rows without
a learning signal before it shares out the rest (`train_step`), and each micro-batch's loss
and weight (`policy_step`); the supervised step (`sft_step`, `supervised_step`) and rank 0
sharing out the rows whose logprobs it is asked for (`lead_logprobs`), and a follower's part of
each of those (`follow_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tidal.engines.fsdp_commands import gather_rows, receive_rows, send_rows
from tidal.engines.micro_batches import real_lengths
from tidal.engines.train_steps import MicroLoss, batch_counts, check_step_inputs, loss_weight, mask_sequences, masked_fraction, policy_micro_loss, rows_with_signal
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch

COVERED = "_covered"
"""A step's internal total: the loss tokens of the micro-batches that ran."""


class RankedTrainer(Protocol):
    """What the steps here need of a multi-rank train engine."""

    kl_reference: bool
    """Whether the engine holds a KL reference (built with `kl_reference`): a frozen copy of
    the weights it was built with, or with LoRA adapters the base they sit on."""
    world_size: int
    device: torch.device
    scheduler: Any
    version: int

    def logprobs(self, batch: TokenBatch) -> torch.Tensor: ...

    def token_stats(self, batch: TokenBatch, *, entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows, width - 1] logprobs of the next tokens and (`entropy`: "grad" or "metric") their entropies."""
        ...

    def reference_logprobs(self, part: TokenBatch) -> torch.Tensor: ...

    def step_counts(self, batch: TokenBatch, running: TokenBatch | None = None, masked: tuple[int, int] | None = None) -> dict[str, float]:
        """`summed_counts`, with "micro_batches" as the engine's `run_step` needs it."""
        ...

    def run_step(self, batch: TokenBatch, counts: dict[str, float], micro_loss: MicroLoss, weight_of: Callable[[TokenBatch], float], *, kl: bool = False) -> dict[str, float]:
        """One optimizer step over `batch`'s micro-batches, each's loss weighed by `weight_of`;
        `kl`: each micro-batch makes a reference pass. Returns the whole batch's metrics."""
        ...


def select_rows(among: torch.Tensor, batch: TokenBatch, advantages: torch.Tensor, proximal_logprobs: torch.Tensor | None) -> tuple[TokenBatch, torch.Tensor, torch.Tensor | None]:
    """The rows `among` of a train step's batch, advantages and proximal logprobs."""
    return batch.select(among), advantages[among], None if proximal_logprobs is None else proximal_logprobs[among]


def summed_counts(batch: TokenBatch, running: TokenBatch | None = None, masked: tuple[int, int] | None = None, *, world_size: int, micro_batches: int = 0) -> dict[str, float]:
    """`batch_counts` of this rank's rows, "run_rows" (of `running`, default all), "masked" and
    "masked_of" (`masked`: this rank's sequences dropped and sequences with a loss token before
    it; default none), each summed over the ranks, and "micro_batches": the most of any rank's
    `micro_batches` (a collective: what `RankedTrainer.step_counts` gives)."""
    running = batch if running is None else running
    local = torch.tensor([*batch_counts(batch).values(), float(len(running)), *(masked or (0, 0)), float(micro_batches)], dtype=torch.float64)
    stacked = local[None]
    if world_size > 1:
        parts = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(parts, local)  # a CPU tensor: gloo carries it on every platform
        stacked = torch.stack(parts)
    tokens, sequences, rows, ran, dropped, with_tokens = stacked[:, :6].sum(0).tolist()
    return {"tokens": tokens, "sequences": sequences, "rows": rows, "run_rows": ran, "masked": dropped, "masked_of": with_tokens, "micro_batches": float(stacked[:, 6].max())}


def sum_over_ranks(totals: dict[str, float], world_size: int) -> dict[str, float]:
    """Each rank's share-weighted metrics summed: the metrics of the whole batch (a collective)."""
    if world_size == 1:
        return dict(totals)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, totals)  # small dicts of floats, inside this job only
    out: dict[str, float] = {}
    for part in gathered:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def train_step(engine: RankedTrainer, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None, leading: bool) -> dict[str, float]:
    """One optimizer step over every rank's rows; version += 1.

    SPMD: a collective; every rank calls it, each with its own rows (possibly a different
    number of them), advantages and proximal logprobs for those rows. `leading` (rank 0 of a
    led group): `batch` is every row; rank 0 drops the rows without advantage before it
    shares out the rest, so every rank gets its part of the rows that run, and sends the
    whole batch's counts along (its followers call `policy_step` with them). Sequence
    masking is decided before any of that (`mask_sequences`; SPMD: by each rank for its
    rows), and `seq_masked_fraction` is the whole batch's on every rank.

    Raises:
        ValueError: a loss with `kl_coef > 0` on an engine built without `kl_reference`, or
            advantages or proximal logprobs not shaped like the batch, before any rank runs anything.
    """
    if loss.kl_coef > 0 and not engine.kl_reference:
        raise ValueError(f"a loss with kl_coef={loss.kl_coef} needs a reference policy: build the engine with kl_reference=True")
    check_step_inputs(batch, advantages, proximal_logprobs)
    batch, loss, masked = mask_sequences(batch, loss, proximal_logprobs, engine.logprobs)
    if not leading:
        return policy_step(engine, batch, advantages, loss=loss, proximal_logprobs=proximal_logprobs, masked=masked)
    whole = None
    if not loss.zero_advantage_counts:
        whole = batch_counts(batch)
        batch, advantages, proximal_logprobs = select_rows(rows_with_signal(advantages, batch.loss_mask), batch, advantages, proximal_logprobs)
    (*fields, advantages, proximal_logprobs), _ = send_rows("train_step", [*batch.tensors(), advantages, proximal_logprobs], real_lengths(batch), engine.world_size, loss=loss, whole=whole)
    return policy_step(engine, TokenBatch(*fields), advantages, loss=loss, proximal_logprobs=proximal_logprobs, whole=whole, masked=masked)


def policy_step(
    engine: RankedTrainer, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None, whole: dict[str, float] | None = None, masked: tuple[int, int] | None = None
) -> dict[str, float]:
    """This rank's part of a step. Without a KL or entropy term, rows whose advantage is zero
    on every loss token add nothing to the loss or its gradient and get no pass (as in the
    torch engine); the counts that weigh the micro-batches are still the whole batch's
    (`whole`, when the leader dropped those rows already). `masked`: this rank's sequence
    masking counts (`mask_sequences`; a follower has none: its leader's are the whole batch's)."""
    among = rows_with_signal(advantages, batch.loss_mask) if not loss.zero_advantage_counts and whole is None else None
    counts = engine.step_counts(batch, None if among is None else batch.select(among), masked)
    if whole is not None:
        counts.update(whole)
    if among is not None:
        batch, advantages, proximal_logprobs = select_rows(among, batch, advantages, proximal_logprobs)

    micro_loss = policy_micro_loss(engine.token_stats, engine.reference_logprobs, advantages=advantages, proximal_logprobs=proximal_logprobs, loss=loss, device=engine.device)
    metrics = engine.run_step(batch, counts, micro_loss, loss_weight(loss, counts), kl=loss.kl_coef > 0)
    metrics.update(num_tokens=counts["tokens"], skipped_rows=counts["rows"] - counts["run_rows"])
    if masked is not None:
        metrics["seq_masked_fraction"] = masked_fraction(counts["masked"], counts["masked_of"])
    engine.scheduler.step()
    engine.version += 1
    return metrics


def sft_step(engine: RankedTrainer, batch: TokenBatch, *, leading: bool) -> dict[str, float]:
    """One supervised step over every rank's rows (`leading`: rank 0 of a led group, `batch` is
    every row, shared out first): next-token cross-entropy on `loss_mask` tokens; the
    version is unchanged."""
    if leading:
        fields, _ = send_rows("sft_step", batch.tensors(), real_lengths(batch), engine.world_size)
        batch = TokenBatch(*fields)
    return supervised_step(engine, batch)


def supervised_step(engine: RankedTrainer, batch: TokenBatch) -> dict[str, float]:
    """This rank's part of `sft_step` (what a follower runs), weighed by the loss tokens of every rank."""
    counts = engine.step_counts(batch)

    def micro_loss(part: TokenBatch, rows: Any) -> tuple[torch.Tensor, dict[str, float]]:
        mask = part.loss_mask.to(engine.device)
        return -(engine.token_stats(part)[0] * mask).sum() / mask.sum().clamp(min=1), {}

    metrics = engine.run_step(batch, counts, micro_loss, lambda part: float(part.loss_mask.sum()) / max(counts["tokens"], 1.0))
    metrics["num_tokens"] = counts["tokens"]
    return metrics


def lead_logprobs(batch: TokenBatch, local: Callable[[TokenBatch], torch.Tensor], *, leading: bool, world_size: int, **args: Any) -> torch.Tensor:
    """`local(batch)`: this rank's rows' logprobs (SPMD: a collective, every rank calls it); led
    by rank 0 (`leading`), of every row of `batch`, shared out and computed by all ranks (the
    "logprobs" command carries `args`: `reference=True` for logprobs under the KL reference)."""
    if not leading:
        return local(batch)
    fields, shares = send_rows("logprobs", batch.tensors(), real_lengths(batch), world_size, **args)
    return gather_rows(local(TokenBatch(*fields)), shares)


def follow_rows(engine: RankedTrainer, command: dict[str, Any], rank: int, local_logprobs: Callable[..., torch.Tensor]) -> bool:
    """A follower's part of a command that carries rows (`send_rows`): its share of a policy
    step (`policy_step`) or a supervised one, or the logprobs of its rows (`local_logprobs(rows,
    reference=...)`; under the KL reference where the command says so), sent to rank 0. False
    for any other command, which the engine runs itself."""
    op = command["op"]
    if op not in ("train_step", "sft_step", "logprobs"):
        return False
    fields = receive_rows(command, rank)
    tensors = [t for t in fields[:5] if t is not None]
    assert len(tensors) == 5  # rank 0 sends every field of its batch
    batch = TokenBatch(*tensors)
    if op == "train_step":
        advantages = fields[5]
        assert advantages is not None  # sent with every step
        policy_step(engine, batch, advantages, loss=command["loss"], proximal_logprobs=fields[6], whole=command["whole"])
    elif op == "sft_step":
        supervised_step(engine, batch)
    else:
        logprobs = local_logprobs(batch, reference=bool(command.get("reference")))
        if len(batch):
            dist.send(logprobs.contiguous(), dst=0)
    return True
