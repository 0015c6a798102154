"""The small protocols every engine adapter implements (the workflow relies on nothing else).

A custom engine is one class with these methods; the workflow never looks further.
Rollout engines generate trajectories (token in, token out) and take new weights only at
safe points; train engines compute logprobs and take optimizer steps on `TokenBatch`es;
reward functions score finished trajectories.

What only some engines (or rollout groups, weight wirings, prompt sources) can do is a
small `runtime_checkable` protocol below, checked with `isinstance`, never by probing
for a name: supervised steps, weight sharing, parking for time-shared devices, pausing
for a reclaimed seat, several ranks. From Python 3.12 `isinstance` sees only what a class
or its instance declares (`inspect.getattr_static`), not what a `__getattr__` forwards, so
a wrapper (`flow.timeshare.SharedTrainEngine`, `flow.ray.rollouts.RemoteRollouts`) declares
each capability it is checked for.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch, Trajectory
from tidal.hal.transfer import TensorSpec


class Refill(Protocol):
    """Continuous batching: what a rollout engine's `generate` hands finished rows to, and asks
    for new ones, as rows end (the rollout worker's side: `flow.rollout`)."""

    def done(self, trajectories: list[Trajectory]) -> None:
        """These rows ended (finished, `finish_reason` set) at the last decoding step."""
        ...

    def more(self) -> list[Trajectory]:
        """Rows to add to the decoding batch now (may be none); it never blocks."""
        ...


class RolloutEngine(Protocol):
    version: int
    """Version of the weights it generates with now."""

    def generate(
        self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None, refill: Refill | None = None
    ) -> list[Trajectory]:
        """Continue every unfinished trajectory (in place) until EOS or `max_new_tokens`
        generated tokens in total; return them. Between decoding steps (safe points) it
        calls `should_pause()`; when that is True it returns early, leaving unfinished
        trajectories with `finish_reason=None` to be resumed by a later call. An
        unfinished trajectory needs at least one prompt token (ValueError).

        With `refill`, after a decoding step where rows ended they are given to
        `refill.done()` and the rows `refill.more()` returns join the batch (continuous
        batching: a slot a short response leaves does not idle until the longest ends); the
        return value then ends with those rows. An engine that cannot add rows to a running
        batch asks only when its batch is empty; one that implements `refill` hands every row that ends to `done()`
        before `generate` returns. An engine may ignore `refill` (no continuous batching):
        its caller then takes what ended from the trajectories once the call returns."""
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


@runtime_checkable
class TakesFrozenSteps(Protocol):
    """A train engine whose policy can sit a step out (`algorithm.critic_warmup`)."""

    def frozen_step(self) -> None:
        """A step in which the policy does not train: version += 1; its weights, optimizer state
        and learning-rate schedule stay as they are (on every rank: nothing runs)."""
        ...


@runtime_checkable
class Critic(Protocol):
    """A learned value function (`algorithm.advantage=gae`): the workflow asks it for each
    step's values before the policy trains, then trains it on that step's returns."""

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """`[batch, seq - 1]` float32 values on the host, aligned as the logprobs are, 0 outside the loss tokens."""
        ...

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step toward `returns` (`[batch, seq - 1]`); `old_values` are the
        values the advantages were computed with (for value clipping). Returns metrics."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RewardFn(Protocol):
    def __call__(self, trajectory: Trajectory, text: str) -> float:
        """Score one finished trajectory given its decoded continuation."""
        ...


# Train engines ------------------------------------------------------------------------
@runtime_checkable
class SupervisedStep(Protocol):
    """A train engine that takes supervised steps: the warm start before RL (`sft.steps`)."""

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step of next-token cross-entropy on `batch`'s `loss_mask` tokens
        (the policy version is unchanged: RL's first version is the warm-started policy);
        returns metrics with `loss`."""
        ...


@runtime_checkable
class TakesTrainKeys(Protocol):
    """A train engine whose constructor takes recipe `train.*` keys of its own, besides those
    every train engine takes (the deepspeed engine's `zero_stage`): `tidal run` passes each
    under its own name. Checked on the engine class."""

    train_keys: tuple[str, ...]
    """The names, each a key of the recipe's `train` section and a keyword of the constructor."""


@runtime_checkable
class LogprobsUnderReference(Protocol):
    """A train engine that gives a whole batch's logprobs under its frozen KL reference (built
    with `kl_reference=True`), as `logprobs` gives them under its weights: what a KL penalty in
    the reward reads (`algorithm.kl_in_reward`)."""

    def logprobs_under_reference(self, batch: TokenBatch) -> torch.Tensor:
        """`[batch, seq - 1]` logprob of each next token under the reference, 0 where `logprobs` gives 0."""
        ...


@runtime_checkable
class RefusesTrainKeys(Protocol):
    """An engine class that cannot run with some values of its own `train.*` keys
    (`TakesTrainKeys`): `tidal run` asks it before any work. Checked on the class."""

    train_keys: tuple[str, ...]

    @staticmethod
    def refusal(**train_keys: Any) -> str | None:
        """Why it cannot run with these values of its `train_keys`, naming the key; None when it can."""
        ...


@runtime_checkable
class SharesWeights(Protocol):
    """A train engine that can keep its weights in memory a weight transport gives (the `ipc`
    transport's shared buffer): a publish then copies nothing in the trainer's process."""

    def share_weights(self, place: Callable[[list[TensorSpec], dict[str, str], torch.device], Sequence[torch.Tensor]], *, before_change: Callable[[], None]) -> None:
        """From now on keep the weights in the tensors `place(specs, ties, device)` returns
        (one per spec of `named_weights()`, a tied name given its twin's), and call
        `before_change()` every time before they change, so a reader in another process
        finishes first.

        Raises:
            ValueError: before `place` is called, when the weights cannot move (nothing moved).
        """
        ...


@runtime_checkable
class Collective(Protocol):
    """A train engine whose weight passes, `state_dict` and `load_state_dict` may be
    collective calls over several ranks' shards: a seat that time-shares its devices takes
    a turn for each (`flow.timeshare.SharedTrainEngine`)."""

    collective: bool
    """True when they are collectives every rank must make (False: local calls)."""


@runtime_checkable
class Distributed(Collective, Protocol):
    """A train engine whose instance is one rank of a `torch.distributed` group (FSDP): the
    run sets up a process group for it before building it (a group of one under `runtime:
    local`), and every rank takes each step together (`collective`: a time-shared seat runs
    a rank's collective calls inside its turn). Checked on the engine class or instance."""

    distributed: bool
    """Always True for such an engine: the marker `isinstance` sees."""


@runtime_checkable
class StepsInTurns(Protocol):
    """A train engine that time-shares its devices (`flow.timeshare.SharedTrainEngine`): the
    workflow holds one turn from each train step through the weight pass after it."""

    def turn_for_step(self) -> AbstractContextManager[Any]:
        """What the workflow holds around a step and its publish (a no-op context where the
        weight pass takes no turn of its own)."""
        ...


# Parking: engines whose state a time-shared seat moves to host memory and back ------------
@runtime_checkable
class ParksItself(Protocol):
    """An engine that frees its devices' memory itself and takes it back, where moving one
    `model` would not do: vLLM's sleep mode (its weights and KV cache are vLLM's own),
    DeepSpeed's `offload_states` (its parameters live in DeepSpeed's flat buffers). A
    time-shared seat parks it with `park()` and unparks it with `unpark()`."""

    def park(self) -> None:
        """Free the devices' memory, keeping what the engine needs to go on (host copies)."""
        ...

    def unpark(self) -> None:
        """Take the memory back, as it was before `park`."""
        ...


@runtime_checkable
class HoldsModel(Protocol):
    """An engine whose weights live in one module, `model`: what a time-shared seat parks
    (`flow.colocate.Sharing`: moved to host memory between the engine's turns and back, in
    place, so the engine's own references stay valid), and where the workflow reads the
    trainer's dtype (its advantages' dtype; float32 for an engine without one)."""

    model: torch.nn.Module


@runtime_checkable
class HoldsReference(Protocol):
    """A train engine that may keep a frozen reference policy (a loss with a KL term), a
    whole model's weights: a seat parks it with `model`."""

    reference: torch.nn.Module | None
    """The reference policy, or None when the engine keeps none."""


@runtime_checkable
class HoldsOptimizer(Protocol):
    """A train engine whose optimizer state a train seat parks with its model."""

    optimizer: torch.optim.Optimizer


@runtime_checkable
class MovesAfterOffload(Protocol):
    """An engine with sharded parameters (FSDP) that must be pointed at its tensors again
    after a park or an unpark moved them (`flow.timeshare.Offloader`'s `moved`)."""

    def after_offload_move(self) -> None:
        """Point the engine's own views (e.g. FSDP's flat shard buffers) at the moved tensors."""
        ...


# Rollout engines ---------------------------------------------------------------------------
@runtime_checkable
class BuildsFromCheckpoint(Protocol):
    """A rollout engine class that loads the model itself from the checkpoint directory (vLLM
    builds its own model, sharded over its devices): the run passes `model.path` where other
    engines take a torch module, `tensor_parallel_size` from the placement's devices per
    instance, and its recipe `rollout.*` keys by name; under Ray its actor receives each
    version into host memory (`load_weights` sends it on to the engine's own processes).
    Checked on the class."""

    builds_from_checkpoint: bool
    """Always True for such an engine: the marker `isinstance` sees."""
    rollout_keys: tuple[str, ...]
    """Recipe `rollout` keys the constructor takes by the same name (`gpu_memory_utilization`, ...)."""


@runtime_checkable
class Pads(Protocol):
    """A rollout engine that pads batches with a token of the tokenizer's (`pad_id`): the
    trainer's batches are padded with it too (never trained on); 0 for one without."""

    pad_id: int


@runtime_checkable
class Reclaimable(Protocol):
    """A rollout engine seated on borrowed devices (`flow.timeshare.SharedRolloutEngine`):
    its `generate` also pauses when the devices' owner wants them back. A worker in hand-off
    mode then hands its paused groups to another worker and waits for its next turn."""

    reclaimed: bool
    """The last `generate` paused because another seat wanted the devices (not for `should_pause`)."""

    def wait_turn(self) -> None:
        """Block until this seat's next turn (the devices are back), and give it up again."""
        ...


# Rollout groups, weight wirings, prompt sources ------------------------------------------
@runtime_checkable
class ResendsWeights(Protocol):
    """A rollout group whose workers can lose their weights (a rollout actor Ray restarted):
    a trainer waiting for rows publishes its current version again when asked."""

    def weights_wanted(self) -> concurrent.futures.Future[None]:
        """Completes when a worker has no version to generate with until one is published;
        the next `publish` starts a new future."""
        ...


@runtime_checkable
class PostsWeights(Protocol):
    """A weight wiring that can post a version (`ipc`): written and announced in the caller's
    thread, its receivers' answers collected before the next one, so `transport.overlap`
    needs no copy and no send thread."""

    def post(self, version: int, source: Any) -> None:
        """Write `version` and announce it; return without waiting for the answers."""
        ...

    def post_again(self) -> None:
        """Announce the last posted version again (to receivers wired in since)."""
        ...

    def collect(self, timeout_s: float | None = None) -> None:
        """Wait for every receiver's answer to the last post; raise a receiver's error."""
        ...


@runtime_checkable
class Positioned(Protocol):
    """A prompt source that knows how far it is (`position`, read after each take): a
    checkpoint records it, and a source built from it resumes there."""

    position: Any
