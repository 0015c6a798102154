"""Fixtures shared by the tests of tools/: comparing a resumed run with the uninterrupted one."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    """Each step's metrics, less what depends on timing."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in ("time", "step_s", "wait_s")} for m in lines]


def _assert_same_run(full: Path, resumed: Path, *, from_step: int, last_step: int = 4) -> None:
    """`resumed` (from `from_step`) ends with `full`'s per-step metrics and final weights. Its
    record holds each step once: from 1 when the run it resumed left a metrics.jsonl (copied up
    to the checkpoint), else (a bare checkpoint folder) from `from_step + 1`."""
    first = _steps(resumed)[0]["step"]
    assert first in (1, from_step + 1)
    assert [m["step"] for m in _steps(resumed)] == list(range(first, last_step + 1))
    assert [m["reward"] for m in _steps(resumed)] == [m["reward"] for m in _steps(full)[first - 1 :]]
    assert _steps(resumed) == _steps(full)[first - 1 :]
    a, b = (load_file(run / "checkpoints" / f"step-{last_step:06d}" / "model.safetensors") for run in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_takes_steps_of(run_dir: Path, reference: Path, *, keys: tuple[str, ...] = ("loss", "kl")) -> None:
    """`run_dir`'s steps are `reference`'s (another train engine's run of the same recipe): the
    same rewards, and `keys` up to float32 noise (1e-4 relative)."""
    for m, t in zip(_steps(run_dir), _steps(reference), strict=True):
        assert m["reward"] == t["reward"], m["step"]
        for key in keys:
            assert m[key] == pytest.approx(t[key], rel=1e-4, abs=1e-7), (m["step"], key)


PPO_KEYS = (
    "algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=6", "critic.lr=0.01", "critic.micro_batch_size=2",
    "algorithm.aggregation=seq_mean_token_mean",  # a loss that differs by step (token_mean of whitened advantages is 0 at ratio 1)
    "algorithm.kl_in_reward=0.2", "algorithm.kl_target=0.01", "algorithm.kl_horizon=12",  # a KL penalty in the reward, its coefficient adapted
)  # fmt: skip
"""PPO with a critic and an adaptive KL penalty in the reward, on a tiny quickstart (`_assert_critic_run_is_torchs`)."""


def _assert_critic_run_is_torchs(tidal_cli: Any, tmp_path: Path, *, backend: list[str], common: list[str], env: dict[str, str]) -> None:
    """`tidal run quickstart_cpu *backend *common` (4 steps, `PPO_KEYS` among `common`): its
    policy and critic take the torch backend's steps up to float32 noise, and a run resumed from
    its step-2 checkpoint (the critic's weights and AdamW state, the adapted KL coefficient)
    ends with the uninterrupted run's metrics and weights, bit for bit."""
    import shutil

    full, cut, resumed, torch_run = tmp_path / "full", tmp_path / "cut", tmp_path / "resumed", tmp_path / "torch"
    out = tidal_cli("run", "quickstart_cpu", *backend, f"run_dir={full}", "checkpoint_every=2", *common, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    out = tidal_cli("run", "quickstart_cpu", "train.backend=torch", f"run_dir={torch_run}", *common, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = _steps(full)
    assert steps[-1]["values_mean"] != 0.0 and len({m["value_loss"] for m in steps}) == len(steps)  # the critic trained
    assert steps[-1]["reward_kl"] > 0 and steps[-1]["reward_kl_coef"] < 0.2  # the policy left its reference, less than the target: the coefficient fell
    _assert_takes_steps_of(full, torch_run, keys=("loss", "value_loss", "values_mean", "value_grad_norm", "reward_kl", "reward_kl_coef"))
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    out = tidal_cli("run", "quickstart_cpu", *backend, f"run_dir={resumed}", f"resume={cut}", "checkpoint_every=2", *common, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_same_run(full, resumed, from_step=2)


def _assert_colocated_as_alone(tidal_cli: Any, tmp_path: Path, common: list[str], *, env: dict[str, str]) -> None:
    """`tidal run quickstart_cpu *common` (3 steps, `max_staleness: 0`) alone, then with rollout
    time-sharing the trainer's device: the trainer parked for each step after the first, and
    the shared run's metrics (less its hand-off counts) and last weights are the alone run's, bit for bit."""
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    for run_dir, extra in ((alone, []), (shared, ["placement.rollout.colocate_with=train"])):
        out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *common, *extra, env=env, cwd=tmp_path, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    share = json.loads((shared / "summary.json").read_text())["timeshare"]
    assert share["handoffs"] >= 6 and share["seats"]["train"]["parks"] >= 2  # the trainer left the device to rollout for each step after the first
    a, b = _steps(alone), _steps(shared)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3] and len({m["loss"] for m in a}) > 1
    assert [{k: m[k] for k in m if k in o} for m, o in zip(b, a)] == a  # the shared run's metrics add its hand-offs
    x, y = (load_file(run / "checkpoints" / "step-000003" / "model.safetensors") for run in (alone, shared))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="session")
def runs() -> types.SimpleNamespace:
    """`runs.steps(run_dir)`: a run's per-step metrics less timings; `runs.assert_same(full,
    resumed, from_step=)`: a resumed run repeats the uninterrupted one; `runs.assert_takes_steps_of(run,
    reference)`: another engine's run of the same recipe took the same steps;
    `runs.assert_colocated_as_alone(tidal_cli, tmp_path, common, env=)`: a colocated run is the
    disaggregated one; `runs.assert_critic_run_is_torchs(tidal_cli, tmp_path, backend=, common=,
    env=)`: a PPO run (`runs.ppo_keys`) takes the torch backend's steps and resumes exactly."""
    return types.SimpleNamespace(
        steps=_steps, assert_same=_assert_same_run, assert_takes_steps_of=_assert_takes_steps_of, assert_colocated_as_alone=_assert_colocated_as_alone,
        assert_critic_run_is_torchs=_assert_critic_run_is_torchs, ppo_keys=PPO_KEYS,
    )  # fmt: skip


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`reward_module(name, source)`: a module `name` holding `source`, importable by name for
    the test, as a user's `task.reward=name:function` is (from the Python path), and returned
    imported; a fresh import each test, dropped after it."""
    folder = tmp_path / "rewards"
    made: list[str] = []

    def make(name: str, source: str) -> Any:
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.delitem(sys.modules, name, raising=False)
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)
