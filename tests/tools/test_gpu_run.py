"""The quickstart through the real `tidal run` on one real NVIDIA GPU (`gpu` marker).

Colocated on the one GPU: rollout and training take turns, and the waiting engine's
weights (and the trainer's gradients and AdamW moments) really leave the device for
pinned host memory. In one process, then under Ray, where the rollout actor shares the
trainer's bundle (a fraction of the GPU each) and weights go over CUDA IPC; then with the
fsdp backend (one NCCL rank) and its guest.

Each Ray run starts a Ray of its own (none is given in RAY_ADDRESS), as a user's first
run on a GPU box does: that is what finds the machine's GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SMALL = ["task.max_value=9", "task.num_eval_prompts=40", "sft.steps=20", "checkpoint_every=100", "device=cuda"]
COLOCATED = ["placement.rollout.colocate_with=train"]
ENV = {"PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}


def _run(tidal_cli, tmp_path, *args: str, num_steps: int) -> tuple[Path, list[dict], dict]:
    run_dir = tmp_path / "run"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *SMALL, f"algorithm.num_steps={num_steps}", *args, "--no-progress", env=ENV, cwd=tmp_path, timeout=480)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, num_steps + 1))
    return run_dir, steps, json.loads((run_dir / "summary.json").read_text())


def _learned(steps: list[dict]) -> None:
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.15, f"reward did not go up: {first:.2f} -> {last:.2f}"


def test_local_colocated_run_on_one_gpu_parks_the_waiting_engine_in_host_memory(tidal_cli, tmp_path):
    _, steps, summary = _run(tidal_cli, tmp_path, *COLOCATED, "task.reward=tidal_test_rewards:starts_with_seven", num_steps=20)
    _learned(steps)
    share = summary["timeshare"]
    assert share["handoffs"] >= 20
    rollout, train = share["seats"]["rollout"], share["seats"]["train"]
    assert rollout["parks"] >= 10 and rollout["parked_bytes"] > 0
    assert train["parks"] >= 10 and train["parked_bytes"] > rollout["parked_bytes"]  # + gradients and AdamW moments


def test_ray_colocated_run_on_one_gpu_sends_weights_over_cuda_ipc(tidal_cli, tmp_path):
    run_dir, steps, summary = _run(tidal_cli, tmp_path, "runtime=ray", "threads=1", *COLOCATED, "task.reward=tidal_test_rewards:starts_with_seven", num_steps=12)
    info = json.loads((run_dir / "runtime.json").read_text())
    assert info["transport"] == "ipc"  # same node, same device kind, colocated
    assert info["rollout_seating"] == [{"rank": 0, "mode": "colocated", "bundle": ["train", 0], "resources": {"GPU": 0.5}}]
    (trainer,), (actor,) = info["trainer"]["ranks"], info["rollout_actors"]
    assert actor["platform"]["kind"] == "cuda" and not actor["platform"]["fake"]
    assert actor["placement_group"] == trainer["placement_group"] is not None
    (rollout,) = info["rollout_summaries"]
    assert rollout["versions_received"] == 13 and rollout["samples"] > 0  # the warm start and 12 updates
    assert summary["timeshare"]["handoffs"] >= 12
    _learned(steps)


def test_ray_fsdp_rank_on_one_gpu_takes_turns_with_its_guest(tidal_cli, tmp_path):
    run_dir, steps, summary = _run(tidal_cli, tmp_path, "runtime=ray", "threads=1", "train.backend=fsdp", *COLOCATED, num_steps=6)
    info = json.loads((run_dir / "runtime.json").read_text())
    assert [s["mode"] for s in info["rollout_seating"]] == ["colocated"]
    (rollout,) = info["rollout_summaries"]
    assert rollout["versions_received"] == 7 and rollout["samples"] > 0
    assert summary["timeshare"]["seats"]["train"]["parks"] >= 3 and summary["timeshare"]["seats"]["train"]["parked_bytes"] > 0
    assert all("reward" in m for m in steps)


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_local_colocated_engine_that_parks_itself_learns_on_one_gpu(tidal_cli, tmp_path, backend):
    """The deepspeed (`offload_states`) and megatron (the platform's offload) engines park
    themselves at each hand-off on a real GPU, take their state back and learn."""
    import importlib.util

    if importlib.util.find_spec("deepspeed" if backend == "deepspeed" else "megatron") is None:
        pytest.skip(f"{backend} is not installed (carry it: docs/benchmarks.md, GPU test runs)")
    _, steps, summary = _run(tidal_cli, tmp_path, f"train.backend={backend}", *COLOCATED, "task.reward=tidal_test_rewards:starts_with_seven", num_steps=20)
    _learned(steps)
    share = summary["timeshare"]
    assert share["handoffs"] >= 20 and share["seats"]["train"]["parks"] >= 10 and share["seats"]["rollout"]["parked_bytes"] > 0
