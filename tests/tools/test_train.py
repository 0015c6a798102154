"""`tools/train.py` helpers that the quickstart tests do not isolate."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.files import write_whole
from tidal.flow.store import Store, persist
from tidal.tools.checkpoint import prune_checkpoints, save_checkpoint, truncate_metrics
from tidal.tools.config import load_config, stage_threads
from tidal.tools.run import _new_run_dir, latest_checkpoint
from tidal.tools.train import task_prompts, torch_threads, warm_start, workflow_config


def test_torch_threads_reach_stage_threads_started_inside_and_are_restored_after():
    before = torch.get_num_threads()
    wanted = before + 1  # differs from the default on any machine, so the check can fail
    seen: list[int] = []
    with torch_threads(wanted):
        assert torch.get_num_threads() == wanted
        stage = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # as the workflow starts rollout
        stage.start()
        stage.join()
    assert seen == [wanted]
    assert torch.get_num_threads() == before  # the evaluation after RL gets torch's default again


def test_torch_threads_zero_leaves_the_default():
    before = torch.get_num_threads()
    with torch_threads(0):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("overrides", "rollout", "train"),
    [([], 0, 0), (["threads=2"], 2, 2), (["threads=2", "rollout.threads=1"], 1, 2), (["train.threads=3"], 0, 3)],
)
def test_each_rl_stage_takes_its_own_threads_else_the_runs(overrides, rollout, train):
    cfg = load_config(None, overrides)
    assert (stage_threads(cfg, "rollout"), stage_threads(cfg, "train")) == (rollout, train)
    assert workflow_config(cfg).rollout_threads == rollout


def test_prune_checkpoints_keeps_the_newest_and_never_the_latest(tmp_path):
    for name in ("step-000010", "step-000020", "step-000030", "step-000100", "step-000040.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer.pt").write_text("x")
    (tmp_path / "latest").write_text("step-000100\n")
    assert prune_checkpoints(tmp_path, keep=2, latest="step-000100") == ["step-000010", "step-000020"]  # by step, not by name length
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000030", "step-000040.tmp", "step-000100"]
    assert prune_checkpoints(tmp_path, keep=1, latest="step-000030") == []  # the one `latest` names stays, whatever its age
    assert (tmp_path / "step-000030").is_dir() and (tmp_path / "step-000100").is_dir()


def test_a_checkpoint_reaches_the_disk_before_latest_names_it_and_older_ones_go(tmp_path, monkeypatch):
    """Every file of the checkpoint, its folder, and `latest` are flushed (fsync) before
    `latest` is replaced and before anything older is pruned: after a power loss `latest`
    never names files that did not reach the disk."""
    import os

    from tidal.tools import checkpoint as checkpoint_module

    tokenizer = CharTokenizer()
    model = lambda: build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    trainer = TorchTrainEngine(model(), version=1)
    synced, events = set(), []
    fsync, replace, rmtree = os.fsync, os.replace, checkpoint_module.shutil.rmtree

    def noted_fsync(fd: int) -> None:
        synced.add(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        fsync(fd)

    def noted_replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "latest":  # not the store's own replace (persist.save)
            events.append(("latest", set(synced)))
        replace(src, dst)

    def noted_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("prune", set(synced)))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.os, "fsync", noted_fsync)
    monkeypatch.setattr(checkpoint_module.os, "replace", noted_replace)
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", noted_rmtree)
    save_data = lambda path: persist.save(Store(), path) or {"prompt_position": 0}
    save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={})
    synced.clear()
    events.clear()
    trainer.version = 2
    save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={}, keep=1)
    files = {p.name for p in (tmp_path / "checkpoints" / "step-000002").iterdir()}
    assert {"model.safetensors", "trainer.pt", "store.bin", "state.json", "tokenizer.json", "config.json"} <= files
    kinds = [what for what, _ in events]
    assert kinds.count("latest") == 1 and "prune" in kinds[kinds.index("latest") :]  # step 1 is pruned after
    assert files | {"step-000002.tmp", "latest.tmp"} <= events[kinds.index("latest")][1]
    assert all(files | {"checkpoints"} <= before for what, before in events if what == "prune")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000002"]


def test_saving_the_step_latest_names_again_never_leaves_latest_without_a_checkpoint(tmp_path, monkeypatch):
    """A resumed finished run saves the step `latest` names once more: the old folder is
    set aside until the new one is in place, so a crash between the renames still resumes."""
    tokenizer = CharTokenizer()
    template = build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    trainer = TorchTrainEngine(build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), version=5)

    def save(n: int) -> Path:
        def save_data(path: Path) -> dict[str, int]:  # the store, and the prompt position then
            persist.save(Store(), path)
            return {"prompt_position": n}

        return save_checkpoint(tmp_path, trainer=trainer, template=template, tokenizer=tokenizer, save_data=save_data, extra={})

    def saved_position() -> int:
        return json.loads((latest_checkpoint(tmp_path) / "state.json").read_text())["prompt_position"]

    save(1)
    save(2)
    assert saved_position() == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000005"]

    rename = Path.rename

    def crash_on_the_new_one(self: Path, target: Path) -> Path:
        if self.name.endswith(".tmp"):
            raise OSError("killed between the renames")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_the_new_one)
    with pytest.raises(OSError, match="between the renames"):
        save(3)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step-000005"  # a save that fails puts back the one it set aside
    assert saved_position() == 2 and not (tmp_path / "checkpoints" / "step-000005.old").exists()
    (tmp_path / "checkpoints" / "step-000005").rename(tmp_path / "checkpoints" / "step-000005.old")  # a kill there leaves it set aside
    assert latest_checkpoint(tmp_path).name == "step-000005.old"  # the one set aside, complete
    assert saved_position() == 2 and (latest_checkpoint(tmp_path) / "trainer.pt").is_file()
    (tmp_path / "checkpoints" / "step-000003.tmp").mkdir()  # an older save a crash cut short
    (tmp_path / "checkpoints" / "step-000003.tmp" / "model.safetensors").write_bytes(b"half")
    save(4)  # the next save completes and removes what was set aside, and what crashes left
    assert saved_position() == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000005"]


def test_countdown_prompts_follow_the_recipe_and_warm_start_on_their_reference_solutions():
    cfg = load_config(None, ["task.name=countdown", "task.num_numbers=2", "task.max_number=4", "sft.steps=3", "sft.batch_size=8"])
    items = task_prompts(cfg, 50, seed=0)
    assert all(len(item["numbers"]) == 2 and max(item["numbers"]) <= 4 for item in items)
    tokenizer = CharTokenizer()
    engine = TorchTrainEngine(build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), lr=1e-2)
    losses = warm_start(engine, cfg, tokenizer, held_out=set())  # countdown items carry an `answer` to imitate
    assert len(losses) == 3 and all(loss > 0 for loss in losses)


def test_a_run_freezes_what_setup_made_for_the_cyclic_gc_and_unfreezes_it_after(monkeypatch):
    import gc

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the recipe names the reward by module, as a user's would be
    import tidal_test_rewards

    from tidal.tools.bench.e2e import run_tidal

    tidal_test_rewards.frozen_counts.clear()
    small = ["task.num_eval_prompts=8", "sft.steps=2", "algorithm.prompts_per_step=2", "algorithm.group_size=2", "threads=1", "task.reward=tidal_test_rewards:records_gc_freeze"]
    summary = run_tidal(["algorithm.max_staleness=1"], seed=0, num_steps=2, overrides=small)
    assert summary["steps"] == 2
    assert max(tidal_test_rewards.frozen_counts) > 1000  # the model, optimizer, tokenizer...: frozen during the run (the held-out evaluations before and after score with it too)
    assert gc.get_freeze_count() == 0  # and free to be collected after it


def test_a_precision_the_platform_lacks_fails_before_the_warm_start_naming_the_key(tmp_path, monkeypatch):
    from tidal.hal import current_platform
    from tidal.tools import train as train_module
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    cfg, run_dir = prepare_run(resolve_recipe("quickstart_cpu"), [f"run_dir={tmp_path / 'run'}", "train.precision=bf16"])
    monkeypatch.setattr(current_platform(), "dtype_support", lambda: {"bf16": False, "fp16": True, "fp64": True, "fp8": False})
    monkeypatch.setattr(train_module, "warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    with pytest.raises(ConfigError, match=r"train.precision=bf16: this cpu platform has no bf16 arithmetic .*use precision fp32"):
        train_module.train(cfg, run_dir, progress=False)


def test_a_run_resumed_in_its_own_directory_keeps_its_steps_and_drops_a_line_cut_short(tmp_path):
    """A trainer killed while it wrote a step's line leaves half a line; its restart
    (`resume=` its own run directory) keeps the steps up to its checkpoint and goes on."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "rew')
    truncate_metrics(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_threads_writing_the_same_file_whole_each_leave_one_whole_version(tmp_path):
    """`write_whole` from two threads of one process (a Ray run's info file: the actors'
    restarts and the run's end): each write goes through a temporary file of its own, so
    none fails for want of it and the file ends as one write's text, never a mix."""
    path, errors = tmp_path / "info.json", []

    def write(text: str) -> None:
        for _ in range(300):
            try:
                write_whole(path, text)
            except OSError as e:
                errors.append(e)

    threads = [threading.Thread(target=write, args=(c * 20_000,)) for c in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert path.read_text() in ("a" * 20_000, "b" * 20_000)
    assert [p.name for p in tmp_path.iterdir()] == ["info.json"]


def test_runs_started_in_the_same_second_get_a_directory_each(tmp_path, monkeypatch):
    import tidal.tools.run as run

    monkeypatch.setattr(run.time, "strftime", lambda fmt: "20261125-120000")
    cfg = load_config(None, [f"output_dir={tmp_path / 'runs'}"])
    dirs = [_new_run_dir(cfg) for _ in range(3)]
    assert [d.name for d in dirs] == [f"{cfg.name}-20261125-120000", f"{cfg.name}-20261125-120000-1", f"{cfg.name}-20261125-120000-2"]


def test_evaluation_scores_an_answer_whose_reward_fails_as_wrong():
    """A reward function that raises on some answers scores them 0 in the held-out
    evaluation too, as in RL (it once stopped the run, after its last step)."""
    from tidal.tools.train import evaluate

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=0)
    items = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(4)]

    def picky(trajectory, text):
        if trajectory.meta["answer"] % 2:
            raise RuntimeError("cannot score odd answers")
        return 1.0

    assert evaluate(model, tokenizer, items, picky, max_new_tokens=2).accuracy == 0.5


