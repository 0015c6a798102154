"""`tidal simulate`: the real workflow, store and placement on a virtual clock.

A recipe's run is rebuilt with simulated engines (`tools.sim.engines`) whose durations
come from the cost models (`tools.sim.costs`), on the devices `flow.placement.schedule`
gives each role on a cluster spec (`tools.sim.cluster`). The loop itself is the product's
own: `flow.workflow.Workflow`, its loader with admission control, the reward and
advantage stages, the staleness filter and the store, all waiting on a
`flow.virtual_clock.VirtualClock`. Nothing of the scheduling is re-implemented here, so
what the simulation says of staleness, pauses and idle time is what the code does.

Assumptions (docs/simulate.md states them for users):
- one simulated token stands for `token_scale` real ones (memory stays small at scale;
  costs are computed in real tokens);
- rewards are a run's recorded ones (`Workload.replay_rewards`), else 1 and 0 in turn
  within each group, so that every group has an advantage, but for a share of flat groups
  (`Workload.flat_groups`, 0 by default); they take `Workload.reward_s` a
  sample (0 by default: free), a batch's samples side by side on the recipe's reward
  workers, and the loop's own work `Workload.stage_s` a batch (0 by default);
- the trainer skips the rows of a group whose samples all got one reward, as the real
  engines do (no advantage, no KL or entropy term);
- the trainer is one data-parallel group over every `placement.train` device; its step is
  `costs.train_step_s` over the tokens its busiest rank computes times the ranks
  (`costs.step_tokens`: each rank the engines' token-even share of the rows, cut into micro-batches as
  the recipe's train engine cuts them, padded or padding-free, `train_shape`);
- weights go over the transport the recipe names (`auto`: collective between devices of
  one kind, host between kinds): the trainer spends the send, each rollout instance gets
  the version once the transfer is done (`costs.weight_sync_s`);
- every layout is simulated. Where rollout time-shares the trainer's devices (colocated,
  hybrid, multiplexed): the real `flow.timeshare` turns, on the clock, one arbiter per
  trainer instance; the trainer takes every one of them for each call (as rank 0 of a
  multi-rank trainer does) and its guests their own; a borrowed (multiplexed) instance's
  worker hands its paused groups back to the store, as under Ray; a seat parks when
  another wants its devices, moving its state over each device's PCIe link
  (`costs.park_s`): the trainer `costs.TRAIN_STATE_BYTES_PER_PARAM` per parameter over its
  devices, a rollout engine its weights over its tensor-parallel devices (vLLM's sleep
  drops its KV cache rather than moving it). Each instance's weights go over the transport
  the runtime would pick for it, and every instance gets a version once the slowest has.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from tidal.flow.algorithms import VALUE_BASED
from tidal.flow.placement import PlacementError, Plan, schedule
from tidal.flow.store import Store
from tidal.flow.timeshare import Seat, SharedCritic, SharedRolloutEngine, SharedTrainEngine
from tidal.flow.trace import Tracer
from tidal.flow.turns import Turns, TurnsSpan
from tidal.flow.virtual_clock import VirtualClock
from tidal.flow.workflow import Workflow, WorkflowConfig
from tidal.hal.platform import describe
from tidal.hal.transfer import choose_transport
from tidal.tools.config import ConfigError, RecipeConfig, Runtime, TrainConfig
from tidal.tools.plan import roles_of
from tidal.tools.rl import reward_workers
from tidal.tools.sim import costs
from tidal.tools.sim.cluster import ClusterSpec
from tidal.tools.sim.engines import LENGTHS_KEY, Beside, SimRolloutEngine, SimRollouts
from tidal.tools.sim.lengths import LengthModel
from tidal.tools.sim.trainer import SimCritic, SimTrainEngine


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What is simulated beside the recipe: the model's shape, the lengths, the factors."""

    model: costs.ModelShape
    lengths: LengthModel
    """Response lengths in real tokens (truncated at the recipe's `rollout.max_new_tokens`)."""
    prompt_tokens: int = 256
    """Real tokens of every prompt."""
    token_scale: int = 16
    """Real tokens one simulated token stands for."""
    eff: costs.Efficiency = costs.DEFAULT_EFFICIENCY
    seed: int = 0
    replay: Mapping[int, list[list[int]]] | None = None
    """Recorded lengths (`lengths.replay`: a run's metrics.jsonl) used instead of `lengths`:
    step k's prompts take the groups of the trace's k-th step, the trace repeating when the
    simulation runs longer; a group smaller than `group_size` repeats its lengths."""
    replay_rewards: Mapping[int, list[list[float]]] | None = None
    """Recorded rewards (`lengths.replay_rewards`), step by step beside `replay`: a group's
    samples are scored with its rewards, in the order they reach the reward stage, so the
    groups whose samples all got one reward (no advantage: the trainer skips their rows)
    are the run's. Steps without them, and runs without a trace, score a group's samples
    1 and 0 in turn, so that every group trains, but for `flat_groups` of them."""
    flat_groups: float = 0.0
    """The share of prompts, without recorded rewards, whose samples all get one reward (a
    prompt the policy always or never solves): a seeded draw per prompt; the trainer skips
    their rows. A run's `skipped_rows` over its rows says what it had. In [0, 1]."""
    reward_s: float = 0.0
    """Seconds one sample's reward takes to compute. The reward stage scores each batch it
    takes on the recipe's reward workers side by side (`task.reward_workers`; none: one at a
    time in the stage's thread). 0: rewards are free."""
    stage_s: float = 0.0
    """Seconds of the loop's own work for each batch the reward stage takes: the reward and
    advantage stages' Python around the reward function (a real run's `reward` and
    `advantage` spans a batch, less what `reward_s` charges for it), charged in the reward
    stage's thread. 0: free, as on a cluster whose host CPUs keep up."""

    def __post_init__(self) -> None:
        for name in ("reward_s", "stage_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not 0 <= self.flat_groups <= 1:
            raise ValueError(f"flat_groups must be a share in [0, 1], got {self.flat_groups!r}")


@dataclasses.dataclass(kw_only=True)
class Prediction:
    """What a simulated run did, in virtual seconds."""

    steps: list[dict[str, Any]]
    """Each step's metrics, as `tidal run` logs them."""
    total_s: float
    samples_per_s: float
    tokens_per_s: float
    """Trained real tokens (responses) per second."""
    step_s: dict[str, float]
    """p10 / p50 / p90 / mean of the step times."""
    utilisation: dict[str, float]
    """Busy share of the trainer and of the rollout instances (mean)."""
    idle: dict[str, float]
    """Share of the run the trainer waited for data, and rollout (mean over instances)
    waited for weights and for prompts."""
    paused_generations: int
    """Generate calls that paused for new weights (partial rollout)."""
    reprefill_share: float
    """Share of the run a rollout instance spent (mean over instances) prefilling again
    the tokens its paused rows had generated: what pausing for new weights cost."""
    version_gaps: dict[int, int]
    """Trained tokens by how many versions older than the trainer they were."""
    layout: str
    roles: dict[str, Any]
    engine_ranges: dict[str, int]
    """The largest decode batch an engine ran, the longest context a sequence may reach
    (prompt + budget, real tokens) and the most real tokens a training step gave one
    device: what a calibration's profile should cover (`calibrate.extrapolations`)."""
    wall_s: float = 0.0
    """Real seconds the simulation took."""
    handoffs: int = 0
    """Times the shared devices passed from one role's state to the other's (0 unless rollout
    time-shares the trainer's devices)."""
    handed_off: int = 0
    """Paused groups borrowed (multiplexed) rollout instances handed back to the store when
    the trainer took its devices back, for other instances to continue."""

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "steps"}


