"""The critic of `algorithm.advantage=gae` on the `fsdp` train backend: `engines.critic`'s
value model sharded with FSDP2 over the trainer's ranks, as the policy is (`engines.fsdp_train`),
so a critic as large as the policy fits where the policy does. The `megatron` backend holds it
too, beside megatron-core's policy on the same ranks (`megatron_lead.follow`).

Rank 0 is called (it is the workflow's critic) and shares each batch's rows out over the
ranks; every other rank makes the same collective calls in `follow()` (`fsdp_lead.follow_engines`
hands it the commands marked `engine="critic"`): `engines.led_critic`. In a group of one rank
(`tidal run`'s local runtime) nothing is shared.

Each rank's values and loss are the torch critic's for its rows (`engines.critic`), and
gradients are reduced by a plain sum (`fsdp_setup.shard`), so a step is the torch critic's
step on the whole batch, up to float rounding. Its state is
the torch critic's format (un-sharded, on rank 0's host: `fsdp_checkpoint.full_state`), so a
checkpoint of either critic resumes the other.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tidal.engines import led_critic
from tidal.engines.critic import ValueModel, value_pass
from tidal.engines.fsdp_checkpoint import FROM_RANK0, full_state, load_full_state
from tidal.engines.fsdp_commands import CRITIC, model_recipe, send_command
from tidal.engines.fsdp_setup import ensure_process_group, rank_device, reset_sharded_params, reshard, shard
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform

# FSDP2 warns once that the value model returns a view (the head's output squeezed), which an
# in-place change would cut from its backward hook; no critic changes its values in place
# (`engines.critic.value_loss`), so the warning, in every PPO run's log, is held back: once, here,
# not around each forward (a `catch_warnings` per pass, which is not thread-safe either).
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .*FSDPValueModel.* returned a view tensor", category=UserWarning)


class FSDPCritic:
    """A value model trained on returns, sharded over every rank of the process group (module docstring).

    Args: those of `engines.critic.Critic`, and
        rank0_leads: over several ranks only rank 0 is called, and the others `follow()`;
            the only way it runs there (the workflow calls one critic).
    """

    distributed = True
    """Needs an initialised process group (`Distributed`): `tidal run` makes a one-process group
    when none exists, as for the multi-rank train engines (beside a one-process policy too)."""
    collective = True
    """Its passes and state are collectives over every rank."""

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
            send_command("init", engine=CRITIC, cls=f"{__name__}:{type(self).__name__}", model=model_recipe(policy), options=options)  # the followers build the class rank 0 did
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

    def follow_command(self, command: dict[str, Any]) -> None:
        """A follower: the collective calls of rank 0's `command` (what rank 0 gets back is dropped)."""
        if led_critic.follow_rows(self, command):
            return
        if command["op"] == "state_dict":
            full_state(self.model, self.optimizer)
        elif command["op"] == "load_state_dict":
            load_full_state(self.model, self.optimizer, {}, {} if command["has_optimizer_state"] else None, rank=self.rank)
        else:
            raise RuntimeError(f"rank 0 sent the critic an unknown command {command['op']!r}")

    # Values and steps (`engines.led_critic`) ----------------------------------------------
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """`[batch, seq - 1]` float32 values on the host, 0 outside the loss tokens, computed by every rank for its share of the rows."""
        return led_critic.lead_values(self, batch)

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the value loss of `batch` toward `returns` (`[batch, seq - 1]`,
        as `old_values`, the values the advantages were computed with), over every rank's share of the rows."""
        return led_critic.lead_train_step(self, batch, returns, old_values)

    def value_pass(self, batch: TokenBatch, rows: slice, columns: slice) -> torch.Tensor:
        return value_pass(self.model, batch, rows, columns, device=self.device, autocast=self.platform.autocast(self.precision))

    def dummy_pass(self, *, backward: bool) -> None:
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with self.platform.autocast(self.precision):
            values = self.model(ids, torch.ones_like(ids))
        if backward:
            (values.float().sum() * 0.0).backward()

    def after_forwards(self) -> None:
        reshard(self.model)  # a root keeps its gathered parameters after a forward without backward

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # reduce-scattered as a plain sum (`fsdp_setup.shard`)

    def step(self) -> float:
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
        return grad_norm

    # Time-sharing the devices (`flow.timeshare.Offloader` calls this after each move) ------
    def after_offload_move(self) -> None:
        """The offload moved each parameter's local shard: point FSDP's flat shard buffers at them."""
        reset_sharded_params(self.model)

    # State -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The value model's weights and AdamW's state, un-sharded on rank 0's host, in the
        torch critic's format (a collective: led by rank 0, rank 0 calls it; another rank gets empty ones)."""
        if self.led and self.rank == 0:
            send_command("state_dict", engine=CRITIC)
        model, optimizer, _ = full_state(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state (`state_dict` of either critic), rank 0's broadcast into every
        rank's shards; the optimizer keeps this critic's settings (`train_steps.own_settings`)."""
        has_optimizer_state = bool(state["optimizer"]["state"])
        if self.led and self.rank == 0:
            send_command("load_state_dict", engine=CRITIC, has_optimizer_state=has_optimizer_state)
        load_full_state(self.model, self.optimizer, dict(state["model"]), state["optimizer"] if has_optimizer_state else None, rank=self.rank)