def test_evaluation_gives_the_reward_the_answer_as_rl_does_and_scores_in_the_runs_pool_under_its_timeout(tmp_path, monkeypatch):
    """Held-out answers reach the reward as RL's do (prompt ids, generated tokens through the
    end token, finish reason), and with the run's scorer they are scored in its worker pool:
    a reward that hangs times out and scores 0 instead of stopping the run."""
    from tidal.tools.rl import make_score
    from tidal.tools.train import evaluate

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=0)
    items = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(4)]
    seen = []

    def records(trajectory, text):
        seen.append((trajectory.prompt_ids, list(trajectory.tokens), trajectory.finish_reason, text))
        return 1.0

    assert evaluate(model, tokenizer, items, records, max_new_tokens=3).accuracy == 1.0
    assert [prompt for prompt, *_ in seen] == [tokenizer.encode(item["prompt"]) for item in items]
    for _, tokens, reason, text in seen:
        ends = [k for k, t in enumerate(tokens) if t in tokenizer.eos_ids]
        assert (reason == "stop") == bool(ends) and (not ends or ends == [len(tokens) - 1]) and len(tokens) <= 3
        assert text == tokenizer.decode(tokens[:-1] if ends else tokens)

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = load_config(None, ["task.reward=tidal_test_rewards:hangs", "task.reward_workers=1", "task.reward_timeout_s=0.5"])
    scorer = make_score(cfg, tokenizer)
    try:
        started = time.monotonic()
        assert evaluate(model, tokenizer, items, scorer.reward, max_new_tokens=3, scorer=scorer).accuracy == 0.0
        assert time.monotonic() - started < 60
    finally:
        scorer.close()