def plan_of(cfg: RecipeConfig, cluster: ClusterSpec) -> Plan:
    """The recipe's placement on the cluster spec, by the real scheduler.

    Raises:
        ConfigError: the plan is infeasible, or a layout the simulator does not run yet.
    """
    try:
        plan = schedule(cluster.resources(), roles_of(cfg))
    except PlacementError as e:
        raise ConfigError(f"placement on cluster {cluster.name!r}: {e}") from None
    return plan


def _transport(cfg: RecipeConfig, train_kind: str, rollout_kind: str, *, same_node: bool, colocated: bool = False) -> str:
    """The transport the real runtime would pick (`hal.transfer.choose_transport`, the rule
    a Ray run applies)."""
    me, them = describe(train_kind, device_count=1), describe(rollout_kind, device_count=1)
    try:
        return choose_transport(me, them, same_node=same_node, colocated=colocated, override=cfg.transport.name)
    except ValueError as e:
        raise ConfigError(f"transport.name={cfg.transport.name}: {e}") from None


REWARDS_KEY = "rewards"
"""A prompt row's key (its trajectories' `meta` key) holding its group's recorded rewards."""


def _prompts(cfg: RecipeConfig, work: Workload, sim_budget: int) -> Iterator[dict[str, Any]]:
    """Endless prompts, each carrying its group's response lengths (simulated tokens)."""
    rng, flat = random.Random(work.seed), random.Random(work.seed + 1)  # the draws of flat groups leave the lengths alone
    prompt = [1] * max(1, math.ceil(work.prompt_tokens / work.token_scale))
    per_step = cfg.algorithm.prompts_per_step
    index = 0
    # each recorded step's groups of lengths, and of rewards where it has them
    recorded = [(work.replay[k], (work.replay_rewards or {}).get(k)) for k in sorted(work.replay)] if work.replay else None
    while True:
        step = index // per_step
        row: dict[str, Any] = {"prompt_ids": list(prompt)}
        if recorded is not None:
            groups, scores = recorded[step % len(recorded)]
            g = (index % per_step) % len(groups)
            lengths = groups[g]
            if scores is not None:
                row[REWARDS_KEY] = scores[g]
        else:
            (lengths,) = work.lengths.sample(step=step, num_prompts=1, group_size=cfg.algorithm.group_size, rng=rng)
        if REWARDS_KEY not in row and work.flat_groups and flat.random() < work.flat_groups:
            row[REWARDS_KEY] = [1.0]  # every sample of the group: no advantage
        row[LENGTHS_KEY] = [min(max(1, math.ceil(n / work.token_scale)), sim_budget) for n in lengths]
        yield row
        index += 1


