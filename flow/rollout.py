"""The rollout stage: prompts from the store -> trajectories into the store.

A `RolloutWorker` takes up to `prompts_per_generate` admitted prompts (admission is the
workflow loader's job: a prompt is in the store only once the staleness bound admits
its group), generates `group_size` samples for each, and puts the trajectories into the
`train` partition. New weights wait in its `WeightInbox` and are applied at safe points:
before a generate call, and between decoding chunks, where the generation pauses and
resumes with the new weights (partial rollout; every token keeps the version that
produced it). With continuous batching (`continuous`, the default) a group goes into
`train` as soon as its samples all ended, and admitted prompts join the running generate
call in the rows it freed (`_Refill`, the engine's `refill`).

A worker in hand-off mode (`hand_off=True`: a multiplexed rollout seat on borrowed
training devices) whose generation paused because its seat was reclaimed does not keep
the paused groups: it writes each unfinished group back into `prompts` as a resumable
row (the prompt plus the group's trajectories so far, under `RESUME_KEY`), acking the
rows it took in the same put, and takes new rows only once its seat's turn is back. Any
worker that gets a resumable row continues those trajectories where they stopped, so the
group's generation continues elsewhere (`resumable_prompt` / `group_of`); workers take
resumable rows before fresh prompts (`RESUMED_FIRST`).

The same worker is a thread of the workflow's process under `runtime: local`
(`LocalRollouts`) and the main loop of each rollout actor under `runtime: ray`, where
the inbox is filled by the weight transport's receiver. A rollout actor's worker seeds
each generate call (`sample_seed`, `generation_seed`): what it samples then depends only
on what it generates and with which version, never on what its process sampled before,
so a run resumed from a checkpoint (its actors are new processes) or an actor restarted
after a crash samples what the uninterrupted run did. The local runtime's worker, a
thread of the trainer's process, leaves the process's generators alone (a checkpoint
saves them: `tools.stopping.QuietRollout`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from tidal.flow.clock import REAL, Clock, ClockEvent
from tidal.flow.protocols import Reclaimable, RolloutEngine
from tidal.flow.rows import put_trajectories
from tidal.flow.store.protocol import StoreApi
from tidal.flow.store.samplers import TaggedFirst
from tidal.flow.store.table import StoreTimeout
from tidal.flow.trace import Tracer, Waits
from tidal.flow.trajectory import Trajectory
from tidal.hal import current_platform
from tidal.hal.transfer import snapshot


class Stop(Exception):
    """Raised inside a stage when the workflow is stopping."""


class WeightInbox:
    """The newest published weights a rollout worker has not applied yet (newer replaces older)."""

    def __init__(self, clock: Clock = REAL) -> None:
        self._lock = clock.condition()
        self._item: tuple[int, dict[str, torch.Tensor]] | None = None

    def offer(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if self._item is None or version > self._item[0]:
                self._item = (version, weights)
                self._lock.notify_all()

    def wait(self, version: int, cancel: ClockEvent) -> bool:
        """Wait until weights of `version` or newer are here; False once `cancel` is set
        (whoever sets it calls `wake`)."""
        with self._lock:
            self._lock.wait_for(lambda: cancel.is_set() or (self._item is not None and self._item[0] >= version))
            return not cancel.is_set()

    def wake(self) -> None:
        """Wake a `wait` so it sees its `cancel`."""
        with self._lock:
            self._lock.notify_all()

    @property
    def waiting(self) -> bool:
        return self._item is not None

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self._lock:
            item, self._item = self._item, None
        return item


RESUME_KEY = "resume"
"""The key of a `prompts` row holding a paused group: {"group": the group's id, "samples":
one {"tokens", "logprobs", "versions", "finish_reason"} per trajectory} (msgpack values)."""
RESUMED_FIRST = TaggedFirst(RESUME_KEY)
"""How rollout takes prompts: paused groups (put back tagged `RESUME_KEY`) before fresh
prompts, so their tokens so far do not grow too old to train on while they wait."""


def resumable_prompt(prompt: dict[str, Any], trajectories: list[Trajectory]) -> dict[str, Any]:
    """`prompt` (a `prompts` row) with one group's trajectories so far, to continue elsewhere."""
    samples = [{"tokens": list(t.tokens), "logprobs": list(t.logprobs), "versions": list(t.versions), "finish_reason": t.finish_reason} for t in trajectories]
    return {**prompt, RESUME_KEY: {"group": trajectories[0].group, "samples": samples}}


