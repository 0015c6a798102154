"""The critic of `algorithm.advantage=gae` on the `deepspeed` train backend: `engines.critic`'s
value model trained with DeepSpeed ZeRO-1 or -2 (the policy's `train.zero_stage`; ZeRO-3 is
refused: `DeepSpeedCritic.refusal`) over the trainer's ranks, as the policy is
(`engines.deepspeed_train`): AdamW's state is sharded over the ranks, the weights whole on each
(OpenRLHF trains its critic with DeepSpeed too).

Rank 0 is called and leads; every other rank makes the same collective calls in `follow()`
(`fsdp_lead.follow_engines` hands it the commands marked `engine="critic"`): `engines.led_critic`.
As in the policy engine, DeepSpeed partitions the value model when the engine starts and
broadcasts rank 0's weights, weights, gradients and AdamW's state are fp32 (`precision="bf16"`
runs forward passes under `platform.autocast`), each micro-batch's `backward()` accumulates
(its loss times the number of ranks: DeepSpeed averages gradients over them), and one `step()`
reduces, clips to `grad_clip` and steps AdamW, skipping a non-finite norm on every rank. So a
step is the torch critic's step on the whole batch, up to float rounding. Its state is the torch
critic's format (whole, on rank 0's host: `deepspeed_state.full_state`), so a checkpoint of any
critic resumes any other. It `ParksItself` (`flow.protocols`) as the policy engine does
(`deepspeed_state.offload_engine`), in the trainer's seat where rollout time-shares the devices.

Run for real: CPU with gloo, two processes, ZeRO-2 (tests/engines/test_led_critic.py: equal to
the torch critic, state round trips, parked between commands; tests/tools/test_deepspeed_run.py: a
`tidal run`). Not run: GPU or NPU.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tidal.engines import led_critic
from tidal.engines.critic import ValueModel, value_pass
from tidal.engines.deepspeed_setup import deepspeed_config, ensure_process_group, import_deepspeed, local_device_index
from tidal.engines.deepspeed_state import full_state, load_full_state, offload_engine, reload_engine
from tidal.engines.fsdp_commands import CRITIC, model_recipe, send_command
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform


class DeepSpeedCritic:
    """A value model trained on returns with DeepSpeed ZeRO over every rank of the process group (module docstring).

    Args: those of `engines.critic.Critic`, and
        zero_stage: ZeRO's stage (1, 2 or 3; `train.zero_stage`, the policy's).
        rank0_leads: over several ranks only rank 0 is called, and the others `follow()`;
            the only way it runs there (the workflow calls one critic).
    """

    distributed = True
    """Needs an initialised process group (`Distributed`): `tidal run` makes a one-process group
    when none exists, as for the multi-rank train engines (beside a one-process policy too)."""
    collective = True
    """Its passes and state are collectives over every rank."""

    train_keys = ("zero_stage",)
    """Recipe `train.*` keys it takes besides the `critic.*` ones (`TakesTrainKeys`)."""

    @staticmethod
    def refusal(*, zero_stage: int) -> str | None:
        """ZeRO-3 is refused (`RefusesTrainKeys`): DeepSpeed cannot set AdamW's state of its
        one-element value-head bias over several ranks (`safe_set_full_optimizer_state`,
        DeepSpeed 0.19.8), so a run could not resume. (Its gathers also fell out of step once a
        follower had parked the policy: most likely the policy's ZeRO-3 weights left gathered
        on one rank only, which `DeepSpeedTrainEngine._release_gathered` now rules out; not
        tried again.) The fsdp critic (`critic.backend=fsdp`) trains beside a ZeRO-3 policy instead."""
        if zero_stage == 3:
            return "train.zero_stage=3: the deepspeed critic (algorithm.advantage=gae) trains under ZeRO-1 or -2 only; set critic.backend=fsdp (the value model sharded with FSDP2 beside the ZeRO-3 policy), or train.zero_stage=2"
        return None

    def __init__(
        self, policy: Any, *, lr: float = 1e-5, value_clip: float | None = 0.5, micro_batch_size: int = 8, grad_clip: float = 1.0,
        weight_decay: float = 0.01, precision: str = "fp32", platform: Platform | None = None, head: torch.nn.Linear | None = None,
        zero_stage: int = 2, rank0_leads: bool = True,
    ) -> None:  # fmt: skip
        self.platform = platform or current_platform()
        self.platform.autocast(precision)  # raises before any collective where the platform lacks it
        refused = self.refusal(zero_stage=zero_stage)
        if refused:
            raise ValueError(refused)
        self.precision, self.zero_stage = precision, zero_stage
        body = copy.deepcopy(policy.base_model) if not dist.is_initialized() or dist.get_rank() == 0 else policy.base_model  # rank 0's start is the caller's
        model = ValueModel(body, policy.config.hidden_size, head=head)
        model.config = policy.config  # what `deepspeed_config` sizes its buckets by
        config = deepspeed_config(zero_stage=zero_stage, grad_clip=grad_clip, model=model)  # raises before any collective
        ensure_process_group(self.platform)
        deepspeed = import_deepspeed(self.platform)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.world_size > 1 and not rank0_leads:
            raise ValueError(f"a deepspeed critic over {self.world_size} ranks is led by rank 0 (rank0_leads=True): the workflow calls one critic")
        self.led = self.world_size > 1
        if self.led and self.rank == 0:
            options = dict(lr=lr, value_clip=value_clip, micro_batch_size=micro_batch_size, grad_clip=grad_clip, weight_decay=weight_decay, precision=precision, zero_stage=zero_stage)
            send_command("init", engine=CRITIC, cls=f"{__name__}:{type(self).__name__}", model=model_recipe(policy), options=options)  # the followers build the class rank 0 did
        index = local_device_index(self.platform)
        self.device = self.platform.device(index)
        self.platform.set_device(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, **self.platform.optimizer_options())
        self.deepspeed, self.zero, _, _ = deepspeed.initialize(args=SimpleNamespace(device_rank=index), model=model, optimizer=optimizer, config=config, dist_init_required=False)  # rank 0's weights, on every rank
        self.model = self.deepspeed.module.train()
        """The value model DeepSpeed wraps (its parameters DeepSpeed's views, or ZeRO-3's slices)."""
        self.optimizer: torch.optim.Optimizer = self.zero.optimizer
        self.value_clip, self.micro_batch_size, self.grad_clip = value_clip, micro_batch_size, grad_clip

    def follow_command(self, command: dict[str, Any]) -> None:
        """A follower: the collective calls of rank 0's `command` (what rank 0 gets back is dropped)."""
        if led_critic.follow_rows(self, command):
            return
        if command["op"] == "state_dict":
            full_state(self.model, self.optimizer, rank=self.rank)
        elif command["op"] == "load_state_dict":
            load_full_state(self.model, self.zero, rank=self.rank, model={}, optimizer={})
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
        return value_pass(self.deepspeed, batch, rows, columns, device=self.device, autocast=self.platform.autocast(self.precision))

    def dummy_pass(self, *, backward: bool) -> None:
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with self.platform.autocast(self.precision):
            values = self.deepspeed(ids, torch.ones_like(ids))
        if backward:
            self.deepspeed.backward(values.float().sum() * 0.0)

    def after_forwards(self) -> None:
        if self.zero_stage == 3:  # a forward without backward leaves prefetched weights gathered, or still arriving
            self.zero.empty_partition_cache()

    def backward(self, loss: torch.Tensor) -> None:
        self.deepspeed.backward(loss * self.world_size)  # DeepSpeed averages over the ranks: this sums

    def step(self) -> float:
        self.deepspeed.step()  # reduces, clips, steps AdamW; skips a non-finite norm on every rank
        norm = self.deepspeed.get_global_grad_norm()
        return math.nan if norm is None else float(norm)

    # Time-sharing devices: `ParksItself` -------------------------------------------------
    def park(self) -> None:
        """This rank's DeepSpeed state to host memory (`deepspeed_state.offload_engine`); local."""
        offload_engine(self.deepspeed, self.zero, zero_stage=self.zero_stage)

    def unpark(self) -> None:
        reload_engine(self.deepspeed, self.zero, zero_stage=self.zero_stage, device=self.device)

    # State -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The value model's weights and AdamW's state, whole on rank 0's host, in the torch
        critic's format (a collective: led by rank 0, rank 0 calls it; another rank gets empty ones)."""
        if self.led and self.rank == 0:
            send_command("state_dict", engine=CRITIC)
        model, optimizer = full_state(self.model, self.optimizer, rank=self.rank)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state (`state_dict` of any critic), rank 0's set on every rank; the
        optimizer keeps this critic's settings, its moments and step come from `state`."""
        if self.led and self.rank == 0:
            send_command("load_state_dict", engine=CRITIC)
        load_full_state(self.model, self.zero, rank=self.rank, model=dict(state["model"]), optimizer=state["optimizer"])