ALWAYS_PADDED = frozenset({"megatron"})
"""Train backends whose micro-batches are always padded (megatron-core's local attention takes no packed rows)."""
SORTED_ROWS = frozenset({"torch", "megatron"})
"""Train backends that sort a rank's rows by length before cutting them into micro-batches,
each cut to its longest row (their `_micro_batches`); fsdp and deepspeed cut a rank's rows in
the batch's order, as wide as the batch unless a token budget crops them. A backend named
in neither (registered by a user) is costed as fsdp and deepspeed are."""


def train_shape(train: TrainConfig, *, recompute: bool = False) -> costs.TrainShape:
    """How the recipe's train engine (`train.*`) cuts a step into micro-batches; `recompute`:
    the model recomputes activations in its backward pass (`model.gradient_checkpointing`)."""
    sorts = train.backend in SORTED_ROWS
    return costs.TrainShape(
        padded=train.padding_free is False or train.backend in ALWAYS_PADDED,
        sorted_rows=sorts,
        cropped=sorts or train.max_tokens_per_micro_batch is not None,
        micro_batch_size=train.micro_batch_size,
        max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
        recompute=recompute,
    )


def simulate(cfg: RecipeConfig, cluster: ClusterSpec, work: Workload, *, tracer_events: int = 200_000) -> tuple[Prediction, Tracer]:
    """Run the recipe's loop on the cluster on a virtual clock; the prediction and its timeline.

    Raises:
        ConfigError: an infeasible plan or transport (`plan_of`).
    """
    began = time.perf_counter()
    plan = plan_of(cfg, cluster)
    train, rollout = plan.of("train"), plan.of("rollout")
    train_device = cluster.group_of(train[0].node).device
    train_nodes = sorted({a.node for a in train})
    num_train_devices = sum(len(a.devices) for a in train)
    sim_budget = max(1, cfg.rollout.max_new_tokens // work.token_scale)

    clock = VirtualClock()
    tracer = Tracer("simulated", max_events=tracer_events, clock=clock)
    store = Store(clock=clock)
    shared = set(train_nodes) & {a.node for a in rollout}  # hosts both roles work on: their work slows beside each other's
    beside = Beside(clock) if shared else None
    trainer = SimTrainEngine(clock=clock, model=work.model, device=train_device, num_devices=num_train_devices, num_nodes=len(train_nodes), eff=work.eff, token_scale=work.token_scale, prompt_tokens_real=work.prompt_tokens, beside=beside, train_shape=train_shape(cfg.train, recompute=cfg.model.gradient_checkpointing))
    rollout_devices = [(cluster.group_of(a.node).device, len(a.devices)) for a in rollout]
    shares = plan.layout != "disaggregated"  # some rollout instance time-shares the trainer's devices
    # each instance's transport, as the runtime picks it; the workers get a version once the slowest has it
    transports = [_transport(cfg, train[0].kind, a.kind, same_node=a.node in train_nodes, colocated=a.mode != "own") for a in rollout]
    transport = transports[0] if len(set(transports)) == 1 else "+".join(sorted(set(transports)))
    try:
        sync_s = max(
            # a transport's fan-out is to the instances it serves (a hybrid's host sends skip its ipc guests)
            costs.weight_sync_s(work.model, transport=t, src=train_device, dst=dev, num_nodes_between=0 if a.node in train_nodes else 1, num_receivers=transports.count(t), eff=work.eff)
            for t, (dev, _), a in zip(transports, rollout_devices, rollout)
        )
    except ValueError as e:
        raise ConfigError(f"transport.name={cfg.transport.name}: {e}") from None
    overlap = cfg.transport.overlap and cfg.runtime is Runtime.ray  # `runtime: local` publishes in the trainer's thread, whatever transport.overlap says
    config = WorkflowConfig(algorithm=cfg.algorithm, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=sim_budget))
    engines = [
        SimRolloutEngine(clock=clock, model=work.model, device=dev, tp=tp, eff=work.eff, token_scale=work.token_scale, name=f"rollout-{k}", beside=beside if a.node in shared else None)
        for k, ((dev, tp), a) in enumerate(zip(rollout_devices, rollout))
    ]
    steps: list[dict[str, Any]] = []
    scorers = max(1, reward_workers(cfg))

    scored: dict[Any, int] = {}  # group (None: every sample, one a prompt) -> its samples scored so far

    def reward_of(t: Any) -> float:
        """The recorded reward of the group's next sample; without one, 1 and 0 in turn: every
        group has an advantage and trains whole (the most a step costs). One sample a prompt
        (PPO's): 1 and 0 in turn over the samples, so their advantages differ too."""
        recorded = t.meta.get(REWARDS_KEY) or (1.0, 0.0)
        key = t.group if cfg.algorithm.group_size > 1 else None
        j = scored.get(key, 0)
        if j + 1 >= len(recorded):
            scored.pop(key, None)  # the group's next sample starts over, as lengths do
        else:
            scored[key] = j + 1
        return float(recorded[j % len(recorded)])

    def score(trajectories: Any) -> tuple[list[float], list[int]]:
        if trajectories and (work.reward_s or work.stage_s):  # the batch's samples on the reward workers, side by side
            clock.sleep(math.ceil(len(trajectories) / scorers) * work.reward_s + work.stage_s)
        return [reward_of(t) for t in trajectories], []

    seats: list[Seat] = []
    turns: list[Turns] = []
    group: list[SimRollouts] = []

    critic = SimCritic(trainer) if cfg.algorithm.advantage in VALUE_BASED else None  # PPO's: its passes on the trainer's devices

    def main() -> None:
        seated_trainer: Any = trainer
        seated_critic: Any = critic
        guests: list[Any] = list(engines)
        if shares:  # made here: seats start their parking threads on the clock
            seated_trainer, guests = _seat(clock, plan, cluster, work, trainer, engines, seats, turns, with_critic=critic is not None)
            if critic is not None:  # in the trainer's seat, as `flow.colocate.Sharing.critic` seats it
                seated_critic = _ClaimingCritic(SharedCritic(critic, seats[0]), seated_trainer)
        rollouts = SimRollouts(
            clock=clock,
            store=store,
            engines=guests,
            group_size=cfg.algorithm.group_size,
            max_new_tokens=sim_budget,
            prompts_per_generate=cfg.rollout.prompts_per_generate,
            tracer=tracer,
            # without overlap the trainer waits out the whole transfer, and rollout has the
            # weights when it ends; with it, the trainer goes on and they arrive a transfer later
            send_s=0.0 if overlap else sync_s,
            deliver_s=sync_s if overlap else 0.0,
            hand_off=[a.mode == "borrowed" for a in rollout],  # a borrowed seat hands its paused groups back, as under Ray
        )
        group.append(rollouts)
        workflow = Workflow(store=store, rollout=guests[0], trainer=seated_trainer, prompts=_prompts(cfg, work, sim_budget), score=score, config=config, on_step=steps.append, tracer=tracer, rollouts=rollouts, clock=clock, critic=seated_critic)
        try:
            workflow.run()
        finally:
            for seat in seats:
                seat.close()

    clock.run(main)
    total = clock.now()
    prediction = _predict(steps, total, trainer=trainer, engines=engines, plan=plan, work=work, transport=transport, wall_s=time.perf_counter() - began)
    prediction.handoffs = sum(t.handoffs for t in turns)
    prediction.handed_off = sum(w.num_handed_off for w in group[0].workers)
    return prediction, tracer


