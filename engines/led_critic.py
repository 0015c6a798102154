"""What a critic sharded over the trainer's ranks does on each rank, whatever shards it
(`engines.fsdp_critic`, `engines.deepspeed_critic`): rank 0 is called, shares each batch's rows
out over the ranks (`fsdp_commands.send_rows`: even tokens) and gathers the values back; every
rank values or trains on its share, in the torch critic's micro-batches (`engines.critic`),
making as many passes as the rank with the most (dummy passes), as sharded weights' collectives
need. Losses are summed over a micro-batch's loss tokens and divided by the whole batch's, so
the summed gradients are the torch critic's on the whole batch.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from tidal.engines.critic import chunks, micro_value_loss, step_metrics
from tidal.engines.fsdp_commands import CRITIC, gather_rows, receive_rows, send_rows
from tidal.engines.micro_batches import real_lengths
from tidal.engines.train_steps import evaluating
from tidal.flow.trajectory import TokenBatch


class RankCritic(Protocol):
    """One rank's part of a led critic: its passes over its value model, however it is sharded."""

    rank: int
    world_size: int
    led: bool
    """Several ranks, rank 0 called: it shares the rows out."""
    micro_batch_size: int
    value_clip: float | None

    @property
    def model(self) -> torch.nn.Module:
        """The value model (in eval mode for values, no dropout, as the torch critic's)."""
        ...

    def value_pass(self, batch: TokenBatch, rows: slice, columns: slice) -> torch.Tensor:
        """`engines.critic.value_pass` of this rank's value model: float32 values on its device."""
        ...

    def dummy_pass(self, *, backward: bool) -> None:
        """A forward (and a zero-gradient backward) that joins the other ranks' collectives."""
        ...

    def after_forwards(self) -> None:
        """Local: after forwards without backward (release weights gathered for them)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss`, this rank's share of the whole batch's."""
        ...

    def step(self) -> float:
        """Reduce the gradients over the ranks, clip them and step AdamW (or skip a non-finite
        norm, on every rank alike); zero them; the norm before clipping (a collective)."""
        ...


def lead_values(critic: RankCritic, batch: TokenBatch) -> torch.Tensor:
    """`[batch, seq - 1]` float32 values on the host, 0 outside the loss tokens: rank 0 of a
    led group shares the rows out and gathers every rank's values back."""
    if not (critic.led and critic.rank == 0):
        return rank_values(critic, batch)
    fields, shares = send_rows("values", batch.tensors(), real_lengths(batch), critic.world_size, engine=CRITIC)
    return gather_rows(rank_values(critic, TokenBatch(*fields)), shares)


@torch.no_grad()
def rank_values(critic: RankCritic, batch: TokenBatch) -> torch.Tensor:
    """This rank's rows' values (a collective)."""
    parts = list(chunks(batch, critic.micro_batch_size))
    out = torch.zeros(batch.loss_mask.shape)
    with evaluating(critic.model):
        for rows, columns in parts:
            out[rows, columns] = critic.value_pass(batch, rows, columns).cpu()
        for _ in range(most_passes(len(parts), critic.world_size) - len(parts)):
            critic.dummy_pass(backward=False)
    critic.after_forwards()
    return out * batch.loss_mask.bool()


def lead_train_step(critic: RankCritic, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
    """One optimizer step on the value loss of `batch` toward `returns`, over every rank's
    share of the rows (`old_values`: what the advantages were computed with); the step's metrics."""
    mask = batch.loss_mask.bool()
    num_tokens = int(mask.sum())
    local, local_returns, local_old = batch, returns, old_values
    if critic.led and critic.rank == 0:
        (*fields, local_returns, local_old), _ = send_rows("train_step", [*batch.tensors(), returns, old_values], real_lengths(batch), critic.world_size, engine=CRITIC, num_tokens=num_tokens)
        local = TokenBatch(*fields)
    total, clipped, grad_norm = rank_step(critic, local, local_returns, local_old, num_tokens=num_tokens)
    return step_metrics(total=total, clipped=clipped, grad_norm=grad_norm, returns=returns, old_values=old_values, mask=mask)


def rank_step(critic: RankCritic, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor, *, num_tokens: int) -> tuple[float, int, float]:
    """This rank's part of a step (`num_tokens`: the whole batch's loss tokens): the value loss
    and clipped tokens summed over every rank, and the gradient's norm."""
    mask = batch.loss_mask.bool()
    parts = list(chunks(batch, critic.micro_batch_size))
    sums = torch.zeros(2, dtype=torch.float64)  # value loss, clipped tokens
    for k in range(most_passes(len(parts), critic.world_size)):
        if k >= len(parts) or not mask[parts[k][0]].any():
            critic.dummy_pass(backward=True)
            continue
        rows, columns = parts[k]
        loss, num_clipped = micro_value_loss(critic.value_pass(batch, rows, columns), (rows, columns), returns=returns, old_values=old_values, mask=mask, clip=critic.value_clip)
        critic.backward(loss / max(num_tokens, 1))
        sums += torch.tensor([float(loss.detach()), float(num_clipped)], dtype=torch.float64)
    if critic.world_size > 1:
        dist.all_reduce(sums)  # a CPU tensor: gloo carries it on every platform
    return float(sums[0]), int(sums[1]), critic.step()


def follow_rows(critic: RankCritic, command: dict[str, Any]) -> bool:
    """A follower: this rank's part of rank 0's "values" or "train_step" `command`; False for another command."""
    if command["op"] not in ("values", "train_step"):
        return False
    fields = [t for t in receive_rows(command, critic.rank) if t is not None]  # rank 0 sends every one (`lead_values`, `lead_train_step`)
    batch = TokenBatch(*fields[:5])
    if command["op"] == "values":
        values = rank_values(critic, batch)
        if len(batch):
            dist.send(values.contiguous(), dst=0)
    else:
        rank_step(critic, batch, fields[5], fields[6], num_tokens=command["num_tokens"])
    return True


def most_passes(num_passes: int, world_size: int) -> int:
    """The most passes any rank makes (a collective)."""
    if world_size == 1:
        return num_passes
    most = torch.tensor([num_passes], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)