def test_checkpoint_rng_is_the_platforms_and_loads_from_another_platforms_checkpoint(caplog):
    """The checkpoint's RNG state is the platform's: host generators and one state per device
    (rollout samples from the device's). A state from a GPU run, resumed on a platform
    without those devices, restores the host generators and says the rest was not."""
    import random

    from tidal.tools.checkpoint import rng_state, set_rng_state

    state = rng_state()
    assert set(state) == {"python", "numpy", "torch", "device"}
    expected_python, expected_torch = random.random(), torch.rand(2)
    for saved in (state, {k: v for k, v in state.items() if k != "device"}, {**state, "device": [torch.zeros(16, dtype=torch.uint8)]}):
        set_rng_state(saved)  # this one, one saved before device states were, one with a GPU's
        assert random.random() == expected_python and torch.equal(torch.rand(2), expected_torch)
    assert "device RNG states do not fit this platform" in caplog.text


def test_a_task_whose_every_prompt_is_held_out_is_an_error_not_an_endless_stream(monkeypatch):
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.train import Prompts, held_out_prompts

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["task.max_value=2", "task.exclude_eval_prompts=true"])
    _, held_out = held_out_prompts(cfg)  # 200 drawn: every one of the task's 18 sums
    monkeypatch.setattr(Prompts, "MAX_SKIPPED", 5_000)
    with pytest.raises(ConfigError, match="task.exclude_eval_prompts=true leaves no prompt to train on"):
        next(iter(Prompts(cfg, CharTokenizer(), held_out)))
    cfg = load_config(resolve_recipe("quickstart_cpu"), ["task.max_value=9", "task.exclude_eval_prompts=true"])
    _, held_out = held_out_prompts(cfg)
    item = next(iter(Prompts(cfg, CharTokenizer(), held_out)))  # a larger task: prompts outside the held-out set
    assert item["prompt"] not in held_out