def _seat(
    clock: VirtualClock, plan: Plan, cluster: ClusterSpec, work: Workload, trainer: SimTrainEngine, engines: list[SimRolloutEngine], seats: list[Seat], turns: list[Turns], *, with_critic: bool = False
) -> tuple[Any, list[Any]]:
    """The seats of a plan where rollout time-shares the trainer's devices: one `Turns` per
    trainer instance, the trainer seated at all of them (in rank order, parking everywhere at
    once; `with_critic`: a critic's training state, the policy's size, parks with its own) and
    each colocated or borrowed rollout engine at those of the trainer instances whose devices
    it uses (several: all their turns at once, as a spanning guest under Ray); an instance with
    devices of its own is not seated. Parks and onloads sleep `costs.park_s`."""
    train = plan.of("train")
    turns += [Turns(clock=clock) for _ in train]

    def moving(seconds: float) -> Any:
        return lambda: clock.sleep(seconds)

    device = cluster.group_of(train[0].node).device
    num_devices = sum(len(a.devices) for a in train)
    train_s = costs.park_s((2 if with_critic else 1) * work.model.num_params * costs.TRAIN_STATE_BYTES_PER_PARAM / num_devices, device, work.eff)
    span = TurnsSpan(turns, clock=clock) if len(turns) > 1 else turns[0]
    seats.append(Seat(span, "train", park=moving(train_s), unpark=moving(train_s), clock=clock))
    seated: list[SimRolloutEngine] = []
    shared_trainer = _Claiming(SharedTrainEngine(trainer, seats[-1]), seated, clock)
    guests: list[Any] = []
    for engine, a in zip(engines, plan.of("rollout")):
        if a.mode == "own":
            guests.append(engine)
            continue
        hosts = [k for k, t in enumerate(train) if t.node == a.node and set(t.devices) & set(a.devices)]
        if not hosts or not set(a.devices) <= {d for k in hosts for d in train[k].devices}:
            raise ConfigError(f"placement: rollout instance {a.rank} ({a.mode}) uses devices of no trainer instance on {a.node}; tidal simulate seats guests on trainer devices")
        arbiter = turns[hosts[0]] if len(hosts) == 1 else TurnsSpan([turns[k] for k in hosts], clock=clock)  # spanning several: all their turns, parked on all
        guest_s = costs.park_s(work.model.weight_bytes / len(a.devices), engine.device, work.eff)
        seats.append(Seat(arbiter, engine.name, park=moving(guest_s), unpark=moving(guest_s), clock=clock))
        guests.append(SharedRolloutEngine(engine, seats[-1]))
        seated.append(engine)
    return shared_trainer, guests


