"""Weights & Biases logging (`wandb.project`, `tools.metrics._WandbWriter`), with the real
wandb package in offline mode (nothing leaves the machine): every step's scalars at their
step, the held-out accuracies at the last step and in the summary, the resolved config;
a restarted or in-place resumed run continues its W&B run, a branch gets its own with the
earlier steps first; a W&B failure never stops the run."""

from __future__ import annotations

import json
import logging

import pytest

from tidal.tools.config import ConfigError, load_config
from tidal.tools.metrics import WANDB_FILE, MetricsLog
from tidal.tools.recipes import resolve_recipe

wandb = pytest.importorskip("wandb")


@pytest.fixture
def spied(monkeypatch):
    """Every `wandb.init`'s keywords and every `run.log` (step, values), the real calls made."""
    inits: list[dict] = []
    logged: list[tuple[int, dict]] = []
    real_init = wandb.init

    def init(**kwargs):
        run = real_init(**kwargs)
        inits.append(kwargs)
        real_log = run.log
        run.log = lambda data, step=None, **rest: (logged.append((step, dict(data))), real_log(data, step=step, **rest))[1]
        return run

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return inits, logged


def _settings(**changes):
    return load_config(resolve_recipe("quickstart_cpu"), ["wandb.project=tidal-test", "wandb.mode=offline", *(f"wandb.{k}={v}" for k, v in changes.items())]).wandb


def test_each_step_and_the_final_accuracies_reach_a_wandb_run_and_a_restart_continues_it(tmp_path, spied):
    inits, logged = spied
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    metrics = MetricsLog(run_dir, tensorboard=False, wandb=_settings(tags="[a,b]"), config={"seed": 3, "algorithm": {"num_steps": 2}})
    metrics.write({"step": 1, "time": 10.0, "reward": 0.25, "wait_s": {"rollout": 0.5}, "groups": [1, 2]})
    metrics.write({"step": 2, "time": 11.0, "reward": 0.5, "wait_s": {"rollout": 0.25}, "groups": [3]})
    metrics.write_final({"accuracy_before": 0.1, "accuracy_after": 0.9}, step=2)
    metrics.close()
    (init,) = inits
    run_id = json.loads((run_dir / WANDB_FILE).read_text())["id"]
    assert init["project"] == "tidal-test" and init["name"] == "run-1" and init["id"] == run_id and init["resume"] == "allow"
    assert init["mode"] == "offline" and init["dir"] == str(run_dir) and init["tags"] == ["a", "b"] and init["config"] == {"seed": 3, "algorithm": {"num_steps": 2}}
    assert logged == [(1, {"reward": 0.25, "wait_s/rollout": 0.5}), (2, {"reward": 0.5, "wait_s/rollout": 0.25}), (2, {"accuracy_before": 0.1, "accuracy_after": 0.9})]
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))  # written by wandb itself
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2

    logged.clear()
    again = MetricsLog(run_dir, tensorboard=False, first_step=3, earlier=[{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}], wandb=_settings(), config={})
    again.write({"step": 3, "reward": 0.75})
    again.close()
    assert inits[1]["id"] == run_id and logged == [(3, {"reward": 0.75})]  # the same W&B run, which has steps 1 and 2


def test_a_run_resumed_into_another_directory_gets_its_own_wandb_run_with_the_earlier_steps_first(tmp_path, spied):
    inits, logged = spied
    branch = tmp_path / "branch"
    branch.mkdir()
    metrics = MetricsLog(branch, tensorboard=False, first_step=3, earlier=[{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5}, {"step": 3, "reward": 0.0}], wandb=_settings(name="mine"), config={})
    metrics.write({"step": 3, "reward": 0.75})
    metrics.close()
    assert inits[0]["name"] == "mine" and logged == [(1, {"reward": 0.25}), (2, {"reward": 0.5}), (3, {"reward": 0.75})]


def test_a_wandb_run_that_cannot_start_or_stops_taking_metrics_is_named_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    def refused(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", refused)
    with caplog.at_level(logging.WARNING, logger="tidal.tools.metrics"):
        metrics = MetricsLog(tmp_path, tensorboard=True, wandb=_settings(mode="online"), config={})
        metrics.write({"step": 1, "reward": 0.5})
        metrics.close()
    assert "W&B logging could not start (UsageError: api_key not configured" in caplog.text and "wandb sync --sync-tensorboard" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward"] == 0.5

    class Broken:
        def __init__(self) -> None:
            self.summary: dict = {}

        def log(self, data, step=None):
            raise ConnectionError("the W&B service went away")

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: Broken())
    caplog.clear()
    other = tmp_path / "other"
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger="tidal.tools.metrics"):
        metrics = MetricsLog(other, tensorboard=False, wandb=_settings(), config={})
        for step in (1, 2):
            metrics.write({"step": step, "reward": 0.5})
        metrics.close()
    assert caplog.text.count("W&B logging stopped at step 1 (ConnectionError: the W&B service went away)") == 1
    assert len((other / "metrics.jsonl").read_text().splitlines()) == 2


def test_wandb_project_without_the_package_is_refused_before_the_run_directory(tmp_path, monkeypatch):
    from tidal.engines import registry
    from tidal.tools.run import prepare_run

    monkeypatch.setattr(registry, "version", lambda name: None if name == "wandb" else "1.0")
    with pytest.raises(ConfigError, match=r"wandb\.project='p' needs the wandb package, not installed here \(pip install 'tidal-rl\[wandb\]'\)"):
        prepare_run(resolve_recipe("quickstart_cpu"), ["wandb.project=p", f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_a_run_logs_every_step_to_wandb(tmp_path, spied):
    from tidal.tools.cli import main

    inits, logged = spied
    small = ["sft.steps=2", "algorithm.num_steps=3", "task.num_eval_prompts=4", "checkpoint_every=3", "tensorboard=false"]
    assert main(["run", "quickstart_cpu", *small, "wandb.project=tidal-test", "wandb.mode=offline", f"run_dir={tmp_path / 'run'}", "--no-progress"]) == 0
    (init,) = inits
    assert init["config"]["algorithm"]["num_steps"] == 3 and init["config"]["wandb"]["project"] == "tidal-test"
    steps = [step for step, values in logged if "reward" in values]
    assert steps == [1, 2, 3] and (3, {"held_out_accuracy/before_rl": pytest.approx(0, abs=1), "held_out_accuracy/after_rl": pytest.approx(0, abs=1)}) in logged