def test_held_out_countdown_problems_stay_out_of_training_in_any_order_of_their_numbers():
    """A countdown problem is its numbers and target: drawn again with the numbers in another
    order (another prompt text) it is still held out (3,660 of the first 51,200 prompts
    were, with seed 0, when only the exact text was)."""
    import itertools

    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.train import Prompts, held_out_prompts

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["task.name=countdown", "task.exclude_eval_prompts=true", "model.max_positions=128"])
    items, held_out = held_out_prompts(cfg)
    problems = {(tuple(sorted(item["numbers"])), item["target"]) for item in items}
    assert held_out == problems
    trained = list(itertools.islice(Prompts(cfg, CharTokenizer(), held_out), 5_000))
    assert not {(tuple(sorted(item["numbers"])), item["target"]) for item in trained} & problems


def test_a_plan_that_cannot_be_placed_stops_the_run_before_its_directory(tmp_path):
    """`tidal run` (and `--check`) make the plan when the recipe lists its cluster or shares
    devices in one process; a local run found out after its warm start."""
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    for recipe, overrides in (
        ("quickstart_cpu", ["placement.rollout.colocate_with=train", "placement.rollout.requires=[gpu]"]),
        ("mixed_npu_gpu", ["placement.rollout.count=9"]),
    ):
        with pytest.raises(ConfigError, match="placement: .*role 'rollout'"):
            prepare_run(resolve_recipe(recipe), [*overrides, f"run_dir={tmp_path / recipe}"])
        assert not (tmp_path / recipe).exists()


