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

from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.tools.stopping import StopRequest

REWARDS = '''
HOOK = None
def token_parity(trajectory, text):
    """A reward the samples split on (so every step changes the weights), with a hook a test sets."""
    if HOOK is not None:
        HOOK(trajectory)
    return float(sum(map(ord, text)) % 2)

def parity_or_fails(trajectory, text):
    """`token_parity`, raising on about a third of the texts (rows counted in `failed_rewards`)."""
    if sum(map(ord, text)) % 3 == 0:
        raise ValueError("no reward for this text")
    return token_parity(trajectory, text)
'''

TINY = [
    "task.reward=resume_rewards:token_parity", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8",
    "algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.max_staleness=0", "algorithm.num_steps=4",
    "threads=1", "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


@pytest.fixture
def rewards(reward_module) -> Any:
    return reward_module("resume_rewards", REWARDS)


def _run(run_dir: Path, *overrides: str, stop: StopRequest | None = None) -> dict[str, Any]:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*TINY, f"run_dir={run_dir}", *overrides])
    return train(cfg, made, progress=False, stop=stop)


def test_a_run_resumed_from_a_periodic_checkpoint_repeats_the_uninterrupted_run(runs, tmp_path, rewards, monkeypatch):
    """The periodic checkpoint is written after the step's weights went to rollout, which
    may be generating the next step's samples meanwhile (made sure of here: the save waits
    for rollout to have sampled them, and rollout puts them in the store only after the
    save, as with a larger model, whose generation and save both take a while). The RNG
    state and the store a checkpoint saves must agree, so that the resumed run repeats the
    uninterrupted one."""
    from tidal.tools import checkpoint as checkpoint_module
    from tidal.tools import rl as rl_module  # where the RL phase saves its checkpoints

    sampled, saved = threading.Event(), threading.Event()
    generate, save_model, save_checkpoint = HFRolloutEngine.generate, checkpoint_module.save_model, rl_module.save_checkpoint

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
        patched.setattr(rl_module, "save_checkpoint", noted_save_checkpoint)
        _run(full, "checkpoint_every=2")
    cut = tmp_path / "cut"  # the run as a crash after its step-2 checkpoint left it
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    resumed = tmp_path / "resumed"
    _run(resumed, f"resume={cut}")
    runs.assert_same(full, resumed, from_step=2)


def test_a_finished_run_continued_for_more_steps_repeats_the_longer_run(runs, tmp_path, rewards):
    """Its final checkpoint is written after the workflow stopped, while rollout may have
    generated (or begun to) the samples of the step after the last."""
    full, short, longer = tmp_path / "full", tmp_path / "short", tmp_path / "longer"
    _run(full)
    _run(short, "algorithm.num_steps=2")
    _run(longer, f"resume={short}")
    runs.assert_same(full, longer, from_step=2)
    assert [m["step"] for m in runs.steps(longer)] == [1, 2, 3, 4]  # the run's record, short's steps copied