def group_of(index: int, prompt: dict[str, Any], group_size: int) -> list[Trajectory]:
    """The trajectories of `prompts` row `index`: `group_size` new ones (group `index`), or
    those of a resumable row, with the group id, tokens, logprobs and versions they had."""
    meta = {k: v for k, v in prompt.items() if k not in ("prompt_ids", RESUME_KEY)}
    prompt_ids = list(prompt["prompt_ids"])
    resume = prompt.get(RESUME_KEY)
    if resume is None:
        return [Trajectory(prompt_ids=list(prompt_ids), group=index, meta=meta) for _ in range(group_size)]
    return [
        Trajectory(prompt_ids=list(prompt_ids), group=resume["group"], tokens=list(s["tokens"]), logprobs=list(s["logprobs"]), versions=list(s["versions"]), finish_reason=s["finish_reason"], meta=meta)
        for s in resume["samples"]
    ]


def generation_seed(seed: int, version: int, trajectories: Sequence[Trajectory]) -> int:
    """The seed of one generate call: a function of the run's `seed`, the weights' `version`
    and what the call continues (each trajectory's group and how many tokens it has), so
    the same call samples the same tokens in any process, whatever it sampled before. Two
    calls share it only when they continue the same trajectories from the same lengths
    with the same version: a generation cut off by a stop and done again after a resume,
    or after a rollout actor's restart."""
    key = repr((seed, version, [(t.group, t.num_generated) for t in trajectories])).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # 63 bits: every generator takes it


@dataclasses.dataclass(eq=False)
class _Group:
    """One `prompts` row a worker took: its index, its prompt, its samples, the version that admitted it."""

    index: int
    prompt: dict[str, Any]
    trajectories: list[Trajectory]
    admitted: int | None


