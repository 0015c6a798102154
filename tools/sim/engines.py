"""Simulated rollout engines for `tidal simulate`: flow's protocols, with modelled durations
(the trainer's side, `SimTrainEngine` and PPO's critic, is `tools.sim.trainer`).

The real workflow (stages, store, rollout workers) runs on a `VirtualClock`; these engines
do no arithmetic on weights, they only take the time the cost models (`costs`) say the work
would take, on the clock's primitives, so the scheduler around them sees a cluster's timing.

Token scale: one simulated token stands for `token_scale` real ones, so a cluster's worth of
trajectories stays small in memory. Trajectories carry `ceil(real_length / token_scale)`
tokens; every cost is computed in real tokens (one simulated decode step is `token_scale`
real steps, each at the real batch and real context).

Response lengths come with the prompts: a prompt row's `"lengths"` (one per sample, in
simulated tokens, already cut to the budget by whoever made the prompts) reaches every
trajectory of its group as the shared `meta` dict (`flow.rollout.group_of`).

`SimRolloutEngine.generate` is event-driven, not token by token: the running rows decode
in lockstep, so the engine waits (interruptibly) until the first of them would finish,
credits the whole steps that fitted, and hands what ended to `refill`. A step's cost is
`decode_step_s` at the segment's average context, as `costs.generate_s` charges it, so a
generate that is not interrupted takes what `generate_s` says for the same rows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tidal.flow.clock import Clock, ClockEvent
from tidal.flow.protocols import Refill
from tidal.flow.rollout import RolloutWorker, Stop
from tidal.flow.store.errors import StoreError
from tidal.flow.store.protocol import StoreApi
from tidal.flow.trace import Tracer
from tidal.flow.trajectory import Trajectory, unfinished
from tidal.tools.sim import costs
from tidal.tools.sim.costs import DEFAULT_EFFICIENCY, Efficiency, ModelShape
from tidal.tools.sim.hardware import Device

LENGTHS_KEY = "lengths"
"""The prompt row's key (and so its trajectories' `meta` key) holding its group's response lengths."""


