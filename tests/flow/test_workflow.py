"""The async workflow: sync equivalence, staleness bounds at admission and consumption, partial rollout."""

from __future__ import annotations

import concurrent.futures
import copy
import threading
import time

import pytest
import torch

from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.engines.rewards import score
from tidal.engines.tasks import arithmetic
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import grpo
from tidal.flow.clock import RealClock
from tidal.flow.rows import put_trajectories
from tidal.flow.store import Store
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.flow.workflow import Workflow, WorkflowConfig

TOKENIZER = CharTokenizer()


def _reward(trajectory: Trajectory, text: str) -> float:
    return float(text.startswith(str(trajectory.meta["answer"])[:1]))  # dense enough for a tiny model


def _score(trajectories):
    texts = [TOKENIZER.decode([t for t in traj.tokens if t != TOKENIZER.eos_id]) for traj in trajectories]
    return score(_reward, trajectories, texts)


def _prompts(n: int = 400):
    return [{**item, "prompt_ids": TOKENIZER.encode(item["prompt"])} for item in arithmetic(n, seed=3, max_value=9)]


def _engines(seed: int = 0):
    torch.manual_seed(seed)
    model = build_tiny_qwen2(TOKENIZER.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=seed)
    model = model.double()
    trainer = TorchTrainEngine(model, lr=1e-2, micro_batch_size=4)
    rollout = HFRolloutEngine(copy.deepcopy(model), eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id, chunk_tokens=2)
    return trainer, rollout


CONFIG = dict(num_steps=3, prompts_per_step=2, group_size=4, max_new_tokens=4, prompts_per_generate=1, tis_cap=None, decoupled=True)


def test_max_staleness_zero_equals_a_plain_sequential_loop():
    cfg = WorkflowConfig.from_keys(max_staleness=0, **CONFIG)
    trainer, rollout = _engines()
    torch.manual_seed(123)
    steps = []
    Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append).run()
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["version_gap"] == {0: m["tokens"]} or not m["tokens"] for m in steps)

    ref_trainer, ref_rollout = _engines()
    torch.manual_seed(123)
    prompts = iter(_prompts())
    for step in range(cfg.algorithm.num_steps):
        trajectories = []
        for k in range(cfg.algorithm.prompts_per_step):  # one prompt per generate call, as prompts_per_generate=1
            prompt = next(prompts)
            group = [Trajectory(prompt_ids=prompt["prompt_ids"], group=step * cfg.algorithm.prompts_per_step + k, meta={"answer": prompt["answer"], "prompt": prompt["prompt"]}) for _ in range(cfg.algorithm.group_size)]
            while not all(t.done for t in group):
                ref_rollout.generate([t for t in group if not t.done], max_new_tokens=cfg.rollout.max_new_tokens)
            trajectories += group
        rewards, _ = _score(trajectories)
        advantages = grpo(torch.tensor(rewards), [t.group for t in trajectories])
        batch = to_token_batch(trajectories, pad_id=TOKENIZER.pad_id)
        ref_trainer.train_step(batch, advantages.double(), loss=cfg.loss, proximal_logprobs=ref_trainer.logprobs(batch))
        ref_rollout.load_weights(ref_trainer.version, [(n, t.clone()) for n, t in ref_trainer.named_weights()])
    for (name, ours), (_, ref) in zip(trainer.named_weights(), ref_trainer.named_weights()):
        assert torch.equal(ours, ref), f"{name} differs from the sequential loop"
    initial, _ = _engines()
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(trainer.named_weights(), initial.named_weights())), "nothing was trained"


