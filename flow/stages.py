"""The stages around the trainer: the loader (admission control), reward and advantage.

They talk to the rollout stage and the trainer only through the store, as threads of the
process that holds it. The trainer's side of the loop is `Workflow`, which starts, stops
and watches them; a checkpoint saves the store through them (`Stages.save`: the store, the
position of the prompts it holds and the failed rewards' count taken together, so a resumed
run neither skips nor repeats a prompt, and counts each failed reward once).

The loader takes prompts from the source outside the lock a save takes, so a source that
takes its time, or blocks for good, holds up no checkpoint: prompts taken but not yet in
the store are not in the saved position (a resumed run draws them again). A stop ends the
loader cleanly whatever the source does meanwhile (it ends, or it blocks: the stages end
without the loader then, `SOURCE_ON_STOP_S`).

    prompts --put--> [prompts]                         (the loader, while admission allows)
    reward   <-get tokens--   --put reward--> [train]
    advantage<-get complete groups with reward-- --put advantage--> [train]

Admission (AReaL's bound): a group may start only if, its samples counted as started,
`started - dropped - filtered <= (max_staleness + version + 1) * batch_size`, where
`version` is the store's (the trainer sets it with each new version), `dropped` counts the
rows the trainer's sampler found too old and `filtered` those the advantage stage left out
(`algorithm.filter_groups`: groups without signal, acked for the trainer, which never sees
them). The loader wakes when any of them changes.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.flow.algorithms import compute_advantages, overlong_penalty, silent_groups
from tidal.flow.clock import REAL, Clock, ClockEvent, ClockThread
from tidal.flow.protocols import Positioned
from tidal.flow.rollout import Stop as _Stop
from tidal.flow.rows import TRAJECTORY_COLUMNS, trajectories_of
from tidal.flow.store import Grouped, Store, StoreError, persist
from tidal.flow.trace import Tracer, Waits
from tidal.flow.trajectory import Trajectory

SOURCE_ON_STOP_S = 5.0
"""How long the stages' end after a stop waits for a take from the prompt source to finish
(its prompts then go into the store, and into the stopped run's checkpoint); a source
still blocked after that is left to its thread, whose take is then not put."""


def guard(stage: Callable[[], None], *, stopping: ClockEvent, errors: list[BaseException], stop: Callable[[], None]) -> None:
    """Run one stage of the loop (a thread's body): its error goes to `errors` and stops the
    loop (`stop`); a store that ends its wait because the loop is `stopping` is the normal way out."""
    try:
        stage()
    except (_Stop, StoreError) as e:
        if not stopping.is_set():
            lost = RuntimeError(f"stage {stage.__name__.lstrip('_')} lost its store" + (f": {e}" if str(e) else ""))
            lost.__cause__ = e
            errors.append(lost)
            stop()
    except BaseException as e:  # noqa: BLE001 - the loop's owner re-raises it
        errors.append(e)
        stop()


def _position_of(prompts: Iterable[dict[str, Any]]) -> Any:
    """Where a prompt source is now (`Positioned`), what `save` records; None for a plain iterable."""
    return prompts.position if isinstance(prompts, Positioned) else None


class Stages:
    """The loader, reward and advantage stages of a run, as threads over `store`.

    Args:
        store: the run's store (in this process); the partitions are created here.
        prompts: prompt dicts with "prompt_ids" (list[int]) and any other keys (kept in
            each trajectory's `meta`); an iterable with a `position` (tools' `Prompts`)
            lets `save` record where it is.
        score: scores finished trajectories: (rewards, indexes of failed rows), or
            (rewards, failed, how many of the failed timed out).
        config: the run's `WorkflowConfig`.
        version: the policy version the run starts at (set on the store).
        num_failed_rewards: rows whose reward failed before this attempt (a resumed run's
            checkpoint): the count is the run's, whatever resumes it went through.
        num_reward_timeouts: rows whose reward timed out before this attempt (likewise).
        clock: what the stages wait on and start their threads with (a simulation's
            virtual clock; the real one by default).
    """

    def __init__(
        self,
        *,
        store: Store,
        prompts: Iterable[dict[str, Any]],
        score: Callable[[Sequence[Trajectory]], tuple[Any, ...]],
        config: Any,
        version: int,
        tracer: Tracer | None = None,
        num_failed_rewards: int = 0,
        num_reward_timeouts: int = 0,
        clock: Clock = REAL,
    ) -> None:
        self.store, self.prompts, self.score, self.config = store, prompts, score, config
        self._clock = clock
        self._prompt_iter = iter(prompts)
        self.tracer = tracer or Tracer()
        store.set_version(version)
        existing = store.metrics()["partitions"]
        for name, consumers in (("prompts", ["rollout"]), ("train", ["reward", "advantage", "train"])):
            capacity = 2 * config.batch_size * (config.algorithm.max_staleness + 2) if name == "train" else config.algorithm.prompts_per_step * (config.algorithm.max_staleness + 2)
            capacity = max(capacity, config.batch_size)
            if name not in existing:
                store.create_partition(name, consumers=consumers, capacity_rows=capacity, lease_s=config.lease_s)
            else:  # a restored store: this run's step size and lease (its rows stay as they were)
                store.configure_partition(name, capacity_rows=max(capacity, existing[name]["rows"]), lease_s=config.lease_s)
        self._admission = clock.event()  # set when the trainer's sampler drops rows or the version changes
        self._stopping = clock.event()
        self._loading = threading.Lock()  # held while prompts taken from the source go into the store
        self._position = _position_of(prompts)
        """The source's position after the prompts the store holds (what `save` records)."""
        self._abandoned = False
        """Set when the stages ended without the loader (blocked in the source): its take is not put."""
        self._scoring = threading.Lock()  # held while rewards and their failures are counted and put, and groups left out acked
        self._dropped_seen = self._dropped()
        self._version_seen = version
        store.add_change_listener(self._on_store_change)
        # Samples started: every earlier step's (as if in time), the dropped ones, and those a
        # restored store holds in flight (prompts not yet generated, samples not yet trained).
        self._started = version * config.batch_size + self._dropped_seen + self._in_flight()
        self._waits = Waits(clock=clock)
        self._num_failed_rewards = num_failed_rewards
        self._num_reward_timeouts = num_reward_timeouts
        self._filtered = 0
        """Samples the advantage stage left out in this process (`algorithm.filter_groups`);
        a restored store holds none of the earlier ones, which `_started` does not count."""
        self._filtered_groups: collections.Counter[int] = collections.Counter()
        """Groups left out and not yet reported (`filtered_groups`), by the oldest version
        that generated a row of theirs."""
        self._filtered_in_a_row = 0
        self._threads: dict[str, ClockThread] = {}
        self._errors: list[BaseException] = []

    # Control ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the stages (threads; they run until `stop`)."""
        for name, fn in (("loader", self._loader), ("reward", self._reward_stage), ("advantage", self._advantage_stage)):
            thread = self._clock.thread(self._guard, args=(fn,), name=f"tidal-{name}")
            thread.start()
            self._threads[name] = thread

    def wait(self) -> None:
        """Block until the stages have ended, or until one of them fails: raise its error at
        once, without waiting for the others (one may be inside a long score call). A loader
        still taking prompts from the source `SOURCE_ON_STOP_S` after the stop is left
        behind (a daemon thread), its take not put: a source may block for good."""
        self._stopping.wait()  # a stage ends only once the stages stop: `stop`, or a stage's error
        if not self._errors:
            for name, thread in self._threads.items():
                thread.join(SOURCE_ON_STOP_S if name == "loader" else None)
            if self._threads.get("loader") is not None and self._threads["loader"].is_alive():  # still in the source
                with self._loading:  # not in the middle of a put
                    self._abandoned = True
        if self._errors:
            raise self._errors[0]

    def stop(self) -> None:
        """Ask the stages to end (at once: their waits in the store are cancelled); the store
        stops calling them (it may outlive this run)."""
        self._stopping.set()
        self._admission.set()
        self.store.remove_listener(self._on_store_change)
        self.store.wake()

    def metrics(self) -> dict[str, Any]:
        """{"failed_rewards": rows whose reward failed in the run so far, "reward_timeouts":
        those of them that timed out, "wait_s": {stage: seconds waited since the last call}}:
        a wait still going on counts its seconds so far."""
        return {"failed_rewards": self._num_failed_rewards, "reward_timeouts": self._num_reward_timeouts, "wait_s": self._waits.take()}

    def filtered_groups(self, before: int) -> int:
        """Groups left out (`algorithm.filter_groups`) that were generated by versions older
        than `before` and not counted by an earlier call. Keyed by version, not by time, a
        step's count does not depend on whether the next step's groups were scored first."""
        with self._scoring:
            done = [v for v in self._filtered_groups if v < before]
            return sum(self._filtered_groups.pop(v) for v in done)

    def save(self, path: str | Path) -> dict[str, Any]:
        """Save the store to `path` (`persist.save`) with no prompt put and no reward counted
        but not in it; return what goes with that store: {"prompt_position": the source's
        position after the prompts in it (None: the source has none), "failed_rewards" and
        "reward_timeouts": the run's counts}. A resumed run neither skips a prompt nor counts a failed reward twice.
        Prompts the loader is taking from the source meanwhile are in neither (the save does
        not wait for the source)."""
        with self._loading, self._scoring:
            persist.save(self.store, path)
            return {"prompt_position": self._position, "failed_rewards": self._num_failed_rewards, "reward_timeouts": self._num_reward_timeouts}

    # Internals ----------------------------------------------------------------------------
    def _guard(self, stage: Callable[[], None]) -> None:
        guard(stage, stopping=self._stopping, errors=self._errors, stop=self.stop)

    def _dropped(self) -> int:
        return self.store.consumer_counts("train", "train")["dropped"]

    def _in_flight(self) -> int:
        """Samples in the store that no step has trained or dropped yet: a group's worth for
        each prompt row rollout has not acked (fresh, or a paused group handed back), and
        each sample row the trainer has not acked. 0 in a new store."""
        partitions = self.store.metrics()["partitions"]

        def unacked(partition: str, consumer: str) -> int:
            p = partitions[partition]
            return p["rows"] + p["evicted"] - p["consumers"][consumer]["acked"]

        return self.config.algorithm.group_size * unacked("prompts", "rollout") + unacked("train", "train")

    def _on_store_change(self, partition: str | None) -> None:
        """Store listener (store lock held): rows the trainer's sampler dropped free room
        for more prompts, and so does a new version."""
        if partition not in (None, "train"):
            return
        dropped = self._dropped()
        version = self.store.version if partition is None else self._version_seen
        if dropped != self._dropped_seen or version != self._version_seen:
            self._dropped_seen, self._version_seen = dropped, version
            self._admission.set()

    def _check(self) -> None:
        if self._stopping.is_set():
            raise _Stop

    def _get(self, stage: str, *args: Any, **kwargs: Any) -> Any:
        """A store get that ends when the stages stop, and counts the wait (`metrics` takes
        the part of it before each step's report)."""
        with self._waits.waiting(stage):
            return self.store.get(*args, cancel=self._stopping, **kwargs)

    def _loader(self) -> None:
        """Admission control: put prompts only while the staleness bound admits their groups.

        All prompts admitted at once go in one put, so a rollout worker's batches do not
        depend on timing.
        """
        ran_out = False
        while True:
            self._admission.clear()
            version = self.store.version  # read once: the prompts are tagged with the version whose room admitted them
            allowed = 0 if ran_out else self._admitted(version)
            if allowed:
                self._check()  # before the take, not after: prompts taken from the source go into the store
                prompts = list(itertools.islice(self._prompt_iter, allowed))  # outside `_loading`: a source may block
                if prompts:
                    self._put_prompts(prompts, version, position=_position_of(self.prompts))
                    continue
                ran_out = True
            self._check()  # first: a stopped run ends cleanly, even as its source runs out
            if ran_out:
                self._check_enough()
            self._admission.wait()

    def _put_prompts(self, prompts: list[dict[str, Any]], version: int, *, position: int | None) -> None:
        """Put a take from the source into the store, and count it in `_position` (the
        source's `position` after it) and `_started`; a take the stages ended without
        (`wait`) is not put. A put that a stop cancels while it waits for room counts nothing."""
        with self._loading:
            if self._abandoned:
                raise _Stop
            # each prompt carries the version that admitted it: rollout generates it with no older weights
            self.store.put("prompts", {"prompt": prompts}, versions=[version] * len(prompts), cancel=self._stopping)  # waits for room (back-pressure)
            self._position = position
            self._started += len(prompts) * self.config.algorithm.group_size

    def _check_enough(self) -> None:
        """With the prompt source used up: raise if the samples started, less those dropped,
        can no longer fill the run's steps (the trainer would wait for them forever)."""
        cfg, dropped = self.config, self._dropped()
        if self._started - dropped - self._filtered < cfg.algorithm.num_steps * cfg.batch_size:
            filtered = f", {self._filtered // cfg.algorithm.group_size} groups left out without signal (algorithm.filter_groups)" if self._filtered else ""
            raise RuntimeError(
                f"the prompt source ran out: {cfg.algorithm.num_steps} steps of {cfg.algorithm.prompts_per_step} prompts need {cfg.algorithm.num_steps * cfg.algorithm.prompts_per_step} groups, "
                f"and {self._started // cfg.algorithm.group_size} started, {dropped} samples of them dropped as too stale{filtered}; give more prompts (or a source that repeats), or fewer steps"
            )

    def _admitted(self, version: int) -> int:
        """How many more groups may start at `version` (AReaL's staleness bound)."""
        cfg = self.config
        room = (cfg.algorithm.max_staleness + version + 1) * cfg.batch_size - (self._started - self._dropped() - self._filtered)
        return max(room // cfg.algorithm.group_size, 0)

    def _reward_stage(self) -> None:
        while True:  # every row that is ready, up to a step's worth
            batch = self._get("reward", "reward", "train", [*TRAJECTORY_COLUMNS, "meta"], self.config.batch_size, partial=True)
            trajectories = trajectories_of(batch)
            with self.tracer.span("reward", "reward", rows=len(trajectories)):
                rewards, failed, *timeouts = self.score(trajectories)  # a score may leave out its timeout count
                if self.config.algorithm.overlong == "penalty":  # DAPO's soft overlong punishment, on top of the verifier's reward
                    cfg = self.config
                    rewards = [r + overlong_penalty(t.num_generated, max_tokens=cfg.rollout.max_new_tokens, buffer=cfg.algorithm.overlong_buffer) for r, t in zip(rewards, trajectories)]
            with self._scoring:  # counted and in the store together, as a checkpoint saves them (`save`)
                self._num_failed_rewards += len(failed)
                self._num_reward_timeouts += timeouts[0] if timeouts else 0
                self.store.put("train", {"reward": torch.tensor(rewards, dtype=torch.float32)}, batch.indexes, ack=("reward", "train", batch.indexes))

    def _advantage_stage(self) -> None:
        cfg = self.config
        while True:  # every complete group that is ready, up to a step's worth, in one call
            batch = self._get("advantage", "advantage", "train", ["reward"], cfg.batch_size, sampler=Grouped(cfg.algorithm.group_size), partial=True)
            with self.tracer.span("advantage", "advantage", rows=len(batch)):
                rewards = batch.stack("reward").to(torch.float32)
                advantages = compute_advantages(cfg.algorithm.advantage, rewards, batch.groups)
                silent = silent_groups(rewards, batch.groups).tolist() if cfg.algorithm.filter_groups else []
            if any(silent):
                self._leave_out(batch.indexes, batch.groups, batch.versions, advantages, silent, rewards)
            else:
                self._filtered_in_a_row = 0
                self.store.put("train", {"advantage": advantages}, batch.indexes, ack=("advantage", "train", batch.indexes))

    def _leave_out(self, indexes: list[int], groups: list[Any], versions: list[int | None], advantages: torch.Tensor, silent: list[bool], rewards: torch.Tensor) -> None:
        """Dynamic sampling: the rows of groups without signal (`silent`) get no advantage and
        are acked for the trainer, which so never sees them; the others get theirs. Admission
        counts the rows left out as it counts dropped ones, so prompts start in their place.

        Raises:
            RuntimeError: when more groups than `algorithm.max_filtered_in_a_row` were left
                out one after another (no prompt is solved by some samples and not others).
        """
        cfg = self.config.algorithm
        kept = [i for i, s in zip(indexes, silent) if not s]
        left = [i for i, s in zip(indexes, silent) if s]
        oldest: dict[Any, int] = {}  # each left-out group's oldest version
        for g, v, s in zip(groups, versions, silent):
            if s:
                v = -1 if v is None else v  # a row put without a version (never by rollout)
                oldest[g] = min(oldest.get(g, v), v)
        num_groups = len(oldest)
        with self._scoring:  # a checkpoint saves both halves or neither (a left-out row without its ack would wait for an advantage forever)
            if kept:
                self.store.put("train", {"advantage": advantages[[not s for s in silent]]}, kept, ack=("advantage", "train", indexes))
            else:
                self.store.ack("advantage", "train", indexes)
            self.store.ack("train", "train", left)
            self._filtered += len(left)
            self._filtered_groups.update(oldest.values())
        self._admission.set()
        self._filtered_in_a_row = 0 if kept else self._filtered_in_a_row + num_groups
        if self._filtered_in_a_row > cfg.filtered_limit:
            example = sorted({round(float(r), 6) for r, s in zip(rewards.tolist(), silent) if s})
            raise RuntimeError(
                f"algorithm.filter_groups left out {self._filtered_in_a_row} groups in a row, each with one reward for all its samples (rewards seen: {example[:5]}), "
                f"more than algorithm.max_filtered_in_a_row={cfg.filtered_limit}: the model solves every prompt or none, or the reward (task.reward) gives one value; "
                "check the reward and the data, or raise the limit"
            )