class Beside:
    """Which roles are at work now on a host they share, for `Efficiency.train_beside_rollout`
    and `rollout_beside_train`: one role's work goes that many times slower for as long as
    the other role works. `run` re-judges its pace each time the other role starts or stops
    (a training step that starts just before rollout's next generate call slows from
    then on); a stretch of decoding, which an interrupt may cut short, is judged when it
    starts (`factor`): it ends at its first row's end, short beside a step. An engine that
    shares no host has one of its own, where the other role is never at work."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.working = {"train": 0, "rollout": 0}
        self._changed = clock.condition()

    def factor(self, role: str, eff: Efficiency) -> float:
        """How many times its profiled time `role`'s work takes now: `Efficiency.train_in_run`
        (`rollout_in_run`) always, times the slowdown beside the other role while it works."""
        other = "rollout" if role == "train" else "train"
        in_run = eff.train_in_run if role == "train" else eff.rollout_in_run
        if not self.working[other]:
            return in_run
        return in_run * (eff.train_beside_rollout if role == "train" else eff.rollout_beside_train)

    @contextlib.contextmanager
    def work(self, role: str) -> Iterator[None]:
        self._count(role, 1)
        try:
            yield
        finally:
            self._count(role, -1)

    def _count(self, role: str, delta: int) -> None:
        with self._changed:
            self.working[role] += delta
            self._changed.notify_all()

    def run(self, role: str, seconds: float, eff: Efficiency) -> float:
        """Do `seconds` of `role`'s work (its time alone), slower while the other role works;
        the seconds it took."""
        start = self.clock.now()
        with self.work(role), self._changed:
            left = seconds
            while left > 1e-12 * max(1.0, seconds):
                pace = self.factor(role, eff)
                began = self.clock.now()
                self._changed.wait(left * pace)  # woken when either role starts or stops work
                left -= (self.clock.now() - began) / pace
        return self.clock.now() - start


class SimRolloutEngine:
    """A `flow.protocols.RolloutEngine` whose decoding is modelled time (module docstring).

    Args:
        clock: the simulation's clock; every wait is on it.
        model: the policy's shape.
        device: the accelerator of each of the engine's `tp` devices.
        tp: tensor-parallel degree (devices of this engine, on one node).
        eff: efficiency factors of the cost models.
        token_scale: real tokens per simulated token, >= 1.
        max_num_seqs: cap on sequences decoding at once, besides KV capacity.
        name: for thread names and reports.
        beside: the roles at work on the host this engine shares with the trainer, if it
            shares one (its work slows by `eff.rollout_beside_train` beside training).

    Raises:
        ValueError: `token_scale` < 1, or the weights alone do not fit the devices.
    """

    pad_id = 0

    def __init__(
        self,
        *,
        clock: Clock,
        model: ModelShape,
        device: Device,
        tp: int = 1,
        eff: Efficiency = DEFAULT_EFFICIENCY,
        token_scale: int = 1,
        max_num_seqs: int = costs.MAX_NUM_SEQS,
        name: str = "rollout",
        beside: Beside | None = None,
    ) -> None:
        if token_scale < 1 or max_num_seqs < 1:
            raise ValueError(f"token_scale and max_num_seqs must be >= 1, got {token_scale} and {max_num_seqs}")
        costs.max_concurrent_tokens(model, device, tp=tp)  # fail here, not at the first generate, if the model does not fit
        self.clock, self.shape, self.device, self.tp, self.eff = clock, model, device, tp, eff
        self.token_scale, self.max_num_seqs, self.name = token_scale, max_num_seqs, name
        self.beside = beside or Beside(clock)
        self.version = 0
        self._interrupt: ClockEvent = clock.event()
        # Keyed by id(); the object is kept beside it so its id cannot be reused while the entry lives.
        self._targets: dict[int, tuple[Trajectory, int]] = {}
        self._carry: dict[int, int] = {}  # id(row) -> real steps done past its last whole simulated token (the row is in _targets)
        self._groups: dict[int, tuple[dict[str, Any], int]] = {}  # id(meta) -> (meta, samples of it seen so far)
        self.stats: dict[str, float] = {"busy_s": 0.0, "reprefill_s": 0.0, "num_real_tokens": 0, "num_generates": 0, "num_pauses": 0, "max_batch": 0}
        """`busy_s`: virtual seconds spent prefilling or decoding; `reprefill_s`: the share of
        those spent prefilling again the tokens paused rows had generated (partial rollout's
        cost; a share of each prefill by tokens); `num_real_tokens`: real tokens generated;
        `num_generates`: generate calls; `num_pauses`: calls that returned early with
        unfinished rows; `max_batch`: the most sequences one decode step ran."""

    def interrupt(self) -> None:
        """End the current decoding wait now (new weights, a stop): the engine credits the whole
        steps done so far and asks `should_pause`. Consumed by the wait it ends."""
        self._interrupt.set()

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Become `version`; the weights are not materialised (the iterable is only drained)."""
        for _ in named_tensors:
            pass
        self.version = version

    def generate(
        self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None, refill: Refill | None = None
    ) -> list[Trajectory]:
        """See `RolloutEngine.generate`: continuous batching with `refill`, pauses at safe points.

        Returns:
            `trajectories` followed by the rows `refill.more()` added.

        Raises:
            ValueError: a row's `meta` has no `"lengths"`, or as `flow.trajectory.unfinished`.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.stats["num_generates"] += 1
        if self.eff.generate_call_overhead_s > 0:  # the call's own work, beside its prefills and decode steps
            self.stats["busy_s"] += self.beside.run("rollout", self.eff.generate_call_overhead_s, self.eff)
        rows = list(trajectories)
        seen: set[int] = set()
        goals: dict[int, int] = {}  # id(row) -> generated tokens it ends at, in this call
        left: dict[int, int] = {}  # id(row) -> real decode steps until its goal, when it joins
        waiting: collections.deque[Trajectory] = collections.deque()
        batch = _Batch(self.version)
        ended = self._admit(rows, max_new_tokens=max_new_tokens, seen=seen, goals=goals, left=left, waiting=waiting)
        slots = 0
        decoded = False
        try:
            while True:
                if ended and refill is not None:
                    refill.done(ended)
                    new = refill.more()
                    rows += new
                    ended = self._admit(new, max_new_tokens=max_new_tokens, seen=seen, goals=goals, left=left, waiting=waiting)
                    if ended:
                        continue  # rows given at their budget: hand them back before anything else
                ended = []
                if not batch.running and not waiting:
                    break
                if decoded and should_pause is not None and should_pause():
                    self.stats["num_pauses"] += 1
                    break
                slots = slots or self._slots(waiting, max_new_tokens)
                self._join(batch, waiting, slots, left)
                ended = self._decode(batch, goals, max_new_tokens)
                decoded = True
        finally:
            for row in batch.running.values():  # paused: their tokens so far, and the steps past the last whole one
                self._credit(row, batch.steps, batch.version)
        return rows

    # One generate call's steps ----------------------------------------------------------
    def _admit(self, rows: list[Trajectory], *, max_new_tokens: int, seen: set[int], goals: dict[int, int], left: dict[int, int], waiting: collections.deque[Trajectory]) -> list[Trajectory]:
        """Queue the unfinished ones of `rows` with their targets; return those that ended on
        the way in (already at the budget)."""
        was_open = [t for t in rows if not t.done]
        active = unfinished(rows, max_new_tokens, seen)
        for t in active:
            generated = t.num_generated
            goals[id(t)] = min(max(self._target(t), generated + 1), max_new_tokens)
            left[id(t)] = (goals[id(t)] - generated) * self.token_scale - self._carry.get(id(t), 0)
        waiting.extend(active)
        return [t for t in was_open if t.done]

    def _target(self, t: Trajectory) -> int:
        """The length `t` was assigned (on first sight: the next of its group's `lengths`)."""
        known = self._targets.get(id(t))
        if known is not None and known[0] is t:
            return known[1]
        lengths = t.meta.get(LENGTHS_KEY)
        if not lengths:
            raise ValueError(f"a simulated rollout needs each prompt's response lengths: meta[{LENGTHS_KEY!r}] is {lengths!r}")
        entry = self._groups.get(id(t.meta))
        j = entry[1] if entry is not None and entry[0] is t.meta else 0
        target = int(lengths[j % len(lengths)])
        if j + 1 >= len(lengths):
            # j % len starts over at 0 after a full group: dropping the counter is the same, and bounds memory
            self._groups.pop(id(t.meta), None)
        else:
            self._groups[id(t.meta)] = (t.meta, j + 1)
        self._targets[id(t)] = (t, target)
        return target

    def _slots(self, rows: Iterable[Trajectory], max_new_tokens: int) -> int:
        """Sequences that fit the KV cache at once: real prompt (mean) + real budget each."""
        prompts = [len(t.prompt_ids) for t in rows]
        prompt = sum(prompts) / max(len(prompts), 1)
        per_sequence = (prompt + max_new_tokens) * self.token_scale
        return costs.decode_slots(self.shape, self.device, tp=self.tp, tokens_per_sequence=per_sequence, max_num_seqs=self.max_num_seqs)

    def _join(self, batch: _Batch, waiting: collections.deque[Trajectory], slots: int, left: dict[int, int]) -> None:
        """Move waiting rows into free slots and sleep their prefill."""
        joining: list[Trajectory] = []
        while waiting and len(batch.running) + len(joining) < slots:
            joining.append(waiting.popleft())
        for t in joining:
            carry = self._carry.pop(id(t), 0)
            batch.add(t, context=(len(t.prompt_ids) + len(t.tokens)) * self.token_scale + carry, carry=carry, steps_left=left[id(t)])
        # A group's samples of one input share its prefill (prefix caching; hf_rollout prefills
        # distinct inputs once). A resumed row recomputes its generated tokens' KV too.
        distinct = {(id(t.meta), tuple(t.ids)): len(t.tokens) for t in joining}
        tokens = sum(len(ids) for _, ids in distinct) * self.token_scale
        seconds = costs.prefill_s(self.shape, self.device, tp=self.tp, tokens=tokens, eff=self.eff)
        if seconds > 0:
            seconds = self.beside.run("rollout", seconds, self.eff)
            self.stats["busy_s"] += seconds
            resumed = sum(len(ids) for (_, ids), generated in distinct.items() if generated)
            self.stats["reprefill_s"] += seconds * resumed * self.token_scale / tokens  # resumed rows' share (prompt included: its KV went too)

    def _decode(self, batch: _Batch, goals: dict[int, int], max_new_tokens: int) -> list[Trajectory]:
        """Decode until the first running row ends or an interrupt; count the real steps
        done, finish the rows at their goal and take them out of `batch`; return those.

        The running rows decode in lockstep, so `batch` counts the call's real steps once
        and each row's progress is the steps since it joined: a step costs O(log rows),
        not a pass over every row, and a row's tokens are written when it ends or the call
        returns (`_credit`). Progress is in real decode steps: a row keeps the real steps
        past its last whole simulated token (`_carry`), so an interrupt loses only the
        real step in flight, as a real engine would, not up to a simulated token's
        `token_scale` steps.
        """
        num_real = batch.next_end() - batch.steps
        assert num_real >= 1, "a running row is at its goal"
        size = len(batch.running)
        # Average real context over the segment's steps, as costs.generate_s charges it.
        average = batch.context() + size * (num_real - 1) / 2
        step_s = costs.decode_step_s(self.shape, self.device, tp=self.tp, batch=size, context_tokens=math.ceil(average), eff=self.eff) * self.beside.factor("rollout", self.eff)
        start = self.clock.now()
        with self.beside.work("rollout"):
            interrupted = self._interrupt.wait(num_real * step_s)
        elapsed = self.clock.now() - start
        self.stats["busy_s"] += elapsed
        self.stats["max_batch"] = max(self.stats["max_batch"], size)
        done = num_real
        if interrupted:
            self._interrupt.clear()
            done = min(num_real, math.floor(elapsed / step_s + 1e-9))  # the step in flight is lost
        if self.version != batch.version:  # a segment's tokens carry the version at its end: write the earlier ones first
            for row in batch.running.values():
                self._credit(row, batch.steps, batch.version)
                batch.rebase(row, self._carry.pop(id(row.trajectory), 0))
            batch.version = self.version
        batch.steps += done
        self.stats["num_real_tokens"] += done * size
        ended = []
        for row in batch.pop_ended():
            t = row.trajectory
            self._credit(row, batch.steps, batch.version)
            t.finish_reason = "length" if goals[id(t)] >= max_new_tokens else "stop"
            del self._targets[id(t)]
            self._carry.pop(id(t), None)
            ended.append(t)
        return ended

    def _credit(self, row: _Row, steps: int, version: int) -> None:
        """Write the simulated tokens of the real steps `row` did since it joined, made by
        `version`, and keep the steps past the last whole one in `_carry`."""
        whole, carry = divmod(row.carry + steps - row.joined, self.token_scale)
        if whole:
            row.trajectory.extend([1] * whole, [-1.0] * whole, version)
        if carry:
            self._carry[id(row.trajectory)] = carry


@dataclasses.dataclass(slots=True)
class _Row:
    """A row in a generate call's running batch."""

    trajectory: Trajectory
    joined: int  # the call's real steps when it joined
    carry: int  # its real steps past its last whole simulated token then
    context: int  # its real context then (prompt, generated tokens and carry)
    end: int  # the call's real steps when it reaches its goal


class _Batch:
    """The running rows of one generate call, decoding in lockstep: `steps` real steps
    since the call began; rows by join order, and a heap of when each ends."""

    def __init__(self, version: int) -> None:
        self.steps = 0
        self.version = version
        """The engine's version at the end of the last decoding segment: the one that made
        the rows' tokens not yet written."""
        self.running: dict[int, _Row] = {}  # join number -> row, in join order
        self._ends: list[tuple[int, int]] = []  # (end, join number)
        self._joins = 0
        self._context = 0  # sum over running rows of (context - joined): `context()` adds steps x rows

    def add(self, t: Trajectory, *, context: int, carry: int, steps_left: int) -> None:
        row = _Row(t, self.steps, carry, context, self.steps + steps_left)
        self.running[self._joins] = row
        heapq.heappush(self._ends, (row.end, self._joins))
        self._joins += 1
        self._context += context - row.joined

    def rebase(self, row: _Row, carry: int) -> None:
        """`row` with its tokens written up to now: it counts as joining now with `carry`."""
        self._context -= row.context - row.joined
        row.context += self.steps - row.joined
        row.joined, row.carry = self.steps, carry
        self._context += row.context - row.joined

    def next_end(self) -> int:
        return self._ends[0][0]

    def context(self) -> int:
        """The running rows' real context now, all together."""
        return self._context + len(self.running) * self.steps

    def pop_ended(self) -> list[_Row]:
        """The rows at their goal by now, taken out, in join order."""
        ended: list[int] = []
        while self._ends and self._ends[0][0] <= self.steps:
            ended.append(heapq.heappop(self._ends)[1])
        rows = []
        for k in sorted(ended):
            row = self.running.pop(k)
            self._context -= row.context - row.joined
            rows.append(row)
        return rows


class SimRollouts:
    """A `flow.rollout.RolloutGroup` of real `RolloutWorker`s, each with a `SimRolloutEngine`,
    whose weight syncs are modelled time.

    A publish costs the trainer `send_s` (its export and first hop, slept in its thread);
    every worker gets the version `deliver_s` after that, from a clock thread started per
    publish (deterministic: deliveries happen in publish order, by virtual time).

    Args:
        clock: the simulation's clock.
        store: the run's store (made on the same clock).
        engines: one simulated engine per worker (or a `SharedRolloutEngine` seating one).
        group_size: samples per prompt.
        max_new_tokens: the response budget, in simulated tokens.
        prompts_per_generate: prompts a worker takes per generate call.
        send_s: seconds a publish holds the trainer.
        deliver_s: seconds from the end of `send_s` until the workers have the weights.
        tracer: where the workers' spans go (default: a new one on `clock`).
        hand_off: per engine, whether its worker runs in hand-off mode (a borrowed seat:
            `RolloutWorker(hand_off=True)`); default none.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        store: StoreApi,
        engines: Sequence[Any],
        group_size: int,
        max_new_tokens: int,
        prompts_per_generate: int,
        send_s: float = 0.0,
        deliver_s: float = 0.0,
        tracer: Tracer | None = None,
        hand_off: Sequence[bool] = (),
    ) -> None:
        if not engines:
            raise ValueError("SimRollouts needs at least one engine")
        if send_s < 0 or deliver_s < 0:
            raise ValueError(f"send_s and deliver_s must be >= 0, got {send_s} and {deliver_s}")
        self.clock, self.engines, self.send_s, self.deliver_s = clock, list(engines), send_s, deliver_s
        self.tracer = tracer or Tracer(clock=clock)
        self.stopping = clock.event()
        self.workers = [
            RolloutWorker(
                store=store,
                engine=engine,
                group_size=group_size,
                max_new_tokens=max_new_tokens,
                prompts_per_generate=prompts_per_generate,
                stopping=self.stopping,
                tracer=self.tracer,
                continuous=True,
                clock=clock,
                hand_off=k < len(hand_off) and hand_off[k],
            )
            for k, engine in enumerate(self.engines)
        ]

    def run(self) -> None:
        """Run every worker until stopped (raises `Stop`), or raise the first worker's error."""
        errors: list[Exception] = []

        def work(worker: RolloutWorker) -> None:
            try:
                worker.run()
            except (Stop, StoreError) as e:
                # a store wait cancelled by the stop is the normal way out (as flow.stages.guard)
                if not self.stopping.is_set():
                    errors.append(e)
                    self.stop()
            except Exception as e:  # noqa: BLE001  # re-raised by run() once every worker stopped
                errors.append(e)
                self.stop()

        threads = [self.clock.thread(work, args=(w,), name=f"tidal-sim-{e.name}-{i}") for i, (w, e) in enumerate(zip(self.workers, self.engines))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        raise Stop

    def publish(self, version: int, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hold the caller `send_s`, then deliver `version` to every worker `deliver_s` later."""
        if self.send_s > 0:
            self.clock.sleep(self.send_s)
        thread = self.clock.thread(self._deliver, args=(version,), name=f"tidal-sim-weights-{version}")
        thread.start()

    def _deliver(self, version: int) -> None:
        if self.deliver_s > 0:
            self.clock.sleep(self.deliver_s)
        for worker, engine in zip(self.workers, self.engines):
            worker.inbox.offer(version, {})
            engine.interrupt()  # a running generate reaches its safe point now, not at its next finish

    def stop(self) -> None:
        self.stopping.set()
        for worker, engine in zip(self.workers, self.engines):
            worker.stop()
            engine.interrupt()

    def metrics(self) -> dict[str, Any]:
        """As `LocalRollouts.metrics`, summed over workers; `wait_s` their mean (as Ray's group)."""
        wait_s: dict[str, float] = collections.defaultdict(float)
        for worker in self.workers:
            for stage, seconds in worker.waits.take().items():
                wait_s[stage] += seconds / len(self.workers)
        return {
            "paused_generations": sum(w.num_paused for w in self.workers),
            "handed_off": sum(w.num_handed_off for w in self.workers),
            "wait_s": dict(wait_s),
        }