def test_async_bound_holds_at_admission_and_consumption():
    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 4})
    trainer, rollout = _engines()
    steps = []
    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append)
    admitted = []
    stages = workflow.stages
    original = stages._admitted

    def spy(version: int) -> int:
        n = original(version)
        admitted.append((stages._started, version, n))
        return n

    stages._admitted = spy
    workflow.run()
    for started, version, n in admitted:
        assert started + n * cfg.algorithm.group_size <= (cfg.algorithm.max_staleness + version + 1) * cfg.batch_size
    for m in steps:
        assert max(m["version_gap"], default=0) <= cfg.algorithm.max_staleness  # no token older than the bound was trained
    assert trainer.version == 4


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_next_steps_rows_are_taken_while_a_step_trains_when_the_bound_allows(max_staleness):
    cfg = WorkflowConfig.from_keys(max_staleness=max_staleness, **{**CONFIG, "num_steps": 4})
    trainer, rollout = _engines()
    store, steps, gets = Store(), [], []
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append)
    original = store.get

    def get(consumer, *args, **kwargs):
        if consumer == "train":
            gets.append((threading.current_thread().name.startswith("tidal-prefetch"), store.version))
        return original(consumer, *args, **kwargs)

    store.get = get
    workflow.run()
    if max_staleness == 0:  # step v's rows are generated with v's weights: nothing to take before then
        assert gets == [(False, v) for v in range(4)]
    else:  # step 0's rows when it starts, step v+1's while step v trains (not for a step after the last)
        assert gets == [(False, 0)] + [(True, v) for v in range(3)]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and all(max(m["version_gap"], default=0) <= max_staleness for m in steps)
    assert store.consumer_counts("train", "train")["acked"] == 4 * cfg.batch_size


def _group_of_version(version: int, size: int) -> list[Trajectory]:
    """One finished group whose tokens version `version` generated."""
    group = [Trajectory(prompt_ids=[1, 5], group="old", meta={"answer": "1", "prompt": "x"}) for _ in range(size)]
    for t in group:
        t.extend([6, TOKENIZER.eos_id], [-1.0, -1.0], version)
    return group


def test_rows_older_than_the_bound_are_dropped_at_consumption():
    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 6})
    trainer, rollout = _engines()
    store = Store()
    steps = []
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append, start_version=4)
    # Rows produced by version 0, as if left over from long ago: the trainer (at version 4) must never use them.
    put_trajectories(store, _group_of_version(0, cfg.algorithm.group_size))
    trainer.version = 4
    rollout.version = 4
    workflow.run()
    assert sum(m["dropped"] for m in steps) == cfg.algorithm.group_size
    assert all(max(m["version_gap"], default=0) <= 1 for m in steps)


def test_partial_rollout_resumes_with_new_weights_inside_the_workflow():
    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 6, "max_new_tokens": 8, "prompts_per_generate": 2})
    trainer, rollout = _engines()
    rollout.chunk_tokens = 1  # a safe point after every token: weights land mid-generation
    seen = []
    original = rollout.generate

    def generate(trajectories, **kwargs):
        out = original(trajectories, **kwargs)
        seen.extend(t.versions_used for t in trajectories if t.done)
        return out

    rollout.generate = generate
    steps = []
    Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append).run()
    assert all(len(v) <= 2 and (len(v) < 2 or v[1] == v[0] + 1) for v in seen)
    assert all(max(m["version_gap"], default=0) <= 1 for m in steps)