CLAIM_S = 1e-6
"""Virtual seconds after the trainer asks for its turn that the seated rollout engines are
interrupted (`_Claiming`): by then its claim is queued, whatever order the clock's threads
run in."""


class _Claiming:
    """The seated trainer of a simulation: each call that takes a turn (a train step, a
    logprobs pass) first has the decoding waits of the seated rollout engines interrupted, just
    after its claim is queued. A real engine looks at `should_pause` (`Seat.wanted`) after
    every decode step; a simulated one decodes from event to event (a row that ends, a
    version that arrives), and without this would hold the devices until its next row ended."""

    def __init__(self, shared: SharedTrainEngine, seated: list[SimRolloutEngine], clock: VirtualClock) -> None:
        self.shared, self.seated, self.clock = shared, seated, clock

    def __getattr__(self, name: str) -> Any:  # version, turn_for_step, named_weights, ...: the shared engine's
        return getattr(self.shared, name)

    def claim(self) -> None:
        if self.seated:
            self.clock.thread(self._interrupt, name="tidal-sim-claim").start()

    def _interrupt(self) -> None:
        self.clock.sleep(CLAIM_S)
        for engine in self.seated:
            engine.interrupt()

    def logprobs(self, batch: Any) -> Any:
        self.claim()
        return self.shared.logprobs(batch)

    def train_step(self, batch: Any, advantages: Any, **kwargs: Any) -> dict[str, float]:
        self.claim()
        return self.shared.train_step(batch, advantages, **kwargs)

    def logprobs_under_reference(self, batch: Any) -> Any:
        self.claim()
        return self.shared.logprobs_under_reference(batch)

    def sft_step(self, batch: Any) -> dict[str, float]:
        self.claim()
        return self.shared.sft_step(batch)


