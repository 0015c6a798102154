"""PPO with a critic (`algorithm.advantage=gae`) through the real `tidal run`: the quickstart
learns with it, and the combinations it cannot run are refused before any work."""

from __future__ import annotations

import json

import pytest

from tidal.tools.config import ConfigError, load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.run import check_runnable

PPO = ["algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=32", "critic.lr=0.003", "algorithm.num_steps=40"]


def test_the_quickstart_learns_with_a_critic(tidal_cli, tmp_path):
    run_dir = tmp_path / "run"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *PPO, "tensorboard=false", "--no-progress", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["samples"] == 32 and "value_loss" in m for m in steps)
    assert sum(m["value_loss"] for m in steps[-10:]) < sum(m["value_loss"] for m in steps[:10])  # the critic learns the values


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.backend=fsdp"], "algorithm.advantage=gae trains a critic beside the policy in one process, with train.backend=torch; train.backend='fsdp'"),
        (["train.backend=deepspeed"], "set train.backend=torch, or another advantage"),
    ],
)
def test_a_critic_with_another_train_backend_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_runnable(load_config(resolve_recipe("quickstart_cpu"), ["algorithm.advantage=gae", "algorithm.group_size=1", *overrides]))


def test_the_simulator_refuses_a_critic_it_does_not_model():
    from tidal.tools.sim.simulate import simulate

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["algorithm.advantage=gae", "algorithm.group_size=1"])
    with pytest.raises(ConfigError, match="tidal simulate does not model a critic"):
        simulate(cfg, None, None)  # refused before the cluster or workload is read