def _run_or_fail(workflow: Workflow, timeout_s: float = 60.0) -> None:
    """Run `workflow`; fail (after stopping it) if it has not finished within `timeout_s`."""
    errors = []
    thread = threading.Thread(target=lambda: _capture(workflow.run, errors), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        workflow.stop()
        thread.join(30)
        raise AssertionError(f"the workflow hung: {workflow.trainer.version} of {workflow.config.num_steps} steps after {timeout_s:.0f}s")
    if errors:
        raise errors[0]


def _capture(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # re-raised by the test
        errors.append(e)


@pytest.mark.parametrize("slow_loader", [False, True], ids=["loader", "loader-slow-between-reads"])
def test_rollout_waits_for_the_version_that_admitted_its_prompts(slow_loader):
    # A remote worker's version lands a while after publish() returned (and admission opened):
    # with max_staleness=0, rows generated meanwhile with the old weights would all be dropped,
    # and the trainer would wait for rows that admission never lets rollout start.
    # `slow_loader`: a new version lands while the loader works out its room; its prompts
    # still carry the version that room was for (they once carried the one before).
    cfg = WorkflowConfig.from_keys(max_staleness=0, **{**CONFIG, "num_steps": 4})
    trainer, rollout = _engines()
    steps = []
    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append)
    if slow_loader:
        admitted = workflow.stages._admitted
        workflow.stages._admitted = lambda version: (time.sleep(0.1), admitted(version))[1]
    inbox = workflow.rollouts.worker.inbox

    def publish_late(version, named_weights):
        snapshot = {name: tensor.detach().clone() for name, tensor in named_weights}
        threading.Timer(0.3, inbox.offer, args=(version, snapshot)).start()

    workflow.rollouts.publish = publish_late
    _run_or_fail(workflow)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert sum(m["dropped"] for m in steps) == 0
    assert all(set(m["version_gap"]) <= {0} for m in steps)
    assert workflow.rollouts.worker.versions_applied[:3] == [1, 2, 3]  # each step's rows with the weights of the step before
    assert sum(m["wait_s"].get("weights", 0.0) for m in steps) > 0.2  # it did wait for them


class _LosesAVersion:
    """Local rollouts whose worker never gets version `lost` the first time it is sent (as a
    rollout actor that died with it on the way) and asks for weights again, as
    `RayRollouts.weights_wanted` does once Ray restarted it."""

    def __init__(self, local, lost: int) -> None:
        self.local, self.lost = local, lost
        self.wanted: concurrent.futures.Future = concurrent.futures.Future()
        self.published: list[int] = []

    def run(self):
        self.local.run()

    def stop(self):
        self.local.stop()

    def metrics(self):
        return self.local.metrics()

    def weights_wanted(self):
        return self.wanted

    def publish(self, version, named_weights):
        self.published.append(version)
        if self.wanted.done():
            self.wanted = concurrent.futures.Future()
        if version == self.lost and self.published.count(version) == 1:
            self.wanted.set_result(None)
            return
        self.local.publish(version, named_weights)


def test_a_trainer_waiting_for_rows_sends_its_version_again_to_a_rollout_that_asks():
    # Synchronous: the only prompts are admitted by version 2, which rollout never got; without
    # a second send, rollout waits for version 2 and the trainer for the rows it would generate.
    cfg = WorkflowConfig.from_keys(max_staleness=0, **{**CONFIG, "num_steps": 4})
    trainer, rollout = _engines()
    steps = []
    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append)
    local = workflow.rollouts
    workflow.rollouts = rollouts = _LosesAVersion(local, lost=2)
    _run_or_fail(workflow, timeout_s=30)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert rollouts.published == [1, 2, 2, 3, 4]  # version 2 again, once, before step 3 trained
    assert local.worker.versions_applied[:3] == [1, 2, 3] and all(set(m["version_gap"]) <= {0} for m in steps)
    assert sum(m["dropped"] for m in steps) == 0


def test_rows_dropped_at_consumption_let_admission_start_replacements():
    # One group the trainer counts as started is too old to train: dropping it must let the
    # loader start a replacement while the trainer waits for a full batch (nothing else wakes it).
    cfg = WorkflowConfig.from_keys(max_staleness=0, **{**CONFIG, "num_steps": 5})
    trainer, rollout = _engines()
    store = Store()
    steps = []
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append, start_version=4)
    old = _group_of_version(3, cfg.algorithm.group_size)
    put_trajectories(store, old)
    workflow.stages._started += len(old)  # admitted for this step, as if generated just before a version bump
    trainer.version = rollout.version = 4
    _run_or_fail(workflow)
    assert [m["step"] for m in steps] == [5]
    assert steps[0]["dropped"] == cfg.algorithm.group_size and steps[0]["samples"] == cfg.batch_size


