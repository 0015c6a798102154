"""The small protocols every engine adapter implements (the workflow relies on nothing else).

A custom engine is one class with these methods; the workflow never looks further.
Rollout engines generate trajectories (token in, token out) and take new weights only at
safe points; train engines compute logprobs and take optimizer steps on `TokenBatch`es;
reward functions score finished trajectories.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch, Trajectory


class RolloutEngine(Protocol):
    version: int
    """Version of the weights it generates with now."""

    def generate(self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None) -> list[Trajectory]:
        """Continue every unfinished trajectory (in place) until EOS or `max_new_tokens`
        generated tokens in total; return them. Between decoding steps (safe points) it
        calls `should_pause()`; when that is True it returns early, leaving unfinished
        trajectories with `finish_reason=None` to be resumed by a later call. An
        unfinished trajectory needs at least one prompt token (ValueError)."""
        ...

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights (all of them, by name) and become `version`.

        Raises:
            ValueError: changing nothing, when a name is missing, unknown or repeated, a
                shape or a non-floating dtype differs, or names tied in the model are
                given different values.
        """
        ...


class TrainEngine(Protocol):
    version: int
    """Number of optimizer steps taken (the policy version it holds)."""

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[batch, seq - 1] logprob of each next token under the current weights (no grad;
        the model in eval mode: no dropout)."""
        ...

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over `batch` (in micro-batches); version += 1; returns metrics."""
        ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every weight by name (what a rollout engine's `load_weights` takes).

        Best a `tidal.hal.transfer.WeightSource` (specs without materialising, passes that
        can be repeated): weight transports then stream it bucket by bucket; a plain
        iterator works too, and a transport lists it first (one full copy).
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and version, for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RewardFn(Protocol):
    def __call__(self, trajectory: Trajectory, text: str) -> float:
        """Score one finished trajectory given its decoded continuation."""
        ...


@runtime_checkable
class Distributed(Protocol):
    """A train engine whose instance is one rank of a `torch.distributed` group (FSDP): the
    run sets up a process group for it before building it (a group of one under `runtime:
    local`), and every rank takes each step together (`collective`: a time-shared seat runs
    a rank's collective calls inside its turn). Checked on the engine class or instance."""

    distributed: bool
    """Always True for such an engine: the marker `isinstance` sees."""
    collective: bool
    """Its steps and weight exports are collective calls that every rank must make."""