class _ClaimingCritic:
    """The seated critic of a simulation: each of its calls that takes the trainer's turn first
    has the seated rollout engines interrupted, as the trainer's own calls do (`_Claiming`)."""

    def __init__(self, shared: SharedCritic, claiming: _Claiming) -> None:
        self.shared, self.claiming = shared, claiming

    def values(self, batch: Any) -> Any:
        self.claiming.claim()
        return self.shared.values(batch)

    def train_step(self, batch: Any, returns: Any, old_values: Any) -> dict[str, float]:
        self.claiming.claim()
        return self.shared.train_step(batch, returns, old_values)

    def state_dict(self) -> dict[str, Any]:
        return self.shared.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared.load_state_dict(state)


def _predict(steps: list[dict[str, Any]], total: float, *, trainer: SimTrainEngine, engines: list[SimRolloutEngine], plan: Plan, work: Workload, transport: str, wall_s: float) -> Prediction:
    step_times = [s["step_s"] for s in steps]
    quantiles = statistics.quantiles(step_times, n=10) if len(step_times) > 1 else step_times * 9
    gaps: Counter[int] = Counter()
    waits: Counter[str] = Counter()
    for s in steps:
        gaps.update({int(k): int(v) for k, v in s["version_gap"].items()})
        waits.update(s["wait_s"])
    num_rollout = len(engines)
    rollout_busy = sum(e.stats["busy_s"] for e in engines) / num_rollout
    return Prediction(
        steps=steps,
        total_s=total,
        samples_per_s=sum(s["samples"] for s in steps) / total,
        tokens_per_s=sum(s["tokens"] for s in steps) * work.token_scale / total,
        step_s={"p10": quantiles[0], "p50": statistics.median(step_times), "p90": quantiles[-1], "mean": statistics.fmean(step_times)},
        utilisation={"train": trainer.stats["busy_s"] / total, "rollout": rollout_busy / total},
        idle={
            "train_waiting_for_data": waits.get("train", 0.0) / total,
            "rollout_waiting_for_weights": waits.get("weights", 0.0) / total,  # the group reports each wait as its workers' mean
            "rollout_waiting_for_prompts": waits.get("rollout", 0.0) / total,
        },
        paused_generations=int(steps[-1].get("paused_generations", 0)) if steps else 0,
        reprefill_share=sum(e.stats["reprefill_s"] for e in engines) / num_rollout / total,
        version_gaps=dict(sorted(gaps.items())),
        layout=plan.layout,
        roles={
            "train": {"devices": sum(len(a.devices) for a in plan.of("train")), "kind": plan.of("train")[0].kind},
            "rollout": {"instances": num_rollout, "devices_each": len(plan.of("rollout")[0].devices), "kind": "+".join(dict.fromkeys(a.kind for a in plan.of("rollout")))},  # e.g. npu+cuda: a mixed hybrid
            "transport": transport,
        },
        wall_s=wall_s,
        engine_ranges={
            "decode_batch": int(max(e.stats["max_batch"] for e in engines)),
            "context": work.prompt_tokens + max(s["response_len_max"] for s in steps) * work.token_scale if steps else work.prompt_tokens,
            "train_tokens_per_device": int(trainer.stats.get("max_tokens", 0)) // max(1, sum(len(a.devices) for a in plan.of("train"))),
        },
    )