@pytest.mark.skipif("ATen parallel backend: OpenMP" not in torch.__config__.parallel_info(), reason="per-thread intra-op counts need torch's OpenMP backend")
def test_the_rollout_thread_keeps_its_own_torch_threads_while_the_trainer_keeps_its_own():
    cfg = WorkflowConfig.from_keys(max_staleness=0, rollout_threads=1, **CONFIG)
    trainer, rollout = _engines()
    seen: dict[str, set[int]] = {"generate": set(), "train_step": set()}
    for engine, name in ((rollout, "generate"), (trainer, "train_step")):
        original = getattr(engine, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            seen[_name].add(torch.get_num_threads())
            return _original(*args, **kwargs)

        setattr(engine, name, spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the trainer's thread (this one), as `tidal run` sets `train.threads`
    try:
        Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg).run()
        assert torch.get_num_threads() == 2  # the rollout thread's count did not become this thread's
    finally:
        torch.set_num_threads(before)
    assert seen == {"generate": {1}, "train_step": {2}}


def test_a_stage_that_loses_its_store_says_why():
    from tidal.flow.stages import guard
    from tidal.flow.store import StoreError

    def _reward_stage():
        raise StoreError("a put of 10 rows can never fit partition 'train'")

    errors: list = []
    stopped = []
    guard(_reward_stage, stopping=threading.Event(), errors=errors, stop=lambda: stopped.append(True))
    assert stopped == [True] and str(errors[0]) == "stage reward_stage lost its store: a put of 10 rows can never fit partition 'train'"
    assert isinstance(errors[0].__cause__, StoreError)
    errors.clear()
    stopping = threading.Event()
    stopping.set()
    guard(_reward_stage, stopping=stopping, errors=errors, stop=lambda: None)
    assert errors == []  # the loop was stopping: the store's wait ending is the normal way out


def test_a_store_restored_from_a_run_with_smaller_steps_takes_this_runs_steps():
    """A resumed run may change `prompts_per_step` (or `max_staleness`): the restored
    partitions get this run's capacity (a step's prompts did not fit, or a step's rows)
    and lease."""
    from tidal.flow.stages import Stages

    store = Store()
    Stages(store=store, prompts=[], score=_score, config=WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "prompts_per_step": 1}), version=0).stop()  # the run before
    cfg = WorkflowConfig.from_keys(max_staleness=1, lease_s=7200.0, **{**CONFIG, "prompts_per_step": 5})
    trainer, rollout = _engines()
    steps = []
    Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append).run()
    assert [m["samples"] for m in steps] == [cfg.batch_size] * cfg.algorithm.num_steps
    assert store._signals.change_listeners == []  # both runs' stages let go of the store they leave behind
    assert store._part("prompts").lease_s == store._part("train").lease_s == 7200.0


def test_train_steps_longer_than_the_stores_default_lease_train_each_row_once():
    """Train steps of 400 s (the store's clock; a large model), with rollout the slower side:
    the trainer holds the next step's rows for up to two steps. With the store's default
    300 s lease they went back to the trainer and were trained twice or counted dropped;
    the workflow's partitions lease for `lease_s` (an hour)."""
    import collections

    now = [0.0]
    store = Store(clock=RealClock(now=lambda: now[0]))
    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 6})
    trainer, rollout = _engines()
    step, generate = trainer.train_step, rollout.generate

    def slow_step(*args, **kwargs):
        out = step(*args, **kwargs)
        for _ in range(40):  # the clock moves while the step runs, as a real one would
            time.sleep(0.01)
            now[0] += 10.0
        return out

    def slow_generate(*args, **kwargs):
        time.sleep(0.3)
        return generate(*args, **kwargs)

    trainer.train_step, rollout.generate = slow_step, slow_generate
    steps = []
    _run_or_fail(Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append))
    trained = collections.Counter(group for m in steps for group in m["groups"])
    assert len(steps) == 6 and set(trained.values()) == {1}
    assert sum(m["dropped"] for m in steps) == 0 and store.consumer_counts("train", "train")["redelivered"] == 0


def test_a_resumed_run_counts_the_restored_stores_samples_in_flight_as_started(tmp_path):
    """A checkpoint's store holds prompts not yet generated and samples not yet trained. A
    run resumed from it admits only what the bound leaves beside them (it once admitted a
    whole window more: 48 samples started against a bound of 32)."""
    from tidal.flow.stages import Stages
    from tidal.flow.store import persist

    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 2})
    trainer, rollout = _engines()
    workflow = None

    def save_at_the_end(metrics):
        if metrics["step"] == cfg.algorithm.num_steps:
            time.sleep(0.5)  # the loader and rollout fill what the bound admits at the last version
            workflow.stages.save(tmp_path / "store.bin")

    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=save_at_the_end)
    _run_or_fail(workflow)
    store = persist.load(tmp_path / "store.bin")
    state = store.state_dict()["partitions"]

    def unacked(partition, consumer):
        return state[partition]["next_index"] - state[partition]["num_evicted"] - len(state[partition]["consumers"][consumer])

    in_flight = cfg.algorithm.group_size * unacked("prompts", "rollout") + unacked("train", "train")
    assert in_flight > 0  # the case this is about
    version = cfg.algorithm.num_steps
    stages = Stages(store=store, prompts=iter(_prompts()), score=_score, config=cfg, version=version)
    assert stages._started == version * cfg.batch_size + in_flight
    started = version * cfg.batch_size + in_flight + stages._admitted(version) * cfg.algorithm.group_size
    window = (cfg.algorithm.max_staleness + version + 1) * cfg.batch_size
    assert window - cfg.algorithm.group_size < started <= window