class _Refill:
    """A worker's continuous batching (`flow.protocols.Refill`): groups whose samples all ended
    go into `train` as they end, and free rows are filled with the groups of admitted prompts
    that are already in the store (a get that does not wait): a group whose other samples
    ended holds only its stragglers' rows, so a worker may hold more than
    `prompts_per_generate` groups. Rows admitted by a
    version newer than the engine's wait in `groups` for the next generate call, after the
    worker catches up."""

    def __init__(self, worker: RolloutWorker, groups: list[_Group]) -> None:
        self.worker, self.groups = worker, groups
        # Each call looks only at the groups of the rows that ended: a pass over every row
        # at each ending would cost a worker holding many rows the square of their number.
        self._group_of: dict[int, _Group] = {}  # id(trajectory) -> its group
        self._open: dict[int, int] = {}  # id(group) -> its unfinished rows
        self._check: list[_Group] = []  # groups to look at on the next `done` besides those that ended (any already complete)
        self._track(groups)

    def _track(self, groups: list[_Group]) -> None:
        for g in groups:
            self._group_of.update((id(t), g) for t in g.trajectories)
            self._open[id(g)] = sum(not t.done for t in g.trajectories)
            if not self._open[id(g)]:
                self._check.append(g)

    def done(self, trajectories: list[Trajectory]) -> None:
        touched = {id(g): g for g in self._check}
        self._check = []
        for t in trajectories:
            g = self._group_of.get(id(t))
            if g is not None:
                touched[id(g)] = g
        for key, g in touched.items():
            self._open[key] = sum(not t.done for t in g.trajectories)
        complete = [g for key, g in touched.items() if not self._open[key]]
        self.worker._put_finished(self.groups, among=complete)
        for g in complete:
            if g not in self.groups:  # put: forgotten here
                del self._open[id(g)]
                for t in g.trajectories:
                    self._group_of.pop(id(t), None)

    def more(self) -> list[Trajectory]:
        worker = self.worker
        # room in rows, not groups: a group whose other samples ended holds one slot per straggler
        capacity = worker.prompts_per_generate * worker.group_size
        room = capacity - sum(self._open.values())
        # a few rows at a time: each join costs a prefill and a store round trip
        if worker.stopping.is_set() or worker.inbox.waiting or room < max(worker.group_size, capacity // REFILL_PARTS):
            return []
        try:
            batch = worker.store.get(worker.consumer, "prompts", ["prompt"], room // worker.group_size, partial=True, timeout=0, cancel=worker.stopping, sampler=RESUMED_FIRST)
        except StoreTimeout:
            return []
        new = worker._groups_of(batch)
        self.groups += new
        self._track(new)
        version = worker.engine.version
        return [t for g in new if g.admitted is None or g.admitted <= version for t in g.trajectories if not t.done]


REFILL_PARTS = 4
"""Continuous batching asks for new prompts once a `1 / REFILL_PARTS` share of the worker's
rows (`prompts_per_generate` x `group_size`), and at least a group's, is free."""


class RolloutWorker:
    """One rollout engine's loop; `run()` returns only by raising `Stop` (or an engine error)."""

    def __init__(
        self,
        *,
        store: StoreApi,
        engine: RolloutEngine,
        group_size: int,
        max_new_tokens: int,
        prompts_per_generate: int,
        stopping: ClockEvent,
        tracer: Tracer | None = None,
        consumer: str = "rollout",
        hand_off: bool = False,
        sample_seed: int | None = None,
        continuous: bool = True,
        clock: Clock = REAL,
    ) -> None:
        self.store, self.engine = store, engine
        self.group_size, self.max_new_tokens, self.prompts_per_generate = group_size, max_new_tokens, prompts_per_generate
        self.stopping = stopping
        self.tracer = tracer or Tracer()
        self.consumer = consumer
        self.hand_off = hand_off
        """Hand groups paused by a reclaimed seat back to `prompts` (the engine's `reclaimed`)."""
        self.sample_seed = sample_seed
        """The run's seed: each generate call first seeds this process's generators with
        `generation_seed` (a rollout actor's worker). None: they run on from where they are."""
        self.continuous = continuous
        """Continuous batching (`_Refill`): groups go into `train` as they end, and admitted
        prompts join the decoding batch in their place. Not in hand-off mode."""
        self.inbox = WeightInbox(clock)
        self.num_paused = 0
        self.num_handed_off = 0
        """Groups this worker paused and handed back to `prompts` for another worker to continue."""
        self.num_samples = 0
        self.versions_applied: list[int] = []
        self.waits = Waits(clock=clock)

    def run(self) -> None:
        groups: list[_Group] = []  # taken from `prompts`, not yet put into `train` or handed back
        while True:
            if self.stopping.is_set():
                raise Stop
            if not groups:
                with self.waits.waiting("rollout"):
                    batch = self.store.get(self.consumer, "prompts", ["prompt"], self.prompts_per_generate, partial=True, cancel=self.stopping, sampler=RESUMED_FIRST)
                groups = self._groups_of(batch)
            self.apply_weights()  # safe point: before generating (and between decoding chunks)
            self._catch_up([g.admitted for g in groups if g.admitted is not None])
            pending = [t for g in groups for t in g.trajectories if not t.done]
            if self.sample_seed is not None:
                current_platform().seed_all(generation_seed(self.sample_seed, self.engine.version, pending))
            refill = _Refill(self, groups) if self.continuous and not self.hand_off else None
            with self.tracer.span("rollout", "generate", samples=len(pending), version=self.engine.version):
                decoded = self.engine.generate(pending, max_new_tokens=self.max_new_tokens, should_pause=lambda: self.inbox.waiting or self.stopping.is_set(), refill=refill)
            if self.stopping.is_set():
                raise Stop
            self._put_finished(groups)
            if not groups:
                continue
            if any(not t.done for t in decoded):
                self.num_paused += 1
            if self.hand_off and isinstance(self.engine, Reclaimable) and self.engine.reclaimed:
                # the devices went back to training: the unfinished groups continue elsewhere,
                # and this worker takes new rows only once they are back
                self._hand_back(groups)
                groups = []
                self.engine.wait_turn()

    def _groups_of(self, batch: Any) -> list[_Group]:
        return [_Group(index, prompt, group_of(index, prompt, self.group_size), admitted) for index, prompt, admitted in zip(batch.indexes, batch.columns["prompt"], batch.versions)]

    def _put_finished(self, groups: list[_Group], among: list[_Group] | None = None) -> None:
        """Put the groups of `groups` (of `among`, when given: those that may have ended)
        whose every sample ended into `train`, and remove them from `groups`.

        The trajectories go in and their prompts are acked in one step: a worker that dies
        before it gets its prompts redelivered, never after (no sample twice)."""
        finished = [g for g in (groups if among is None else among) if all(t.done for t in g.trajectories)]
        if not finished:
            return
        done = [t for g in finished for t in g.trajectories]
        put_trajectories(self.store, done, cancel=self.stopping, ack=(self.consumer, "prompts", [g.index for g in finished]))
        self.num_samples += len(done)
        groups[:] = [g for g in groups if g not in finished]

    def _hand_back(self, groups: list[_Group]) -> None:
        """Put paused groups back into `prompts` as resumable rows, acking the rows they came
        from in the same step: a worker that dies before the put gets those rows redelivered,
        one that dies after has left the groups in the store for the next worker. Each keeps
        the version that admitted it, or its newest generated token's if newer, so the worker that
        continues it catches up to that version first (`_catch_up`), as for a fresh row."""
        resumable = [resumable_prompt(g.prompt, g.trajectories) for g in groups]
        newest = [max((v for t in g.trajectories for v in t.versions_used[-1:]), default=None) for g in groups]  # generated tokens only: environment tokens are version -1
        versions = [max([v for v in (g.admitted, n) if v is not None], default=None) for g, n in zip(groups, newest)]
        with self.tracer.span("rollout", "hand off", groups=len(groups)):
            self.store.put("prompts", {"prompt": resumable}, versions=versions, tags=[{RESUME_KEY: True}] * len(resumable), cancel=self.stopping, ack=(self.consumer, "prompts", [g.index for g in groups]))
        self.num_handed_off += len(groups)

    def _catch_up(self, admitted: list[int]) -> None:
        """Wait for the newest version that admitted these prompts (the loader tags each
        with it), if the engine is older: a version reaches a remote worker some time after
        `publish` returned and admission opened, and rows generated with older weights
        would be too old to train (dropped at consume time; with `max_staleness: 0`, every
        one of them)."""
        needed = max(admitted, default=None)
        if needed is None or self.engine.version >= needed:
            return
        with self.waits.waiting("weights"):
            while self.engine.version < needed:
                if not self.inbox.wait(needed, self.stopping):
                    raise Stop
                self.apply_weights()

    def stop(self) -> None:
        """Stop the loop at its next check, including a wait for weights or for the store."""
        self.stopping.set()
        self.inbox.wake()
        self.store.wake()  # a get or put waiting on the store ends now (a remote one: withdrawn at the server)

    def apply_weights(self) -> None:
        item = self.inbox.take()
        if item is not None:
            version, weights = item
            with self.tracer.span("rollout", "weight update", version=version):
                self.engine.load_weights(version, weights.items())
            self.versions_applied.append(version)


class RolloutGroup(Protocol):
    """The rollout side of a workflow: local worker threads or remote rollout actors.

    A group whose workers can lose their weights (a rollout actor that restarted) may also
    have `weights_wanted() -> concurrent.futures.Future`, completed when one of them needs
    a version before it can generate: a trainer waiting for rows then publishes its
    current version again (`Workflow._await_rows`)."""

    def run(self) -> None:
        """Run until stopped (raises `Stop`), or raise the first worker's error."""

    def publish(self, version: int, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand `version`'s weights to every worker (applied at its next safe point)."""

    def stop(self) -> None: ...

    def metrics(self) -> dict[str, Any]:
        """`paused_generations`, `handed_off` (groups; both so far) and `wait_s` since the last
        report (remote workers' may come a step late: the trainer does not wait for them)."""


ROLLOUT_TOTALS = ("paused_generations", "handed_off", "silent_rollouts")
"""Rollout's counts in a `RolloutGroup`'s metrics: totals so far (the run's, in `Workflow`'s step
metrics). `silent_rollouts`: times a rollout actor stopped answering (`flow.ray.liveness`; a group
without one leaves it out, 0)."""


class LocalRollouts:
    """`runtime: local`: one worker in this process; weights are handed over as a snapshot.

    `threads` (0: unchanged) sets the torch intra-op threads of the thread that calls
    `run()`, and only of it where torch's intra-op pool is OpenMP (`torch.__config__.
    parallel_info()` says; torch's Linux wheels are built so): each thread has its own
    count there, so the rollout and the trainer, two threads of one process, can use
    different counts (with another backend the count is the process's, and the last one
    set wins).
    """

    def __init__(self, worker: RolloutWorker, *, threads: int = 0) -> None:
        self.worker = worker
        self.threads = threads

    def run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        self.worker.run()

    def publish(self, version: int, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # A snapshot: the trainer keeps changing its own tensors.
        self.worker.inbox.offer(version, dict(snapshot(named_weights)))

    def stop(self) -> None:
        self.worker.stop()

    def metrics(self) -> dict[str, Any]:
        return {"paused_generations": self.worker.num_paused, "handed_off": self.worker.num_handed_off, "wait_s": self.worker.waits.take()}
