"""The learning-rate schedule of the train engines (`train.lr_schedule`, `train.warmup_steps`,
`train.min_lr_ratio`): a `torch.optim.lr_scheduler.LambdaLR` over the engine's AdamW.

The schedule counts RL steps: an engine steps it once per `train_step` (a skipped
non-finite step too, since the step still counts), never in `sft_step`, so step k of a
run (from 0) trains at `lr * factor(k)` whatever happened before it. Its position is
part of the engine's `state_dict()` (`lr_scheduler`) and of a `tidal run` checkpoint, so
a resumed run goes on along the same curve; the curve itself (lr, kind, warmup, length)
is the resumed recipe's, as AdamW's settings are (`torch_train.own_settings`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

LR_SCHEDULES = ("constant", "cosine")
"""What `train.lr_schedule` may name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """A learning-rate curve over `num_steps` optimizer steps, as a factor of the engine's lr.

    Warmup: steps 0 .. warmup_steps - 1 ramp linearly, step k at (k + 1) / (warmup_steps + 1),
    so no step trains at lr 0 (torchtitan's warmup). Then `constant` stays at 1, and `cosine`
    decays from 1 to `min_lr_ratio` at the last step (`num_steps - 1`) along half a cosine,
    and stays there past it (a run continued for more steps).
    """

    kind: str = "constant"
    warmup_steps: int = 0
    num_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.kind!r} is not one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1 (the steps the schedule spans), got {self.num_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1] (the cosine's last lr as a share of lr), got {self.min_lr_ratio}")

    def factor(self, step: int) -> float:
        """The lr of optimizer step `step` (from 0) as a share of the engine's lr."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        progress = min((step - self.warmup_steps) / max(self.num_steps - 1 - self.warmup_steps, 1), 1.0)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule | None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `schedule` (None: constant) on every param group of `optimizer`;
    it sets their lr to step 0's at once."""
    schedule = schedule or LRSchedule()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.factor(step))


def load_position(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any]) -> None:
    """Go on from a saved `scheduler.state_dict()` (or just `{"last_epoch": steps taken}`):
    its position, with this scheduler's curve and base lrs, the param groups' lr set to it."""
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict({**scheduler.state_dict(), **state, "lr_lambdas": [None] * len(base_lrs)})  # it pops what it reads
    scheduler.base_lrs = base_lrs
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reads
