"""The simulated engines of `tidal simulate` on a virtual clock: each call takes the time the
cost models say, decodes event by event, pauses, refills and resumes like a real engine."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.rollout import RolloutWorker, Stop
from tidal.flow.rows import TRAJECTORY_COLUMNS, trajectories_of
from tidal.flow.store import Store
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.flow.virtual_clock import VirtualClock
from tidal.tools.sim import costs
from tidal.tools.sim.costs import DEFAULT_EFFICIENCY as EFF
from tidal.tools.sim.costs import ModelShape
from tidal.tools.sim.engines import Beside, SimRolloutEngine, SimRollouts
from tidal.tools.sim.hardware import device
from tidal.tools.sim.trainer import SimTrainEngine

MODEL = ModelShape.qwen2_5("0.5b")
H100 = device("h100")
SCALE = 64


def _engine(clock: VirtualClock, *, dev=H100, scale: int = SCALE, eff: costs.Efficiency = EFF, **kwargs) -> SimRolloutEngine:
    return SimRolloutEngine(clock=clock, model=MODEL, device=dev, tp=1, eff=eff, token_scale=scale, **kwargs)


def _group(lengths: list[int], *, prompt_len: int = 4, group: int = 0) -> list[Trajectory]:
    meta = {"lengths": lengths}  # one dict for the whole group, as flow.rollout.group_of makes it
    return [Trajectory(prompt_ids=[1] * prompt_len, group=group, meta=meta) for _ in lengths]


def _prefill(sim_tokens: int, *, scale: int = SCALE, dev=H100) -> float:
    return costs.prefill_s(MODEL, dev, tp=1, tokens=sim_tokens * scale, eff=EFF)


def _segment(batch: int, context_sim: int, steps: int, *, scale: int = SCALE, dev=H100) -> float:
    """`steps` simulated steps of `batch` rows holding `context_sim` simulated tokens at the start."""
    average = context_sim * scale + batch * (steps * scale - 1) / 2
    return steps * scale * costs.decode_step_s(MODEL, dev, tp=1, batch=batch, context_tokens=math.ceil(average), eff=EFF)


class _Refill:
    """Records when rows end; hands out the prepared groups, one per `more()` call."""

    def __init__(self, clock: VirtualClock, groups: list[list[Trajectory]] = ()) -> None:
        self.clock, self.groups = clock, list(groups)
        self.done_at: list[tuple[float, list[int]]] = []
        self.more_at: list[float] = []

    def done(self, trajectories: list[Trajectory]) -> None:
        self.done_at.append((self.clock.now(), [t.num_generated for t in trajectories]))

    def more(self) -> list[Trajectory]:
        self.more_at.append(self.clock.now())
        return self.groups.pop(0) if self.groups else []


def test_a_group_of_equal_lengths_takes_its_prefill_and_its_steps():
    clock = VirtualClock()
    engine = _engine(clock)
    rows = _group([32] * 4)

    def main():
        out = engine.generate(rows, max_new_tokens=64)
        return out, clock.now()

    out, end = clock.run(main)
    assert out == rows and [(t.num_generated, t.finish_reason) for t in rows] == [(32, "stop")] * 4
    assert rows[0].tokens == [1] * 32 and rows[0].logprobs == [-1.0] * 32 and rows[0].versions == [0] * 32
    # the group's 4 samples share one prompt: one prefill of it, then 32 steps of 4 rows
    assert end == pytest.approx(_prefill(4) + _segment(4, 4 * 4, 32), rel=1e-12)
    assert engine.stats == {"busy_s": pytest.approx(end), "reprefill_s": 0.0, "num_real_tokens": 4 * 32 * SCALE, "num_generates": 1, "num_pauses": 0, "max_batch": 4}


def test_without_interrupts_a_generate_takes_what_generate_s_says():
    clock = VirtualClock()
    engine = _engine(clock, scale=1)
    lengths = [5, 9, 13, 20]
    rows = [t for k, n in enumerate(lengths) for t in _group([n], prompt_len=100, group=k)]  # four prompts
    end = clock.run(lambda: (engine.generate(rows, max_new_tokens=64), clock.now())[1])
    slots = costs.decode_slots(MODEL, H100, tp=1, tokens_per_sequence=100 + 64)
    assert end == pytest.approx(costs.generate_s(MODEL, H100, tp=1, prompt_tokens=100, response_tokens=lengths, slots=slots, eff=EFF), rel=1e-12)


def test_a_generate_call_costs_its_own_overhead_once():
    eff = dataclasses.replace(EFF, generate_call_overhead_s=0.25)
    lengths = [5, 9, 13, 20]
    ends = []
    for e in (EFF, eff):
        clock = VirtualClock()
        engine = _engine(clock, scale=1, eff=e)
        rows = [t for k, n in enumerate(lengths) for t in _group([n], prompt_len=100, group=k)]
        ends.append(clock.run(lambda engine=engine, rows=rows, clock=clock: (engine.generate(rows, max_new_tokens=64), clock.now())[1]))
        assert engine.stats["busy_s"] == pytest.approx(ends[-1])
    assert ends[1] == pytest.approx(ends[0] + 0.25)
    slots = costs.decode_slots(MODEL, H100, tp=1, tokens_per_sequence=100 + 64)
    assert ends[1] == pytest.approx(costs.generate_s(MODEL, H100, tp=1, prompt_tokens=100, response_tokens=lengths, slots=slots, eff=eff))


def test_long_tail_rows_end_one_by_one_and_the_call_ends_with_the_longest():
    clock = VirtualClock()
    engine = _engine(clock)
    rows = _group([4, 8, 16, 100])  # the last is cut at the budget
    refill = _Refill(clock)
    end = clock.run(lambda: (engine.generate(rows, max_new_tokens=64, refill=refill), clock.now())[1])
    assert [counts for _, counts in refill.done_at] == [[4], [8], [16], [64]]
    times = [t for t, _ in refill.done_at]
    assert times == sorted(times) and len(set(times)) == 4 and times[-1] == end
    assert [t.finish_reason for t in rows] == ["stop", "stop", "stop", "length"]
    # the first row ends after the prefill and 4 steps of all 4 rows
    assert times[0] == pytest.approx(_prefill(4) + _segment(4, 16, 4), rel=1e-12)


def test_an_interrupt_pauses_at_once_and_a_later_call_resumes_with_the_new_version():
    clock = VirtualClock()
    engine = _engine(clock)
    rows = _group([32] * 4)
    step = _segment(4, 16, 32) / 32
    at = _prefill(4) + 10.5 * step
    flag = {"pause": False}

    def publisher():
        clock.sleep(at)
        flag["pause"] = True
        engine.interrupt()

    def main():
        clock.thread(publisher, name="publisher").start()
        engine.generate(rows, max_new_tokens=64, should_pause=lambda: flag["pause"])
        paused = (clock.now(), [(t.num_generated, t.finish_reason) for t in rows])
        engine.load_weights(1, [("w", torch.zeros(1))])
        start = clock.now()
        engine.generate(rows, max_new_tokens=64, should_pause=lambda: False)
        return paused, clock.now() - start

    (paused_at, state), resumed_s = clock.run(main)
    assert paused_at == pytest.approx(at) and state == [(10, None)] * 4  # the step in flight is lost
    assert [t.versions for t in rows] == [[0] * 10 + [1] * 22] * 4 and all(t.finish_reason == "stop" for t in rows)
    # resumed rows prefill their prompt and tokens so far (one distinct input), then decode the
    # rest: the real steps done past the 10th simulated token (half of one) count
    carry = math.floor(0.5 * SCALE)
    left = 22 * SCALE - carry
    average = 4 * 14 * SCALE + 4 * carry + 4 * (left - 1) / 2
    decode = left * costs.decode_step_s(MODEL, H100, tp=1, batch=4, context_tokens=math.ceil(average), eff=EFF)
    assert resumed_s == pytest.approx(_prefill(4 + 10) + decode, rel=1e-12)
    assert engine.version == 1 and engine.stats["num_pauses"] == 1 and engine.stats["num_generates"] == 2
    assert engine.stats["reprefill_s"] == pytest.approx(_prefill(4 + 10), rel=1e-12)  # the resumed rows' whole prefill: a pause's cost


def test_refill_rows_join_when_rows_end_and_pay_their_prefill():
    clock = VirtualClock()
    engine = _engine(clock)
    first, second = _group([4, 4], group=0), _group([8, 8], prompt_len=6, group=1)
    refill = _Refill(clock, [second])
    out, end = clock.run(lambda: (engine.generate(first, max_new_tokens=64, refill=refill), clock.now()))
    assert out == first + second and all(t.done for t in out)
    assert [counts for _, counts in refill.done_at] == [[4, 4], [8, 8]]
    first_end = _prefill(4) + _segment(2, 8, 4)
    assert refill.more_at[0] == pytest.approx(first_end, rel=1e-12)
    assert end == pytest.approx(first_end + _prefill(6) + _segment(2, 12, 8), rel=1e-12)


def test_rows_beyond_the_kv_slots_wait_for_a_free_slot():
    k = 4
    per_sequence = (4 + 64) * SCALE  # real prompt + real budget
    hbm = (MODEL.weight_bytes + (k + 0.5) * per_sequence * costs.kv_bytes_per_token(MODEL)) / 0.9
    small = device("h100", hbm_gib=hbm / 2**30)
    assert costs.decode_slots(MODEL, small, tp=1, tokens_per_sequence=per_sequence) == k

    def elapsed(n: int) -> float:
        clock = VirtualClock()
        engine = _engine(clock, dev=small)
        return clock.run(lambda: (engine.generate(_group([16] * n), max_new_tokens=64), clock.now())[1])

    one, two = elapsed(k), elapsed(2 * k)
    assert one == pytest.approx(_prefill(4, dev=small) + _segment(k, 4 * k, 16, dev=small), rel=1e-12)
    assert two == pytest.approx(2 * one, rel=1e-12)


def _scenario() -> tuple[list[list[int]], list[tuple[float, list[int]]], float, dict]:
    clock = VirtualClock()
    engine = _engine(clock)
    rows = _group([3, 17, 40, 64], group=0)
    refill = _Refill(clock, [_group([5, 9], prompt_len=7, group=1)])

    def nudge():
        clock.sleep(0.2)
        engine.version = 1
        engine.interrupt()

    def main():
        clock.thread(nudge, name="nudge").start()
        out = engine.generate(rows, max_new_tokens=50, refill=refill)
        return [t.versions for t in out], clock.now()

    versions, end = clock.run(main)
    return versions, refill.done_at, end, dict(engine.stats)


def test_the_same_scenario_gives_the_same_tokens_and_times():
    first, second = _scenario(), _scenario()
    assert first == second
    versions = first[0]
    assert any(0 in v and 1 in v for v in versions)  # the interrupt fell mid-call, and decoding went on


def test_train_engine_skips_the_rows_without_an_advantage_as_the_real_engines_do():
    clock = VirtualClock()
    rows = [Trajectory(prompt_ids=[1] * 4, tokens=[1] * n, logprobs=[-1.0] * n, versions=[0] * n, finish_reason="stop") for n in (10, 6)]
    batch = to_token_batch(rows, pad_id=0)
    trainer = SimTrainEngine(clock=clock, model=MODEL, device=H100, num_devices=1, num_nodes=1, eff=EFF, token_scale=SCALE)

    def step(advantages, loss=None):
        began = clock.now()
        metrics = trainer.train_step(batch, torch.tensor(advantages), loss=loss or PolicyLossConfig())
        return clock.now() - began, metrics["skipped_rows"]

    def main():
        return step([1.0, -1.0]), step([0.0, 2.0]), step([0.0, 0.0]), step([0.0, 0.0], PolicyLossConfig(kl_coef=0.1))

    both, short_only, neither, with_kl = clock.run(main)
    assert both == (pytest.approx(costs.train_step_s(MODEL, H100, num_devices=1, tokens=(4 + 10 + 4 + 6) * SCALE, eff=EFF), rel=1e-12), 0.0)
    assert short_only == (pytest.approx(costs.train_step_s(MODEL, H100, num_devices=1, tokens=(4 + 6) * SCALE, eff=EFF), rel=1e-12), 1.0)
    assert neither == (0.0, 2.0) and trainer.version == 4  # nothing to pass over; the version still counts
    assert with_kl == (both[0], 0.0)  # a KL term: every row adds to the loss


def test_train_engine_sleeps_the_cost_model_step_and_counts_versions():
    clock = VirtualClock()
    rows = [Trajectory(prompt_ids=[1] * 4, tokens=[1] * n, logprobs=[-1.0] * n, versions=[0] * n, finish_reason="stop") for n in (10, 6)]
    batch = to_token_batch(rows, pad_id=0)
    trainer = SimTrainEngine(clock=clock, model=MODEL, device=H100, num_devices=8, num_nodes=1, eff=EFF, token_scale=SCALE)
    placeholder = SimTrainEngine(clock=clock, model=MODEL, device=H100, num_devices=8, num_nodes=1, eff=EFF, token_scale=SCALE, prompt_tokens_real=500)

    def main():
        t0 = clock.now()
        metrics = trainer.train_step(batch, torch.tensor([1.0, -1.0]), loss=PolicyLossConfig())
        t1 = clock.now()
        logprobs = trainer.logprobs(batch)
        t2 = clock.now()
        placeholder.train_step(batch, torch.tensor([1.0, -1.0]), loss=PolicyLossConfig())
        return metrics, t1 - t0, logprobs, t2 - t1, clock.now() - t2

    metrics, step_s, logprobs, forward_s, placeholder_s = clock.run(main)
    tokens = 8 * (4 + 10) * SCALE  # two rows over 8 ranks: the step lasts as long as the rank with the longer row; six ranks idle
    assert step_s == pytest.approx(costs.train_step_s(MODEL, H100, num_devices=8, tokens=tokens, eff=EFF), rel=1e-12)
    assert metrics == {"loss": 0.0, "train_s": pytest.approx(step_s), "skipped_rows": 0.0} and trainer.version == 1
    assert logprobs.shape == (2, 4 + 10 - 1) and not logprobs.any()
    assert forward_s == pytest.approx(2 * MODEL.num_params * tokens / (8 * H100.flops * EFF.train_mfu), rel=1e-12)
    assert placeholder_s == pytest.approx(costs.train_step_s(MODEL, H100, num_devices=8, tokens=8 * (500 + 10 * SCALE), eff=EFF), rel=1e-12)
    assert trainer.stats["busy_s"] == pytest.approx(step_s + forward_s)
    assert [name for name, _ in trainer.named_weights()] == ["w"] and trainer.state_dict() == {"version": 1}
    trainer.load_state_dict({"version": 7})
    assert trainer.version == 7


@pytest.mark.skipif("clock" not in inspect.signature(RolloutWorker).parameters, reason="RolloutWorker has no clock= keyword yet")
def test_sim_rollouts_run_real_workers_and_deliver_weights_late():
    clock = VirtualClock()
    store = Store(clock=clock)
    store.create_partition("prompts", consumers=["rollout"])
    store.create_partition("train", consumers=["train"])
    store.put("prompts", {"prompt": [{"prompt_ids": [1] * 4, "lengths": [8, 16]} for _ in range(4)]})
    engines = [_engine(clock, name=f"r{k}") for k in range(2)]
    rollouts = SimRollouts(clock=clock, store=store, engines=engines, group_size=2, max_new_tokens=64, prompts_per_generate=2, send_s=0.01, deliver_s=0.02)

    def run():
        with pytest.raises(Stop):
            rollouts.run()

    def main():
        thread = clock.thread(run, name="rollouts")
        thread.start()
        clock.sleep(0.1)
        rollouts.publish(1, [("w", torch.zeros(1))])
        published = clock.now()
        rows = trajectories_of(store.get("train", "train", list(TRAJECTORY_COLUMNS), 8))
        metrics = rollouts.metrics()
        rollouts.stop()
        thread.join()
        return published, rows, metrics

    published, rows, metrics = clock.run(main)
    assert published == pytest.approx(0.11)  # the publish held the trainer send_s
    assert sorted(t.num_generated for t in rows) == [8] * 4 + [16] * 4 and all(t.finish_reason == "stop" for t in rows)
    assert all(t.versions_used == [0, 1] for t in rows)  # delivered at 0.13, mid-generation: every row has both
    assert [e.version for e in engines] == [1, 1]
    assert metrics["paused_generations"] == 2 and metrics["handed_off"] == 0 and set(metrics["wait_s"]) <= {"rollout", "weights"}


@pytest.mark.parametrize(("rollout_from", "rollout_until", "expected"), [
    (0.5, None, 0.5 + 0.5 * 2),  # rollout starts halfway: the second half at half pace
    (0.5, 1.0, 0.5 + 0.5 + 0.25),  # and stops half a second later: a quarter of the work done in it, the last quarter at full pace
    (None, None, 1.0),  # nothing beside it
])
def test_work_beside_the_other_role_slows_for_as_long_as_it_overlaps(rollout_from, rollout_until, expected):
    """A training step that started before rollout's next call slows from when that call starts
    (a pace judged only at the step's start would give 1.0 or 2.0)."""
    clock = VirtualClock()
    beside = Beside(clock)
    eff = costs.Efficiency(train_beside_rollout=2.0, rollout_beside_train=3.0)

    def rollout():
        clock.sleep(rollout_from)
        with beside.work("rollout"):
            clock.sleep(10.0 if rollout_until is None else rollout_until - rollout_from)

    def main():
        if rollout_from is not None:
            clock.thread(rollout, name="rollout").start()
        return beside.run("train", 1.0, eff)

    assert clock.run(main) == pytest.approx(expected, abs=1e-9)


def test_work_in_a_run_takes_its_factor_always_and_the_slowdown_beside_on_top():
    clock = VirtualClock()
    beside = Beside(clock)
    eff = costs.Efficiency(train_beside_rollout=2.0, train_in_run=1.5, rollout_in_run=1.2)

    def main():
        alone = beside.run("train", 1.0, eff)
        with beside.work("rollout"):
            beside_rollout = beside.run("train", 1.0, eff)
        return alone, beside_rollout, beside.factor("rollout", eff)

    assert clock.run(main) == pytest.approx((1.5, 3.0, 1.2), abs=1e-9)