def test_a_resume_is_checked_against_its_checkpoint(tmp_path):
    """Against the checkpoint itself: its model (the run's config.yaml may be gone), and a
    `latest` that names a folder that is not there. (A finished run resumed with no step
    left is allowed: its new directory gets the checkpoint, as test_cli checks.)"""
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import _new_run_dir, resume_changes

    recipe = resolve_recipe("quickstart_cpu")
    old = tmp_path / "old"
    (old / "checkpoints" / "step-000003").mkdir(parents=True)
    (old / "checkpoints" / "latest").write_text("step-000003")
    (old / "checkpoints" / "step-000003" / "config.json").write_text(json.dumps({"hidden_size": 192, "num_hidden_layers": 3, "max_position_embeddings": 64}))
    assert resume_changes(load_config(recipe, [f"resume={old}"])) == []  # no config.yaml: nothing to list, and nothing refused
    with pytest.raises(ConfigError, match=r"model.hidden_size=96 \(the run's: 192\)"):  # was accepted without config.yaml
        resume_changes(load_config(recipe, [f"resume={old}", "model.hidden_size=96"]))
    (old / "checkpoints" / "latest").write_text("step-000002")
    with pytest.raises(ConfigError, match="names 'step-000002', which is not there"):
        resume_changes(load_config(recipe, [f"resume={old}"]))
    for name in ("", "..", "../old/checkpoints/step-000003"):  # not the checkpoints folder itself, nor one elsewhere
        (old / "checkpoints" / "latest").write_text(name + "\n")
        with pytest.raises(ConfigError, match=f"names {name!r}, which is no checkpoint folder"):
            resume_changes(load_config(recipe, [f"resume={old}"]))
    (old / "checkpoints" / "latest").write_text("step-000003")
    (old / "config.yaml").write_text(recipe.read_text())
    assert resume_changes(load_config(recipe, [f"resume={old}", "seed=3", "task.reward=exact_match", "sft.steps=5", "train.lr=1e-4"])) == [
        "seed: 0 -> 3 (another held-out set: accuracy before and after RL are measured on different prompts)",
        "task.reward:  -> exact_match (another reward: accuracy before and after RL are scored differently)",
        "sft.steps: 200 -> 5 (no effect: the warm start is done)",
        "train.lr: 0.0002 -> 0.0001",
    ]
    (tmp_path / "a-file").write_text("")
    for key in ("run_dir", "output_dir"):
        with pytest.raises(ConfigError, match=f"{key}=.* is a file, not a directory"):
            _new_run_dir(load_config(recipe, [f"{key}={tmp_path / 'a-file'}"]))


def test_a_latest_that_cannot_be_read_as_a_name_is_a_config_error_naming_it(tmp_path):
    """A `latest` made a symlink to its folder (`ln -s step-000003 latest`), or holding
    bytes that are no text: was a traceback (IsADirectoryError, UnicodeDecodeError), exit 1."""
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import resume_changes

    old = tmp_path / "old"
    (old / "checkpoints" / "step-000003").mkdir(parents=True)
    (old / "checkpoints" / "latest").symlink_to("step-000003")
    cfg = load_config(resolve_recipe("quickstart_cpu"), [f"resume={old}"])
    with pytest.raises(ConfigError, match=r"checkpoints/latest cannot be read .*write the name of one, e.g. step-000010"):
        resume_changes(cfg)
    (old / "checkpoints" / "latest").unlink()
    (old / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"checkpoints/latest cannot be read"):
        resume_changes(cfg)


def test_an_output_dir_that_is_a_file_does_not_stop_a_run_given_its_run_dir(tmp_path, monkeypatch):
    """With run_dir set, output_dir is not used: a file named `runs` (the default
    output_dir) in the current directory refused `tidal run ... run_dir=...`."""
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import _new_run_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")
    assert _new_run_dir(load_config(resolve_recipe("quickstart_cpu"), [f"run_dir={tmp_path / 'mine'}", "output_dir=runs"])) == tmp_path / "mine"


