"""A run resumed from its checkpoint goes on as if it had never stopped.

With `max_staleness: 0` a run repeats itself bit for bit, so a run stopped (or cut off
after a periodic checkpoint) and resumed must end with the uninterrupted run's weights
and metrics. Each run here is a tiny model on a few prompts: under a second.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.tools.stopping import StopRequest

REWARDS = '''
HOOK = None
def token_parity(trajectory, text):
    """A reward the samples split on (so every step changes the weights), with a hook a test sets."""
    if HOOK is not None:
        HOOK(trajectory)
    return float(sum(map(ord, text)) % 2)
'''

TINY = [
    "task.reward=resume_rewards:token_parity", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8",
    "algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.max_staleness=0", "algorithm.num_steps=4",
    "threads=1", "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


@pytest.fixture
def rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    folder = tmp_path / "rewards"
    folder.mkdir()
    (folder / "resume_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "resume_rewards", raising=False)
    import resume_rewards

    yield resume_rewards
    sys.modules.pop("resume_rewards", None)


def _run(run_dir: Path, *overrides: str, stop: StopRequest | None = None) -> dict[str, Any]:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*TINY, f"run_dir={run_dir}", *overrides])
    return train(cfg, made, progress=False, stop=stop)


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    """Each step's metrics, less what depends on timing."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in ("time", "step_s", "wait_s")} for m in lines]


def _assert_same_run(full: Path, resumed: Path, *, from_step: int) -> None:
    assert [m["step"] for m in _steps(resumed)] == list(range(from_step + 1, 5))
    assert _steps(resumed) == _steps(full)[from_step:]
    a, b = _weights(full, 4), _weights(resumed, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_resumed_from_a_periodic_checkpoint_repeats_the_uninterrupted_run(tmp_path, rewards, monkeypatch):
    """The periodic checkpoint is written after the step's weights went to rollout, which
    may be generating the next step's samples meanwhile (made sure of here: the save waits
    for rollout to have sampled them, and rollout puts them in the store only after the
    save, as with a larger model, whose generation and save both take a while). The RNG
    state and the store a checkpoint saves must agree, so that the resumed run repeats the
    uninterrupted one."""
    from tidal.tools import checkpoint as checkpoint_module
    from tidal.tools import train as train_module

    sampled, saved = threading.Event(), threading.Event()
    generate, save_model, save_checkpoint = HFRolloutEngine.generate, checkpoint_module.save_model, train_module.save_checkpoint

    def slow_generate(self: HFRolloutEngine, *args: Any, **kwargs: Any) -> Any:
        out = generate(self, *args, **kwargs)
        if self.version == 2:
            sampled.set()
            saved.wait(timeout=2)
        return out

    def save_model_after_sampling(model: Any, tokenizer: Any, path: Path) -> None:
        if Path(path).name == "step-000002.tmp":
            sampled.wait(timeout=1)
        save_model(model, tokenizer, path)

    def noted_save_checkpoint(*args: Any, **kwargs: Any) -> Path:
        try:
            return save_checkpoint(*args, **kwargs)
        finally:
            saved.set()

    full = tmp_path / "full"
    with monkeypatch.context() as patched:
        patched.setattr(HFRolloutEngine, "generate", slow_generate)
        patched.setattr(checkpoint_module, "save_model", save_model_after_sampling)
        patched.setattr(train_module, "save_checkpoint", noted_save_checkpoint)
        _run(full, "checkpoint_every=2")
    cut = tmp_path / "cut"  # the run as a crash after its step-2 checkpoint left it
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    resumed = tmp_path / "resumed"
    _run(resumed, f"resume={cut}")
    _assert_same_run(full, resumed, from_step=2)


def test_a_finished_run_continued_for_more_steps_repeats_the_longer_run(tmp_path, rewards):
    """Its final checkpoint is written after the workflow stopped, while rollout may have
    generated (or begun to) the samples of the step after the last."""
    full, short, longer = tmp_path / "full", tmp_path / "short", tmp_path / "longer"
    _run(full)
    _run(short, "algorithm.num_steps=2")
    _run(longer, f"resume={short}")
    _assert_same_run(full, longer, from_step=2)


@pytest.mark.parametrize("where", ["generating", "generating the second half", "scoring"])
def test_a_run_stopped_during_a_step_and_resumed_repeats_the_uninterrupted_run(tmp_path, rewards, monkeypatch, where):
    """A stop asked while rollout generates step 3's samples (they are thrown away; with
    one prompt per generation, while it generates the second: the first one's are kept),
    or while they are scored (they are in the store): the checkpoint at step 2 resumes to
    the same run."""
    one_by_one = ["rollout.prompts_per_generate=1"] if where == "generating the second half" else []
    full = tmp_path / "full"
    _run(full, *one_by_one)
    stop, stopped = StopRequest(), tmp_path / "stopped"
    generate, calls = HFRolloutEngine.generate, []

    def stopping_generate(self: HFRolloutEngine, *args: Any, **kwargs: Any) -> Any:
        calls.extend([self.version] if self.version == 2 else [])
        if len(calls) == (2 if one_by_one else 1):
            stop.request("test")
        return generate(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        if where.startswith("generating"):
            patched.setattr(HFRolloutEngine, "generate", stopping_generate)
        else:
            patched.setattr(rewards, "HOOK", lambda trajectory: stop.request("test") if max(trajectory.versions) == 2 else None)
        summary = _run(stopped, *one_by_one, stop=stop)
    assert summary["stopped_early"] == "test" and summary["steps"] == 2
    resumed = tmp_path / "resumed"
    _run(resumed, *one_by_one, f"resume={stopped}")
    _assert_same_run(full, resumed, from_step=2)


DRIVER = """
import os, signal, sys
from pathlib import Path
from tidal.tools import checkpoint
save_model = checkpoint.save_model
def signalled_save_model(model, tokenizer, path):
    if Path(path).name == "step-000004.tmp":  # the final checkpoint, after the last step
        os.kill(os.getpid(), signal.{signal})
    save_model(model, tokenizer, path)
checkpoint.save_model = signalled_save_model
from tidal.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("signal_name", "exit_code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_during_the_final_checkpoint_still_saves_it(tmp_path, signal_name, exit_code):
    """Ctrl-C or SIGTERM (a scheduler preempting the job) after the last step, while the
    final checkpoint is written: it is completed, and the run stops as asked (no final
    evaluation) with the resume command, instead of dying and losing every step since the
    last periodic checkpoint."""
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.replace("{signal}", signal_name))
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith("task.reward=")]
    out = subprocess.run([sys.executable, str(driver), "run", "quickstart_cpu", *tiny, f"run_dir={run_dir}", "--no-progress"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == exit_code, out.stderr[-3000:]
    assert f"interrupted ({signal_name}), after saving a checkpoint" in out.stderr and "Traceback" not in out.stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert {"model.safetensors", "trainer.pt", "store.bin", "state.json"} <= {p.name for p in (run_dir / "checkpoints" / "step-000004").iterdir()}
    assert json.loads((run_dir / "summary.json").read_text())["stopped_early"] == signal_name
    assert f"resume={run_dir}" in out.stderr
