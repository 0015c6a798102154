"""The staleness-bounded async RL loop: rollout, reward, advantage and trainer stages.

Every stage talks to the others only through the store:

    prompts --put--> [prompts]                               (the loader)
    rollout  <-get prompts--  --put tokens, logprobs, versions--> [train]
    reward   <-get tokens--   --put reward--> [train]
    advantage<-get complete groups with reward-- --put advantage--> [train]
    trainer  <-get batch with advantage, version >= v - max_staleness--; step; v += 1

The trainer publishes each new version's weights; the rollout stage applies them at its
next safe point - before a generate call, or between decoding chunks, where the
generation pauses and resumes with the new weights (partial rollout, every token keeps
the version that produced it). Admission control keeps rollout from starting samples
that could not be trained in time: a group may start only if, its samples counted as
started, `started - dropped - filtered <= (max_staleness + version + 1) * batch_size`
(AReaL's bound), and the trainer's sampler drops any group with a row older than
`max_staleness` versions (whole, each row counted). With `algorithm.filter_groups` the
advantage stage leaves out the groups without signal (DAPO's dynamic sampling; `filtered`),
and admission starts other prompts in their place.
`max_staleness: 0` is synchronous on-policy training.

The loader, reward and advantage stages are `flow.stages.Stages`, threads of the process
that holds the store; this module is the trainer's side (and the rollout stage's thread).
In `runtime: local` every stage is a thread of one process; rows stay in the in-process
store (zero copy). Per step the loop reports the version-gap histogram of the trained
tokens, dropped rows, and the time each stage spent waiting.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.flow.algorithms import TOKEN_WHITENED, VALUE_BASED, KLController, PolicyLossConfig, filter_truncated, gae, kl_penalty_rewards, masked_whiten, token_whiten
from tidal.flow.clock import FIRST_COMPLETED, REAL, Clock
from tidal.flow.config import AlgorithmConfig, RolloutConfig
from tidal.flow.protocols import Critic, HoldsModel, LogprobsUnderReference, Pads, ResendsWeights, RolloutEngine, StepsInTurns, TakesFrozenSteps, TrainEngine
from tidal.flow.rollout import ROLLOUT_TOTALS, LocalRollouts, RolloutGroup, RolloutWorker
from tidal.flow.rows import TRAJECTORY_COLUMNS, token_batch_of
from tidal.flow.stages import Stages, guard
from tidal.flow.store import Grouped, StalenessFilter, Store
from tidal.flow.trace import Tracer
from tidal.flow.trajectory import ENV_VERSION, Trajectory


@dataclasses.dataclass(kw_only=True)
class WorkflowConfig:
    """The loop's settings: the recipe's own `algorithm` and `rollout` sections (`flow.config`,
    declared once for both) and what the run resolves around them."""

    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """Steps, batch, staleness bound, advantage and loss."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Token budget and generate batches of the rollout stage."""
    lease_s: float = 3600.0
    """How long a stage may hold rows it took before the store hands them out again. Longer
    than any generation and two train steps (the trainer takes the next step's rows while
    one trains): a stage that dies gives its rows back at once (its process disconnects
    from the store), so this only frees rows a hung one holds."""
    rollout_threads: int = 0
    """torch intra-op threads of the rollout thread (`LocalRollouts`); 0 = what torch gives
    a new thread (the count last set in this process)."""

    def __post_init__(self) -> None:
        self.loss  # noqa: B018 - the loss's bounds, checked now: it raises naming the bad field

    @property
    def loss(self) -> PolicyLossConfig:
        """The policy loss of `algorithm`'s keys, over responses of `rollout.max_new_tokens` at most."""
        return self.algorithm.loss(self.rollout.max_new_tokens)

    @classmethod
    def from_keys(cls, **keys: Any) -> WorkflowConfig:
        """A config from flat keys, each going to the section with a field of its name
        (`num_steps=3, max_new_tokens=16, lease_s=60`): the loop used as a library,
        without a recipe.

        Raises:
            TypeError: naming a key no section has.
        """
        sections: dict[str, dict[str, Any]] = {"algorithm": {}, "rollout": {}, "own": {}}
        fields = {name: "algorithm" for name in _field_names(AlgorithmConfig)} | {name: "rollout" for name in _field_names(RolloutConfig)}
        own = _field_names(cls) - {"algorithm", "rollout"}
        for key, value in keys.items():
            where = "own" if key in own else fields.get(key)
            if where is None:
                raise TypeError(f"WorkflowConfig has no key {key!r}: not a field of it, AlgorithmConfig or RolloutConfig")
            sections[where][key] = value
        return cls(algorithm=AlgorithmConfig(**sections["algorithm"]), rollout=RolloutConfig(**sections["rollout"]), **sections["own"])

    @property
    def batch_size(self) -> int:
        """Rows per optimizer step."""
        return self.algorithm.prompts_per_step * self.algorithm.group_size


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class Workflow:
    """One run of the loop. `run()` blocks until `num_steps` steps are done (or a stage fails).

    Args:
        store: the store the stages talk through; the stages create its partitions.
        rollout: the rollout engine (generates with the weights it was last given).
        trainer: the train engine (its `version` is the policy version).
        prompts: prompt dicts with "prompt_ids" (list[int]) and any other keys (kept in
            each trajectory's `meta`, e.g. the reference answer); an iterable with a
            `position` lets `stages.save` record where it is.
        score: scores a list of finished trajectories: (rewards, indexes of failed rows), or
            (rewards, failed, how many of the failed timed out: `reward_timeouts`).
        config: the loop's settings.
        on_step: called with each step's metrics dict (after the step).
        tracer: records a span per generate / reward / advantage / train / weight update.
        totals: the run's running totals before this attempt (a resumed run's checkpoint,
            what `save` returned): `failed_rewards`, `reward_timeouts`, `paused_generations` and `handed_off`
            in each step's metrics go on from them, and `reported_dropped` (the rows the
            steps' `dropped` counted) lets the first step count the store's drops that no
            step did; keys it does not count are kept for `save`.
        critic: the value function of `algorithm.advantage=gae` (needed then, unused otherwise):
            each step's token advantages are GAE over its values, whitened over the step's
            loss tokens, and it trains on the step's returns after the policy's step.
        clock: what every stage waits on, reads the time from and starts its threads with:
            the real clock, or a simulation's virtual one (`tidal simulate`), under which
            this same loop schedules simulated engines.
    """

    def __init__(
        self,
        *,
        store: Store,
        rollout: RolloutEngine,
        trainer: TrainEngine,
        prompts: Iterable[dict[str, Any]],
        score: Callable[[Sequence[Trajectory]], tuple[list[float], list[int]] | tuple[list[float], list[int], int]],
        config: WorkflowConfig,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        tracer: Tracer | None = None,
        start_version: int | None = None,
        rollouts: RolloutGroup | None = None,
        totals: Mapping[str, int] | None = None,
        critic: Critic | None = None,
        clock: Clock = REAL,
    ) -> None:
        if (config.algorithm.advantage in VALUE_BASED) != (critic is not None):
            raise ValueError(f"algorithm.advantage={config.algorithm.advantage} " + ("needs a critic" if critic is None else "takes no critic: only a value-based estimator (gae) uses one"))
        self.store, self.rollout, self.trainer, self.config = store, rollout, trainer, config
        self.critic = critic
        algorithm = config.algorithm
        self.reward_kl = KLController((totals or {}).get("reward_kl_coef", algorithm.kl_in_reward), algorithm.kl_target, algorithm.kl_horizon) if algorithm.kl_in_reward > 0 else None
        """The coefficient of a KL penalty in the reward (`algorithm.kl_in_reward`; a resumed run's from its checkpoint), or None."""
        if self.reward_kl is not None and not isinstance(trainer, LogprobsUnderReference):
            raise ValueError(f"algorithm.kl_in_reward={algorithm.kl_in_reward} reads logprobs under the reference policy, which {type(trainer).__name__} does not give (`LogprobsUnderReference`)")
        if algorithm.critic_warmup and not isinstance(trainer, TakesFrozenSteps):
            raise ValueError(f"algorithm.critic_warmup={algorithm.critic_warmup} has the policy sit steps out, which {type(trainer).__name__} cannot (`TakesFrozenSteps`)")
        self.clock = clock
        self.on_step = on_step or (lambda metrics: None)
        self.tracer = tracer or Tracer(clock=clock)
        self.version = trainer.version if start_version is None else start_version
        self._totals = dict(totals or {})
        self.stages = Stages(store=store, prompts=prompts, score=score, config=config, version=self.version, tracer=self.tracer, num_failed_rewards=self._totals.get("failed_rewards", 0), num_reward_timeouts=self._totals.get("reward_timeouts", 0), clock=clock)
        """The loader, reward and advantage stages (`save` saves the store through them)."""
        self._stopping = clock.event()
        self.rollouts: RolloutGroup = rollouts or LocalRollouts(
            RolloutWorker(
                store=store,
                engine=rollout,
                group_size=config.algorithm.group_size,
                max_new_tokens=config.rollout.max_new_tokens,
                prompts_per_generate=config.rollout.prompts_per_generate,
                continuous=config.rollout.continuous_batching,
                stopping=self._stopping,
                tracer=self.tracer,
                clock=clock,
            ),
            threads=config.rollout_threads,
        )
        self._errors: list[BaseException] = []
        self._trained = 0
        self._waits: dict[str, float] = collections.defaultdict(float)
        self._rollout_counts = {key: self._totals.get(key, 0) for key in ROLLOUT_TOTALS}  # the run's, as of the last step's metrics
        # Drops the steps reported so far. A checkpoint saved while the next step's rows are
        # being taken (the prefetch) holds a store with drops no reported step counted: this
        # attempt's first step reports them (a checkpoint from before the count: none).
        self._reported_dropped = self._totals.get("reported_dropped", self._num_dropped())
        self._unreported_dropped = self._num_dropped() - self._reported_dropped

    # Control ------------------------------------------------------------------------------
    def run(self) -> None:
        """Run the stages until `num_steps` optimizer steps are done; re-raise a stage's error."""
        self.stages.start()
        threads = [self.clock.thread(self._guard, args=(fn,), name=f"tidal-{name}") for name, fn in (("rollouts", self._rollouts_stage), ("stages", self._stages_watch))]
        for thread in threads:
            thread.start()
        try:
            self._guard(self._train_stage)
        finally:
            self.stop()
            for thread in threads:
                thread.join(timeout=60)
        if self._errors:
            raise self._errors[0]

    def stop(self) -> None:
        self._stopping.set()
        self.stages.stop()  # wakes the store's waiters, this thread's train gets among them (`_stopping` is set)
        self.rollouts.stop()

    def save(self, path: str | Path) -> dict[str, Any]:
        """Save the store to `path` for a checkpoint (`Stages.save`); return what the
        checkpoint records with it: `prompt_position`, and `totals` for the `totals` of a
        run resumed from it (the failed rewards' count is the saved store's; rollout's
        counts are the last step's, as its workers, remote ones too, last reported them)."""
        saved = self.stages.save(path)
        totals = {**self._totals, **self._rollout_counts, "failed_rewards": saved["failed_rewards"], "reward_timeouts": saved["reward_timeouts"], "reported_dropped": self._reported_dropped}
        if self.reward_kl is not None:
            totals["reward_kl_coef"] = self.reward_kl.coef
        return {"prompt_position": saved["prompt_position"], "totals": totals}

    def _guard(self, stage: Callable[[], None]) -> None:
        guard(stage, stopping=self._stopping, errors=self._errors, stop=self.stop)

    def _stages_watch(self) -> None:
        """Wait for the loader, reward and advantage stages: their error ends the run (they end only when stopped)."""
        self.stages.wait()

    # Stages -------------------------------------------------------------------------------
    def _rollouts_stage(self) -> None:
        self.rollouts.run()

    def _train_stage(self) -> None:
        cfg = self.config
        loss = dataclasses.replace(cfg.loss, proximal_is_policy=True) if cfg.algorithm.decoupled else cfg.loss
        # With max_staleness >= 1, step v+1's rows are taken (and made into tensors) by a
        # thread while step v trains, mostly while its backward pass has let go of the GIL;
        # they are judged stale or not at version v+1, when they are trained. (With 0 they
        # are generated only after step v's weights are out.) Rollout actors that can ask
        # for weights again (`weights_wanted`) get the rows taken by that thread with 0 too,
        # so the trainer can answer while it waits (`_await_rows`).
        resends = isinstance(self.rollouts, ResendsWeights)
        prefetcher = self.clock.executor(1, name="tidal-prefetch") if cfg.algorithm.max_staleness > 0 or resends else None
        upcoming: concurrent.futures.Future[_TrainRows] | None = None
        try:
            while self.version < cfg.algorithm.num_steps:
                step_begin = self.clock.now()
                if upcoming is None and resends:
                    assert prefetcher is not None
                    upcoming = prefetcher.submit(self._train_rows, self.version)
                rows = self._train_rows(self.version) if upcoming is None else self._await_rows(upcoming)
                if self._stopping.is_set():  # stopped after they were taken (often while the last step trained): left leased, not trained
                    break
                self._waits["train"] += self.clock.now() - step_begin
                if prefetcher is not None and cfg.algorithm.max_staleness > 0 and self.version + 1 < cfg.algorithm.num_steps:
                    upcoming = prefetcher.submit(self._train_rows, self.version + 1)
                else:
                    upcoming = None
                self._train_on(rows, loss, step_begin)
        finally:
            if prefetcher is not None:
                prefetcher.shutdown(wait=False, cancel_futures=True)  # a get in flight ends with the workflow's stop

    def _await_rows(self, upcoming: concurrent.futures.Future[_TrainRows]) -> _TrainRows:
        """The rows `upcoming` takes. Meanwhile, when a rollout actor that restarted has no
        weights to generate with (`weights_wanted()` completes), this version's weights go
        out again: the trainer is not training, so its weights are still this version's,
        and a lone rollout actor could otherwise wait for the next version while the
        trainer waits for the rows it generates."""
        if isinstance(self.rollouts, ResendsWeights):
            while upcoming not in self.clock.wait_futures([upcoming, self.rollouts.weights_wanted()], return_when=FIRST_COMPLETED)[0]:
                with self._trainer_turn():
                    self._publish(self.version)
        return upcoming.result()

    def _train_rows(self, version: int) -> _TrainRows:
        """The rows version `version` trains, from the store, as the tensors the trainer takes."""
        cfg, pad_id = self.config, self.rollout.pad_id if isinstance(self.rollout, Pads) else 0
        sampler = StalenessFilter(cfg.algorithm.max_staleness, Grouped(cfg.algorithm.group_size), at_version=version)
        # Only this get drops rows (its sampler), one at a time: the count's rise across it is
        # this step's, though with the prefetch it happens while the step before trains.
        dropped = self._num_dropped()
        batch = self.store.get("train", "train", [*TRAJECTORY_COLUMNS, "reward", "advantage"], cfg.batch_size, sampler=sampler, cancel=self._stopping)
        dropped = self._num_dropped() - dropped
        order = torch.from_numpy(np.argsort(batch.index_array, kind="stable"))  # deterministic row order
        tokens = token_batch_of(batch, pad_id=pad_id, order=order)
        lengths = tokens.loss_mask.sum(1)  # generated tokens of each response, before any filter
        finish_reasons = [batch.columns["finish_reason"][k] for k in order.tolist()]
        num_truncated = sum(reason == "length" for reason in finish_reasons)
        if cfg.algorithm.overlong == "filter" and num_truncated:
            tokens = dataclasses.replace(tokens, loss_mask=filter_truncated(tokens.loss_mask, finish_reasons))
        versions, counts = torch.unique(tokens.versions[tokens.versions != ENV_VERSION], return_counts=True)
        rewards = batch.stack("reward").to(torch.float32)
        row_rewards = rewards[order]
        by_group: dict[Any, list[int]] = {}
        rewards_by_group: dict[Any, list[float]] = {}
        values = rewards.tolist()
        for k, n in zip(order.tolist(), lengths.tolist()):
            by_group.setdefault(batch.groups[k], []).append(int(n))
            rewards_by_group.setdefault(batch.groups[k], []).append(round(values[k], 6))
        return _TrainRows(
            indexes=batch.indexes,
            groups=sorted(set(batch.groups)),
            tokens=tokens,
            advantages=self._step_advantages(batch.stack("advantage")[order].to(torch.float32), tokens.loss_mask),
            row_rewards=row_rewards,
            mean_reward=float(rewards.mean()),
            num_tokens=int(lengths.sum()),
            max_response_len=int(lengths.max()),
            num_truncated=num_truncated,
            token_versions=dict(zip(versions.tolist(), counts.tolist())),
            dropped=dropped,
            lengths=[by_group[g] for g in sorted(by_group)],
            rewards=[rewards_by_group[g] for g in sorted(rewards_by_group)],
        )

    def _step_advantages(self, advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The rows' advantages as the step trains them: whitened over the step's loss tokens
        for an estimator that asks it (`TOKEN_WHITENED`: REINFORCE++-baseline), else as put."""
        if self.config.algorithm.advantage not in TOKEN_WHITENED:
            return advantages
        return token_whiten(advantages, loss_mask.sum(1))

    def _critic_advantages(self, rows: _TrainRows) -> tuple[torch.Tensor, Callable[[], dict[str, float]] | None]:
        """The step's advantages, and the critic's step on its returns (None without a critic):
        with a critic (`gae`), per token from its values now, before either model trains."""
        if self.critic is None:
            return rows.advantages, None
        critic, cfg, tokens = self.critic, self.config.algorithm, rows.tokens
        with self.tracer.span("train", "values", version=self.version, rows=len(rows.indexes)):
            values = critic.values(tokens)
        penalties, kl_metrics = self._reward_kl_penalties(tokens)
        advantages, returns = gae(rows.row_rewards, values, tokens.loss_mask, gamma=cfg.gamma, lam=cfg.lam, token_rewards=penalties)
        return masked_whiten(advantages, tokens.loss_mask), lambda: {**critic.train_step(tokens, returns, values), **kl_metrics}

    def _reward_kl_penalties(self, tokens: Any) -> tuple[torch.Tensor | None, dict[str, float]]:
        """With a KL penalty in the reward: each loss token's (`kl_penalty_rewards`, from the
        trainer's reference logprobs), the step's `reward_kl` (mean over the sequences of
        their per-token KL) and the `reward_kl_coef` used, after which the coefficient adapts
        (`KLController`); else none."""
        if self.reward_kl is None:
            return None, {}
        assert isinstance(self.trainer, LogprobsUnderReference)  # __init__ checked it
        with self.tracer.span("train", "reference", version=self.version, rows=len(tokens)):
            reference = self.trainer.logprobs_under_reference(tokens)
        coef = self.reward_kl.coef
        penalties, per_row = kl_penalty_rewards(tokens.behavior_logprobs, reference, tokens.loss_mask, coef=coef)
        kl = float(per_row.mean()) if len(per_row) else 0.0
        self.reward_kl.update(kl, len(per_row))
        return penalties, {"reward_kl": kl, "reward_kl_coef": coef}

    def _num_dropped(self) -> int:
        """Rows the trainer's sampler found too old, so far."""
        return self.store.consumer_counts("train", "train")["dropped"]

    def _train_on(self, rows: _TrainRows, loss: PolicyLossConfig, step_begin: float) -> None:
        """One optimizer step on `rows`, the publish of its weights, and the step's metrics."""
        cfg = self.config
        tokens, num_rows = rows.tokens, len(rows.indexes)
        gaps = {self.version - v: n for v, n in sorted(rows.token_versions.items(), reverse=True)}
        if gaps and max(gaps) > cfg.algorithm.max_staleness:
            raise AssertionError(f"a token {max(gaps)} versions old reached the trainer (max_staleness={cfg.algorithm.max_staleness})")
        with self._trainer_turn():
            advantages, critic_step = self._critic_advantages(rows)
            metrics: dict[str, Any] = {}
            if self.version < cfg.algorithm.critic_warmup:  # the critic learns alone first
                assert isinstance(self.trainer, TakesFrozenSteps)  # __init__ checked it
                self.trainer.frozen_step()
            else:
                with self.tracer.span("train", "train", version=self.version, rows=num_rows):
                    metrics = self.trainer.train_step(tokens, advantages.to(self._dtype()), loss=loss)
            if critic_step is not None:
                with self.tracer.span("train", "critic", version=self.version, rows=num_rows):
                    metrics.update(critic_step())
            self.store.ack("train", "train", rows.indexes)
            self._trained += num_rows
            self._publish(self.trainer.version)
        dropped, self._unreported_dropped = rows.dropped + self._unreported_dropped, 0
        self._reported_dropped += dropped
        step_s = self.clock.now() - step_begin
        waits, self._waits = dict(self._waits), collections.defaultdict(float)
        stage_metrics = self.stages.metrics()
        rollout_metrics = self.rollouts.metrics()
        waits.update(stage_metrics["wait_s"])
        waits.update(rollout_metrics.pop("wait_s", {}))
        self._rollout_counts = {key: self._totals.get(key, 0) + rollout_metrics.get(key, 0) for key in ROLLOUT_TOTALS}
        # (no tensor ops from here: each would give the GIL to the threads the publish woke)
        metrics.update(
            step=self.version,
            reward=rows.mean_reward,
            samples=num_rows,
            tokens=rows.num_tokens,
            step_s=step_s,
            time=self.clock.wall(),
            dropped=dropped,
            **({"filtered_groups": self.stages.filtered_groups(before=self.version)} if cfg.algorithm.filter_groups else {}),
            failed_rewards=stage_metrics["failed_rewards"],
            reward_timeouts=stage_metrics["reward_timeouts"],
            **self._rollout_counts,
            version_gap=gaps,
            wait_s={k: round(v, 4) for k, v in waits.items()},
            response_len=rows.num_tokens / num_rows,
            response_len_max=rows.max_response_len,
            truncated_fraction=rows.num_truncated / num_rows,
            groups=rows.groups,  # the prompts trained: each once per run
            lengths=rows.lengths,  # a length trace `tidal simulate --lengths` replays
            rewards=rows.rewards,  # and the rewards beside them (which groups train)
        )
        self.on_step(metrics)

    def _trainer_turn(self) -> contextlib.AbstractContextManager[Any]:
        """A trainer that time-shares its devices keeps them from a step through its weight pass."""
        return self.trainer.turn_for_step() if isinstance(self.trainer, StepsInTurns) else contextlib.nullcontext()

    def _dtype(self) -> torch.dtype:
        model = self.trainer.model if isinstance(self.trainer, HoldsModel) else None
        return next(model.parameters()).dtype if model is not None else torch.float32

    def _publish(self, version: int) -> None:
        """Hand the new weights to rollout (a snapshot: the trainer keeps changing its own),
        then open admission for the new version: rollout never starts a sample the new
        version admits with older weights."""
        with self.tracer.span("train", "publish weights", version=version):
            self.rollouts.publish(version, self.trainer.named_weights())
        self.version = version
        self.store.set_version(version)  # the loader hears it (a store change)


@dataclasses.dataclass(kw_only=True)
class _TrainRows:
    """A step's rows, taken from the store and made into the tensors the trainer takes,
    with what the step's metrics say of them."""

    indexes: list[int]
    groups: list[Any]
    """The prompts (groups) among them, sorted."""
    tokens: Any
    """`TokenBatch`, rows in index order, as are `advantages`."""
    advantages: torch.Tensor
    row_rewards: torch.Tensor
    """`[rows]` each row's reward, in `tokens`' row order."""
    mean_reward: float
    num_tokens: int
    """Generated tokens (loss tokens, before an overlong filter)."""
    max_response_len: int
    """Generated tokens of the longest response."""
    num_truncated: int
    """Responses cut at the token budget (`finish_reason` "length")."""
    token_versions: dict[int, int]
    """Loss tokens by the version that generated them."""
    dropped: int
    """Rows the sampler dropped as too old while it took these."""
    lengths: list[list[int]]
    """Generated tokens of each response, a list per group (in `groups`' order)."""
    rewards: list[list[float]]
    """Each response's reward, as `lengths`."""