def test_a_prompt_source_that_runs_out_before_the_last_step_ends_the_run_with_an_error():
    cfg = WorkflowConfig.from_keys(max_staleness=0, **{**CONFIG, "num_steps": 2})  # 2 steps of 2 prompts
    trainer, rollout = _engines()
    steps = []
    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()[:3]), score=_score, config=cfg, on_step=steps.append)
    with pytest.raises(RuntimeError, match=r"the prompt source ran out: 2 steps of 2 prompts need 4 groups, and 3 started"):
        _run_or_fail(workflow)
    assert [m["step"] for m in steps] == [1]

    trainer, rollout = _engines()  # exactly enough: the run ends as it should
    steps = []
    _run_or_fail(Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()[:4]), score=_score, config=cfg, on_step=steps.append))
    assert [m["step"] for m in steps] == [1, 2]


def test_a_run_stopped_while_its_source_blocks_ends_and_its_checkpoint_is_saved(tmp_path, monkeypatch):
    # A prompt source waiting for prompts that never come (a queue whose producer is gone):
    # a stop ends the run, the loader's thread left waiting in the source, and the final
    # checkpoint's save does not wait for it. It once waited forever for the loader's lock.
    from tidal.flow import stages
    from tidal.flow.store import persist

    monkeypatch.setattr(stages, "SOURCE_ON_STOP_S", 0.5)  # how long the run's end waits for the source (5 s)

    blocking, release = threading.Event(), threading.Event()

    def source():
        yield from _prompts(2)  # the first step's
        blocking.set()
        release.wait(120)

    cfg = WorkflowConfig.from_keys(max_staleness=0, **CONFIG)
    trainer, rollout = _engines()
    workflow = None

    def stop_once_the_source_blocks(metrics):
        assert blocking.wait(30)
        workflow.stop()  # as a StopRequest (Ctrl-C) does

    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=source(), score=_score, config=cfg, on_step=stop_once_the_source_blocks)
    try:
        _run_or_fail(workflow, timeout_s=30)
        saving = concurrent.futures.ThreadPoolExecutor(1).submit(workflow.save, tmp_path / "store.bin")
        assert concurrent.futures.wait([saving], timeout=10).done, "the checkpoint's save waited for the source"
    finally:
        release.set()
    assert trainer.version == 1 and saving.result()["prompt_position"] is None  # a plain generator has no position
    assert persist.load(tmp_path / "store.bin").state_dict()["partitions"]["prompts"]["next_index"] == 2


def test_a_stage_error_ends_the_run_while_another_stage_is_still_busy():
    # The prompt source fails while the reward stage is inside a long score call (a remote
    # reward service): the run ends with the source's error at once. It once waited for
    # every stage thread to end first, the trainer still waiting for rows, so a score call
    # that never returned hung the run.
    scoring, release = threading.Event(), threading.Event()

    def source():
        yield _prompts(1)[0]
        scoring.wait(30)
        raise KeyError("prompt 1 has no prompt_ids")

    def stuck_score(trajectories):
        scoring.set()
        release.wait(60)
        return _score(trajectories)

    cfg = WorkflowConfig.from_keys(max_staleness=0, **CONFIG)
    trainer, rollout = _engines()
    store = Store()
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=source(), score=stuck_score, config=cfg)
    put_trajectories(store, _group_of_version(0, cfg.algorithm.group_size))  # rows for the reward stage to score
    try:
        with pytest.raises(KeyError, match="prompt 1 has no prompt_ids"):
            _run_or_fail(workflow, timeout_s=30)
    finally:
        release.set()


