"""Every row the trainer's staleness filter drops is counted in exactly one step's `dropped`,
also across a resume: a drop made by the next step's prefetch before a checkpoint is saved
is in that checkpoint's store, so the resumed run's first step reports it (a run killed
after such a save once lost 16 prompts from its lineage's count)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.flow.test_overlong import MAX_NEW_TOKENS, RecordingTrainer, ScriptedRollout
from tidal.flow.store import Store, persist
from tidal.flow.workflow import Workflow, WorkflowConfig

NUM_STEPS = 4


class LaggingRollout(ScriptedRollout):
    """Stamps its tokens version 0 until version 2's weights arrive, whatever version it
    holds: the rows made meanwhile are as old as a group's first tokens are when it paused
    under version 0 and went on under version 1 (partial rollout), and too old for step 3
    (max_staleness 1)."""

    def generate(self, trajectories: Any, **kwargs: Any) -> list[Any]:
        version = self.version
        self.version = version if version >= 2 else 0
        try:
            return super().generate(trajectories, **kwargs)
        finally:
            self.version = version


class WaitingTrainer(RecordingTrainer):
    """Trains step 2 only once the store has dropped a row: step 3's prefetch, taken while
    step 2 trains, drops the lagging rollout's version-0 rows then (as a step that takes
    longer than generating would let it)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store

    def train_step(self, batch: Any, advantages: Any, **kwargs: Any) -> dict[str, float]:
        if self.version == 1:
            deadline = time.monotonic() + 10
            while _dropped(self.store) == 0:
                assert time.monotonic() < deadline, "step 3's prefetch dropped nothing"
                time.sleep(0.01)
        return super().train_step(batch, advantages, **kwargs)


def _config() -> WorkflowConfig:
    return WorkflowConfig.from_keys(num_steps=NUM_STEPS, prompts_per_step=2, group_size=4, max_staleness=1, max_new_tokens=MAX_NEW_TOKENS, prompts_per_generate=1, tis_cap=None, decoupled=False)


def _prompts() -> Any:
    return iter([{"prompt_ids": [1, 2], "answer": "x"}] * 1000)


def _score(trajectories: Any) -> tuple[list[float], list[int]]:
    return [float(t.num_generated < 8) for t in trajectories], []


def _dropped(store: Store) -> int:
    return store.consumer_counts("train", "train")["dropped"]


def test_drops_made_before_a_checkpoint_by_the_next_steps_prefetch_are_counted_after_a_resume(tmp_path: Path):
    steps: list[dict[str, Any]] = []
    saved: dict[str, Any] = {}
    store = Store()

    def on_step(m: dict[str, Any]) -> None:
        steps.append(m)
        if m["step"] == 2:  # with the rows step 3's prefetch dropped
            saved.update(workflow.save(tmp_path / "store.bin"))

    workflow = Workflow(store=store, rollout=LaggingRollout(), trainer=WaitingTrainer(store), prompts=_prompts(), score=_score, config=_config(), on_step=on_step)
    workflow.run()
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert sum(m["dropped"] for m in steps) == _dropped(store) > 0  # the uninterrupted run counts each drop once

    # the run as a crash right after that save left it: steps 3 and 4 again, from the saved store
    resumed_store = persist.load(tmp_path / "store.bin")
    before = _dropped(resumed_store)
    assert before > sum(m["dropped"] for m in steps[:2])  # drops in the store that no reported step counted
    trainer = RecordingTrainer()
    trainer.version = 2
    resumed: list[dict[str, Any]] = []
    rollout = LaggingRollout()
    rollout.version = 2
    Workflow(store=resumed_store, rollout=rollout, trainer=trainer, prompts=_prompts(), score=_score, config=_config(), on_step=resumed.append, totals=saved["totals"]).run()
    assert [m["step"] for m in resumed] == [3, 4]
    lineage = [*steps[:2], *resumed]
    assert sum(m["dropped"] for m in lineage) == _dropped(resumed_store)
    assert resumed[0]["dropped"] >= before - sum(m["dropped"] for m in steps[:2])