def test_evaluation_decodes_greedily_whatever_the_checkpoints_generation_config_says(tmp_path):
    """A checkpoint's generation_config.json is filled into every `generate` call: Qwen2.5-Instruct's
    `repetition_penalty: 1.05` (here 3.0) would change the "greedy" answers, and the held-out
    accuracy with them. Evaluation decodes by plain argmax, and leaves the model's config as it was."""
    import json

    from tidal.engines.tiny import load_model, save_model
    from tidal.tools.train import evaluate

    tokenizer = CharTokenizer()
    save_model(build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=0), tokenizer, tmp_path)
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "repetition_penalty": 3.0}))
    model, _ = load_model(tmp_path)
    favourite, second = tokenizer.encode("7")[-1], tokenizer.encode("8")[-1]
    forward = model.forward

    def favouring(*args, **kwargs):  # argmax is `favourite` at every position; divided by a penalty of 3 once seen, `second` wins
        out = forward(*args, **kwargs)
        out.logits[..., favourite] += 4.0
        out.logits[..., second] += 3.0
        return out

    model.forward = favouring
    items = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(4)]
    seen = []
    evaluate(model, tokenizer, items, lambda trajectory, text: seen.append(list(trajectory.tokens)) or 1.0, max_new_tokens=4)
    assert seen == [[favourite] * 4] * 4
    assert model.generation_config.repetition_penalty == 3.0
    with torch.no_grad():  # what generate makes of the checkpoint's config: other answers
        penalised = model.generate(torch.tensor([tokenizer.encode(items[0]["prompt"])]), max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_id)
    assert penalised[0, -4:].tolist() != [favourite] * 4


def test_sampled_evaluation_draws_from_the_cut_softmax_with_a_generator_of_its_own():
    """`_SampledArgmax` (Gumbel noise on the cut scores, then greedy's argmax) draws each token
    as often as the cut softmax says, never one the cut drops, and leaves torch's global
    generator as it was; each answer counts once in the accuracy (mean@N)."""
    from tidal.tools.config import EvalConfig
    from tidal.tools.train import _SampledArgmax, evaluate

    scores = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    state = torch.get_rng_state()
    draws = _SampledArgmax(EvalConfig(samples=2, temperature=0.5, top_p=0.99), seed=3)(None, scores).argmax(-1)
    assert torch.equal(torch.get_rng_state(), state)
    kept = torch.softmax(torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0]) / 0.5, -1)  # 0.656, 0.241, 0.089, 0.012, 0.002
    kept[4] = 0  # top_p=0.99: the first four hold 0.998, the first three 0.986 (< 0.99), so the fourth is kept and the last cut
    kept /= kept.sum()
    frequencies = torch.bincount(draws, minlength=5).double() / len(draws)
    assert torch.allclose(frequencies, kept.double(), atol=0.01) and frequencies[kept == 0].sum() == 0

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=0)
    items = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(3)]
    answers: list = []

    def first_of_each(trajectory, text):  # 1.0 for the first answer to each prompt only
        answers.append(trajectory.meta["answer"])
        return float(answers.count(trajectory.meta["answer"]) == 1)

    held_out = evaluate(model, tokenizer, items, first_of_each, max_new_tokens=3, sampling=EvalConfig(samples=4, temperature=1.0))
    assert (held_out.accuracy, held_out.pass_at_n) == (3 / 12, 1.0)  # mean@4, and pass@4: each prompt has its one right answer
    assert sorted(answers) == [1] * 4 + [2] * 4 + [3] * 4
    greedy: list = []
    assert evaluate(model, tokenizer, items, lambda t, text: greedy.append(t.tokens) or 0.0, max_new_tokens=3).pass_at_n is None
    top1: list = []
    evaluate(model, tokenizer, items, lambda t, text: top1.append(t.tokens) or 0.0, max_new_tokens=3, sampling=EvalConfig(samples=2, temperature=1.0, top_k=1))
    assert top1 == [g for g in greedy for _ in range(2)]  # top_k=1 keeps only the argmax


def test_maj_at_n_counts_the_answer_most_responses_closed_with():
    """A prompt's vote: answers of responses that ended with an end token, the most frequent
    winning (ties: the one given first); right when that answer's first response was scored right."""
    from tidal.engines.rewards import answer_reader
    from tidal.tools.train import _majority_right

    assert _majority_right(["7", "8", "7", None], [True, False, True, False])
    assert not _majority_right(["8", "7", "8", "7"], [False, True, False, True])  # a tie: "8" came first
    assert not _majority_right([None, None], [True, True])  # no response ended: no vote
    assert _majority_right(["7", "7", "8"], [False, True, False]) is False  # the winner's first response decides
    assert answer_reader("arithmetic")(" 12 ") == "12" and answer_reader("my_rewards:score") is None
    assert answer_reader("math")("so 3 + 4 = 7.\n#### 1,234") == "1234"
