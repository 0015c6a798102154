"""The critic of `algorithm.advantage=gae` on the `fsdp` train backend: `engines.critic`'s
value model sharded with FSDP2 over the trainer's ranks, as the policy is (`engines.fsdp_train`),
so a critic as large as the policy fits where the policy does.

Rank 0 is called (it is the workflow's critic) and shares each batch's rows out over the
ranks (`fsdp_commands.send_rows`: even tokens); every other rank makes the same collective
calls in `follow()` (`fsdp_lead.follow_engines` hands it the commands marked
`engine="critic"`). In a group of one rank (`tidal run`'s local runtime) nothing is shared.

Each rank's values and loss are the torch critic's for its rows (`engines.critic`: the same
micro-batches, the value loss summed over their loss tokens and divided by the whole batch's),
and gradients are reduced by a plain sum (`fsdp_setup.shard`), so a step is the torch
critic's step on the whole batch, up to float rounding. Every rank makes as many passes as
the rank with the most micro-batches (dummy passes), as FSDP's collectives need. Its state is
the torch critic's format (un-sharded, on rank 0's host: `fsdp_checkpoint.full_state`), so a
checkpoint of either critic resumes the other.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tidal.engines.critic import ValueModel, chunks, micro_value_loss, step_metrics, value_pass
from tidal.engines.fsdp_checkpoint import FROM_RANK0, full_state, load_full_state
from tidal.engines.fsdp_commands import CRITIC, gather_rows, model_recipe, receive_rows, send_command, send_rows
from tidal.engines.fsdp_setup import ensure_process_group, rank_device, reset_sharded_params, reshard, shard
from tidal.engines.micro_batches import real_lengths
from tidal.engines.train_steps import evaluating
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform


class FSDPCritic:
    """A value model trained on returns, sharded over every rank of the process group (module docstring).

    Args: those of `engines.critic.Critic`, and
        rank0_leads: over several ranks only rank 0 is called, and the others `follow()`;
            the only way it runs there (the workflow calls one critic).
    """

    def __init__(
        self, policy: Any, *, lr: float = 1e-5, value_clip: float | None = 0.5, micro_batch_size: int = 8, grad_clip: float = 1.0,
        weight_decay: float = 0.01, precision: str = "fp32", platform: Platform | None = None, head: torch.nn.Linear | None = None,
        rank0_leads: bool = True,
    ) -> None:  # fmt: skip
        self.platform = platform or current_platform()
        self.platform.autocast(precision)  # raises before any collective where the platform lacks it
        self.precision = precision
        ensure_process_group(self.platform)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size > 1 and not rank0_leads:
            raise ValueError(f"an fsdp critic over {self.world_size} ranks is led by rank 0 (rank0_leads=True): the workflow calls one critic")
        self.led = self.world_size > 1
        if self.led and self.rank == 0:
            options = dict(lr=lr, value_clip=value_clip, micro_batch_size=micro_batch_size, grad_clip=grad_clip, weight_decay=weight_decay, precision=precision)
            send_command("init", engine=CRITIC, model=model_recipe(policy), options=options)
        body = copy.deepcopy(policy.base_model) if self.rank == 0 else policy.base_model  # rank 0's start is the caller's; a follower's was built for this
        model = ValueModel(body, policy.config.hidden_size, head=head)
        weights = model.state_dict() if self.led and self.rank == 0 else {}  # the un-sharded tensors, kept alive for the broadcast
        self.device = rank_device(self.platform)
        shard(model, init_device_mesh(self.device.type, (self.world_size,)))
        if self.led:
            set_model_state_dict(model, dict(weights), options=FROM_RANK0)  # the followers built theirs from random weights
        del weights
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, **self.platform.optimizer_options())
        self.value_clip, self.micro_batch_size, self.grad_clip = value_clip, micro_batch_size, grad_clip

    @property
    def _leading(self) -> bool:
        return self.led and self.rank == 0

    def follow_command(self, command: dict[str, Any]) -> None:
        """A follower: the collective calls of rank 0's `command` (what rank 0 gets back is dropped)."""
        op = command["op"]
        if op in ("values", "train_step"):
            fields = receive_rows(command, self.rank)
            batch = TokenBatch(*fields[:5])
            if op == "values":
                values = self._values(batch)
                if len(batch):
                    dist.send(values.contiguous(), dst=0)
            else:
                self._step(batch, fields[5], fields[6], num_tokens=command["num_tokens"])
        elif op == "state_dict":
            full_state(self.model, self.optimizer)
        elif op == "load_state_dict":
            load_full_state(self.model, self.optimizer, {}, {} if command["has_optimizer_state"] else None, rank=self.rank)
        else:
            raise RuntimeError(f"rank 0 sent the critic an unknown command {op!r}")

    # Values and steps ------------------------------------------------------------------
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """`[batch, seq - 1]` float32 values on the host, 0 outside the loss tokens, computed by every rank for its share of the rows."""
        if not self._leading:
            return self._values(batch)
        fields, shares = send_rows("values", batch.tensors(), real_lengths(batch), self.world_size, engine=CRITIC)
        return gather_rows(self._values(TokenBatch(*fields)), shares)

    @torch.no_grad()
    def _values(self, batch: TokenBatch) -> torch.Tensor:
        parts = list(chunks(batch, self.micro_batch_size))
        out = torch.zeros(batch.loss_mask.shape)
        with evaluating(self.model):
            for rows, columns in parts:
                out[rows, columns] = self._value_pass(batch, rows, columns).cpu()
            for _ in range(self._most(len(parts)) - len(parts)):
                self._dummy_pass(backward=False)
        reshard(self.model)  # a root keeps its gathered parameters after a forward without backward
        return out * batch.loss_mask.bool()

    def _value_pass(self, batch: TokenBatch, rows: slice, columns: slice) -> torch.Tensor:
        return value_pass(self.model, batch, rows, columns, device=self.device, autocast=self.platform.autocast(self.precision))

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the value loss of `batch` toward `returns` (`[batch, seq - 1]`,
        as `old_values`, the values the advantages were computed with), over every rank's share of the rows."""
        mask = batch.loss_mask.bool()
        num_tokens = int(mask.sum())
        local, local_returns, local_old = batch, returns, old_values
        if self._leading:
            (*fields, local_returns, local_old), _ = send_rows("train_step", [*batch.tensors(), returns, old_values], real_lengths(batch), self.world_size, engine=CRITIC, num_tokens=num_tokens)
            local = TokenBatch(*fields)
        total, clipped, grad_norm = self._step(local, local_returns, local_old, num_tokens=num_tokens)
        return step_metrics(total=total, clipped=clipped, grad_norm=grad_norm, returns=returns, old_values=old_values, mask=mask)

    def _step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor, *, num_tokens: int) -> tuple[float, int, float]:
        """This rank's part of a step (`num_tokens`: the whole batch's loss tokens): the value
        loss and clipped tokens summed over every rank, and the gradient's norm."""
        mask = batch.loss_mask.bool()
        parts = list(chunks(batch, self.micro_batch_size))
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2, dtype=torch.float64)  # value loss, clipped tokens
        for k in range(self._most(len(parts))):
            if k >= len(parts) or not mask[parts[k][0]].any():
                self._dummy_pass(backward=True)
                continue
            rows, columns = parts[k]
            loss, num_clipped = micro_value_loss(self._value_pass(batch, rows, columns), (rows, columns), returns=returns, old_values=old_values, mask=mask, clip=self.value_clip)
            (loss / max(num_tokens, 1)).backward()
            sums += torch.tensor([float(loss.detach()), float(num_clipped)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(sums)  # a CPU tensor: gloo carries it on every platform
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = 0.0
        if grads:  # every rank made the same passes: all have gradients, or none
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # all-reduced: every rank steps, or skips, alike
            grad_norm = float(norm)
            if math.isfinite(grad_norm):
                torch.nn.utils.clip_grads_with_norm_([p for p in self.model.parameters() if p.grad is not None], self.grad_clip, norm)
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(sums[0]), int(sums[1]), grad_norm

    def _most(self, num_passes: int) -> int:
        """The most passes any rank makes (a collective)."""
        if self.world_size == 1:
            return num_passes
        most = torch.tensor([num_passes], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def _dummy_pass(self, *, backward: bool) -> None:
        """A forward (and zero-gradient backward) that joins the other ranks' FSDP collectives."""
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with self.platform.autocast(self.precision):
            values = self.model(ids, torch.ones_like(ids))
        if backward:
            (values.float().sum() * 0.0).backward()

    # Time-sharing the devices (`flow.timeshare.Offloader` calls this after each move) ------
    def after_offload_move(self) -> None:
        """The offload moved each parameter's local shard: point FSDP's flat shard buffers at them."""
        reset_sharded_params(self.model)

    # State -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The value model's weights and AdamW's state, un-sharded on rank 0's host, in the
        torch critic's format (a collective: led by rank 0, rank 0 calls it; another rank gets empty ones)."""
        if self._leading:
            send_command("state_dict", engine=CRITIC)
        model, optimizer, _ = full_state(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state (`state_dict` of either critic), rank 0's broadcast into every
        rank's shards; the optimizer keeps this critic's settings (`train_steps.own_settings`)."""
        has_optimizer_state = bool(state["optimizer"]["state"])
        if self._leading:
            send_command("load_state_dict", engine=CRITIC, has_optimizer_state=has_optimizer_state)
        load_full_state(self.model, self.optimizer, dict(state["model"]), state["optimizer"] if has_optimizer_state else None, rank=self.rank)