def test_a_run_resumed_from_a_periodic_checkpoint_goes_on_along_its_lr_schedule(runs, tmp_path, rewards):
    """Warmup and cosine: the checkpoint keeps the schedule's position, so the resumed run's
    steps train at the uninterrupted run's lr (a fresh schedule would warm up again)."""
    schedule = ["train.lr=0.03", "train.lr_schedule=cosine", "train.warmup_steps=1", "train.min_lr_ratio=0.1", "checkpoint_every=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(full, *schedule)
    assert [m["lr"] for m in runs.steps(full)] == pytest.approx([0.015, 0.03, 0.0165, 0.003])  # warmup 1/2, then 1, 0.55 (midpoint), 0.1
    cut = tmp_path / "cut"
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    _run(resumed, *schedule, f"resume={cut}")
    runs.assert_same(full, resumed, from_step=2)


def test_a_run_resumed_in_a_new_directory_keeps_one_record_of_every_step(runs, tmp_path, rewards, monkeypatch):
    """A crash after step 3, its last checkpoint step 2's: the new directory's metrics.jsonl
    holds steps 1-2 from the resumed run (not its step 3, which is taken again) and then its
    own, each once, and progress.png is drawn from all of them. The resumed run's file stays."""
    from tidal.tools import train as train_module

    drawn = []
    plot = train_module.plot
    monkeypatch.setattr(train_module, "plot", lambda metrics, *args, **kwargs: drawn.append([m["step"] for m in metrics]) or plot(metrics, *args, **kwargs))
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(full, "checkpoint_every=2")
    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    (crashed / "checkpoints" / "latest").write_text("step-000002\n")
    (crashed / "metrics.jsonl").write_text("".join((full / "metrics.jsonl").read_text().splitlines(keepends=True)[:3]) + '{"step": 4, "rew')  # step 3, and half a line
    _run(resumed, "checkpoint_every=2", f"resume={crashed}")
    assert [m["step"] for m in runs.steps(resumed)] == [1, 2, 3, 4]
    runs.assert_same(full, resumed, from_step=2)
    assert drawn[-1] == [1, 2, 3, 4] and (resumed / "progress.png").exists()
    assert len((crashed / "metrics.jsonl").read_text().splitlines()) == 4  # left as it was


def test_a_resumed_run_goes_on_counting_the_runs_totals(runs, tmp_path, rewards):
    """`failed_rewards` (like `paused_generations`, `handed_off` and `handoffs`) counts since
    the run started: the checkpoint keeps it, and the continued run's lines and summary are
    the longer run's (they once counted from 0 again)."""
    failing = "task.reward=resume_rewards:parity_or_fails"
    full, short, longer = tmp_path / "full", tmp_path / "short", tmp_path / "longer"
    full_summary = _run(full, failing)
    _run(short, failing, "algorithm.num_steps=2")
    summary = _run(longer, failing, f"resume={short}")
    counts = [m["failed_rewards"] for m in runs.steps(full)]
    assert 0 < counts[1] < counts[-1], counts  # failures before the checkpoint and after it
    runs.assert_same(full, longer, from_step=2)
    assert summary["failed_rewards"] == full_summary["failed_rewards"] == counts[-1]
    assert summary["first_reward"] == full_summary["first_reward"] and summary["resumed_at"] == 2 and "resumed_at" not in full_summary


def test_totals_saved_with_a_checkpoint_carry_through_every_later_resume(runs, tmp_path, rewards):
    """Each count goes on from the checkpoint's totals, through a resume of a resumed run;
    with rollout taking turns on the trainer's (fake) device, `handoffs` too."""
    colocated = ["device=fake:cuda:1", "placement.rollout.colocate_with=train"]
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    _run(first, *colocated, "algorithm.num_steps=2")
    path = first / "checkpoints" / "step-000002" / "state.json"
    state = json.loads(path.read_text())
    earlier = {"failed_rewards": 1000, "reward_timeouts": 600, "paused_generations": 2000, "handed_off": 3000, "handoffs": 4000, "silent_rollouts": 5000}
    assert set(state["totals"]) == {*earlier, "reported_dropped"}  # and the stale rows the steps counted (`flow.workflow`)
    path.write_text(json.dumps({**state, "totals": {**state["totals"], **earlier}}))  # as a long run would have left them
    _run(second, *colocated, "algorithm.num_steps=3", f"resume={first}")
    summary = _run(third, *colocated, "algorithm.num_steps=4", f"resume={second}")
    assert runs.steps(second) == runs.steps(first) + runs.steps(second)[2:]  # the run's record: each step once
    assert runs.steps(third)[:3] == runs.steps(second)
    steps = runs.steps(third)[2:]
    assert [m["step"] for m in steps] == [3, 4]
    assert all(m[key] >= earlier[key] for m in steps for key in earlier), steps
    assert earlier["handoffs"] < steps[0]["handoffs"] < steps[1]["handoffs"]  # the devices changed hands in each step
    assert all(summary[key] == steps[-1][key] for key in ("failed_rewards", "paused_generations", "handed_off"))
    saved = json.loads((third / "checkpoints" / "step-000004" / "state.json").read_text())["totals"]
    assert all(saved[key] >= steps[-1][key] for key in earlier)


@pytest.mark.slow
def test_a_run_resumed_under_ray_goes_on_from_the_checkpoints_totals(runs, tmp_path, rewards, tidal_cli):
    """`runtime: ray` counts rollout's totals in its actors (`RayRollouts`): they go on from
    the checkpoint too, and the run's summary (written by the driver) says so."""
    first, second = tmp_path / "first", tmp_path / "second"
    _run(first, "algorithm.num_steps=2")
    path = first / "checkpoints" / "step-000002" / "state.json"
    earlier = {"failed_rewards": 1000, "paused_generations": 2000, "handed_off": 3000}
    path.write_text(json.dumps({**json.loads(path.read_text()), "totals": earlier}))
    env = {"PYTHONPATH": str(Path(rewards.__file__).parent), "RAY_AUTH_MODE": "disabled"}
    out = tidal_cli("run", "quickstart_cpu", *TINY, "runtime=ray", f"resume={first}", f"run_dir={second}", "--no-progress", env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [m for m in runs.steps(second) if m["step"] > 2]  # after the first run's steps 1-2, which the record keeps
    assert [m["step"] for m in runs.steps(second)] == [1, 2, 3, 4]
    assert [m["step"] for m in steps] == [3, 4] and all(m[key] >= earlier[key] for m in steps for key in earlier), steps
    summary = json.loads((second / "summary.json").read_text())
    assert summary["resumed_at"] == 2 and all(summary[key] == steps[-1][key] for key in earlier)


@pytest.mark.parametrize("where", ["generating", "generating the second half", "scoring"])
def test_a_run_stopped_during_a_step_and_resumed_repeats_the_uninterrupted_run(runs, tmp_path, rewards, monkeypatch, where):
    """A stop asked while rollout generates step 3's samples (they are thrown away; with
    one prompt per generation, while it generates the second: the first one's are kept),
    or while they are scored (they are in the store): the checkpoint at step 2 resumes to
    the same run."""
    # one generate call per prompt (continuous batching would take the next prompt into the same call)
    one_by_one = ["rollout.prompts_per_generate=1", "rollout.continuous_batching=false"] if where == "generating the second half" else []
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
    runs.assert_same(full, resumed, from_step=2)


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


def test_a_run_that_leaves_out_groups_without_signal_resumes_as_it_ran(runs, tmp_path, rewards):
    """`algorithm.filter_groups`: which groups are left out, how many prompts start in their
    place and each step's `filtered_groups` are the uninterrupted run's after a resume."""
    keys = ["algorithm.filter_groups=true", "algorithm.group_size=2", "checkpoint_every=2"]  # pairs: half of them tie
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(full, *keys)
    steps = runs.steps(full)
    assert all(m["filtered_groups"] >= 0 for m in steps) and sum(m["filtered_groups"] for m in steps[2:]) > 0, steps
    assert all(len(set(pair)) == 2 for m in steps for pair in m["rewards"])  # every trained group's rewards differ
    cut = tmp_path / "cut"
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    _run(resumed, *keys, f"resume={cut}")
    runs.assert_same(full, resumed, from_step=2)


def test_a_ppo_run_with_a_critic_resumes_as_it_ran(runs, tmp_path, rewards):
    """`algorithm.advantage=gae`: the critic's weights and AdamW state are in each checkpoint,
    so after a resume its values, the advantages and the policy's steps are the uninterrupted
    run's (a fresh critic would give other values from the first resumed step)."""
    keys = ["algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=6", "critic.lr=0.01", "checkpoint_every=2"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(full, *keys)
    steps = runs.steps(full)
    assert all(m["value_loss"] > 0 and m["samples"] == 6 for m in steps) and steps[2]["values_mean"] != 0  # the critic trained, and its values moved
    cut = tmp_path / "cut"
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    _run(resumed, *keys, f"resume={cut}")
    runs.assert_same(full, resumed, from_step=2)