def test_a_stop_during_a_step_trains_no_further_step_even_with_the_next_steps_rows_taken():
    # Stopping early lets the trainer finish the step it is in. With max_staleness >= 1 the
    # next step's rows are usually taken while a step trains; the trainer once trained them
    # too after a stop (a whole extra step), where with max_staleness: 0 it stopped at once.
    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 4})
    trainer, rollout = _engines()
    store, steps, taken = Store(), [], threading.Event()
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append)
    train_rows = workflow._train_rows

    def spy(version):
        rows = train_rows(version)
        if version == 1:
            taken.set()
        return rows

    def stop_in_step_one(step_train=trainer.train_step):
        def train_step(*args, **kwargs):
            out = step_train(*args, **kwargs)
            if trainer.version == 1:
                assert taken.wait(30)  # step 2's rows are in the trainer's hands
                workflow.stop()  # as a StopRequest from another thread would, mid-step
            return out

        return train_step

    workflow._train_rows = spy
    trainer.train_step = stop_in_step_one()
    _run_or_fail(workflow)
    assert [m["step"] for m in steps] == [1] and trainer.version == 1
    assert store.consumer_counts("train", "train")["acked"] == cfg.batch_size  # step 2's rows stay leased: a checkpoint saves them untrained


def test_rows_dropped_while_the_step_before_trains_count_in_their_own_steps_metrics():
    # With max_staleness >= 1, step v+1's rows are taken while step v trains, and the sampler
    # drops what is too old for v+1 then. The drop count was read when step v's line was made,
    # so those rows landed on step v's line (the total was right).
    cfg = WorkflowConfig.from_keys(max_staleness=1, **{**CONFIG, "num_steps": 6})
    trainer, rollout = _engines()
    store, steps, dropped = Store(), [], threading.Event()
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append, start_version=4)
    trainer.version = rollout.version = 4
    store.add_change_listener(lambda partition: dropped.set() if store.consumer_counts("train", "train")["dropped"] else None)
    generate, train_step = rollout.generate, trainer.train_step

    def generate_step_5_first(trajectories, **kwargs):
        if trajectories[0].group >= cfg.algorithm.prompts_per_step:  # step 6's prompts: once the old group is dropped
            assert dropped.wait(30)
        return generate(trajectories, **kwargs)

    def train_step_5_with_an_old_group_arriving(*args, **kwargs):
        if trainer.version == 4:  # step 6's rows are being taken (at version 5): version 3 is too old for them
            put_trajectories(store, _group_of_version(3, cfg.algorithm.group_size))
            assert dropped.wait(30)  # dropped while step 5 trains
        return train_step(*args, **kwargs)

    rollout.generate, trainer.train_step = generate_step_5_first, train_step_5_with_an_old_group_arriving
    _run_or_fail(workflow)
    assert [(m["step"], m["dropped"]) for m in steps] == [(5, 0), (6, cfg.algorithm.group_size)]


def test_a_stage_wait_that_spans_a_step_report_counts_on_each_steps_line_as_it_passes():
    # With max_staleness: 0 the reward and advantage stages wait for the next step's rows
    # while a step trains. Their wait used to be counted only once it ended, so a long step
    # 1 showed no such wait, and step 2's line showed step 1's (more seconds than had passed
    # since step 1's line was made).
    cfg = WorkflowConfig.from_keys(max_staleness=0, **CONFIG)
    trainer, rollout = _engines()
    train_step = trainer.train_step

    def slow_first_step(*args, **kwargs):
        if trainer.version == 0:
            time.sleep(1.0)
        return train_step(*args, **kwargs)

    trainer.train_step = slow_first_step
    steps, calls = [], []
    workflow = Workflow(store=Store(), rollout=rollout, trainer=trainer, prompts=iter(_prompts()), score=_score, config=cfg, on_step=steps.append)
    metrics = workflow.stages.metrics

    def timed_metrics():  # (when the call began, when it returned): a step line's waits lie between the calls
        begin = time.perf_counter()
        out = metrics()
        calls.append((begin, time.perf_counter()))
        return out

    workflow.stages.metrics = timed_metrics
    started = time.perf_counter()
    _run_or_fail(workflow)
    since = [started, *(begin for begin, _ in calls[:-1])]
    for stage in ("reward", "advantage", "rollout"):  # rollout: the worker's wait for prompts (its own `Waits`)
        assert steps[0]["wait_s"][stage] >= 0.9  # step 1 trained for a second while they waited
        slack = 0.0 if stage != "rollout" else 0.05  # the rollout group's metrics are taken just after the stages'
        for m, begin, (_, end) in zip(steps, since, calls):
            assert m["wait_s"].get(stage, 0.0) <= end - begin + slack, (m["step"], stage, m["wait_s"], end - begin)
