"""`runtime: ray` through the real `tidal run`: actors on their placements, weights over the transport.

The mixed test is the issue's CI check: a local Ray whose "nodes" declare NPUs and GPUs
(`cluster.fake: true`), the trainer on a fake NPU, rollout on fake GPUs, weights over
the host transport; each actor reports the platform it was placed on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SMALL = ["task.max_value=9", "task.num_eval_prompts=40", "sft.steps=20", "algorithm.num_steps=24", "checkpoint_every=100", "task.reward=tidal_test_rewards:starts_with_seven", "threads=1"]
ENV = {"PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled"}


def _run(tidal_cli, tmp_path, *args):
    run_dir = tmp_path / "run"
    out = tidal_cli("run", *args, f"run_dir={run_dir}", *SMALL, "--no-progress", env=ENV, cwd=tmp_path, timeout=480)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((run_dir / "runtime.json").read_text())
    return run_dir, steps, info, out


def _learned(steps):
    assert [m["step"] for m in steps] == list(range(1, 25))
    assert all(max(map(int, m["version_gap"]), default=0) <= 1 for m in steps)
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.15, f"reward did not go up: {first:.2f} -> {last:.2f}"


@pytest.mark.slow
def test_mixed_npu_trainer_and_gpu_rollout_on_fake_platforms(tidal_cli, tmp_path):
    # the GPU node carries a custom tag the rollout role requires: a Ray resource in its bundles
    cluster = "cluster.nodes=[{name: npu, kind: npu, devices: 1}, {name: gpu, kind: cuda, devices: 2, tags: [fast]}]"
    run_dir, steps, info, out = _run(
        tidal_cli, tmp_path, "mixed_npu_gpu", "cluster.fake=true", cluster,
        "placement.train.count=1", "placement.rollout.count=2", "placement.rollout.devices_each=1", "placement.rollout.requires=[gpu, fast]",
    )
    assert info["transport"] == "host"  # NPU -> GPU goes through host memory
    kinds = [(d["platform"]["kind"], d["platform"]["fake"], d["platform"]["device_count"]) for d in info["rollout_actors"]]
    assert kinds == [("cuda", True, 1), ("cuda", True, 1)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 24
    _learned(steps)
    # Every version reached every rollout actor complete; the ones it generated with went live.
    rollout = info["rollout_summaries"]
    assert len(rollout) == 2 and all(r["platform"]["kind"] == "cuda" for r in rollout)
    # the warm start (0) and 24 updates: an actor told to stop first takes the last one sent
    assert all(r["versions_received"] == 25 and r["last_version_received"] == 24 for r in rollout), rollout
    applied = sorted({v for r in rollout for v in r["versions_applied"]})
    assert applied[0] == 0 and len(applied) >= 8 and all(r["samples"] > 0 for r in rollout)


def test_quickstart_runs_on_ray_and_learns(tidal_cli, tmp_path):
    run_dir, steps, info, out = _run(tidal_cli, tmp_path, "quickstart_cpu", "runtime=ray")
    assert info["transport"] == "ipc"  # cpu -> cpu on one node: a shared buffer
    assert info["weights_in_place"] is True  # ... holding the trainer's own weights (`transport.overlap`, the recipe's)
    assert [d["platform"]["kind"] for d in info["rollout_actors"]] == ["cpu"]
    _learned(steps)
    assert "held-out accuracy" in out.stdout
    # the rollout actor's spans are in the run's timeline, as a process of their own, on the trainer's clock
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["rollout actor 0", "trainer"]
    (actor_pid,) = [pid for pid, name in processes.items() if name == "rollout actor 0"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    spans = [e for e in trace if e["ph"] == "X"]
    generates = [e for e in spans if e["pid"] == actor_pid and e["name"] == "generate"]
    assert generates and all(tracks[(actor_pid, e["tid"])] == "rollout" for e in generates)
    assert {e["name"] for e in spans if e["pid"] == actor_pid} >= {"generate", "weight update"}
    trains = [e for e in spans if e["pid"] != actor_pid and e["name"] == "train"]
    # rollout ran while the trainer trained: their spans overlap on the common clock
    assert min(e["ts"] for e in generates) < max(e["ts"] for e in trains) and max(e["ts"] for e in generates) > min(e["ts"] for e in trains)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True])  # the harder case (the send runs beside the next step); without overlap every Ray run here waits for the send
def test_synchronous_training_on_ray_generates_each_step_with_the_newest_weights(tidal_cli, tmp_path, overlap):
    # The weights reach the rollout actor after the trainer's publish returned (with
    # transport.overlap, the trainer does not even wait for the send): rollout must wait for
    # them, or max_staleness=0 drops every row it generates and the run hangs.
    run_dir, steps, info, out = _run(tidal_cli, tmp_path, "quickstart_cpu", "runtime=ray", "algorithm.max_staleness=0", f"transport.overlap={str(overlap).lower()}")
    assert info["overlap"] is overlap
    assert info.get("weights_in_place", False) is overlap  # the actor copied each version straight out of the trainer's weights
    assert [m["step"] for m in steps] == list(range(1, 25))
    assert all(set(map(int, m["version_gap"])) <= {0} for m in steps)
    assert sum(m["dropped"] for m in steps) == 0
    assert info["rollout_summaries"][0]["versions_applied"][:24] == list(range(24))  # each step's batch with that step's weights


def test_infeasible_ray_placement_fails_fast_naming_the_role(tidal_cli, tmp_path):
    cluster = "cluster.nodes=[{name: npu, kind: npu, devices: 1}, {name: gpu, kind: cuda, devices: 1}]"
    out = tidal_cli("run", "mixed_npu_gpu", f"run_dir={tmp_path / 'run'}", "cluster.fake=true", cluster, "placement.train.count=1", "placement.rollout.count=3", "placement.rollout.devices_each=1", env=ENV, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "cannot place role 'rollout'" in out.stderr and "Traceback" not in out.stderr


def test_a_local_ray_counts_the_machines_own_gpus_unless_the_cluster_is_fake(monkeypatch):
    """Ray is started with num_gpus=None on a real machine (Ray counts its GPUs; 0 would hide
    them from every placement) and with the declared count on a fake cluster."""
    import ray

    from tidal.tools.config import load_config
    from tidal.tools.ray_run import init_ray

    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(load_config(None, ["runtime=ray"]))
    init_ray(load_config(None, ["runtime=ray", "cluster.fake=true", "cluster.nodes=[{name: g, kind: cuda, devices: 2, count: 2}]"]))
    real, fake = calls
    assert (real["address"], real["num_gpus"], real["resources"]) == ("local", None, None)
    assert (fake["num_gpus"], fake["resources"]) == (4, None)


def test_tidal_plan_and_tidal_run_find_the_same_ray_cluster(monkeypatch):
    """Both join RAY_ADDRESS when it is set; without it a run starts a Ray of its own on this
    machine, so the plan is this machine's (and joins no Ray that happens to be running)."""
    import ray

    from tidal.flow.ray.placement import connected_ray_nodes
    from tidal.tools.config import load_config
    from tidal.tools.plan import make_plan
    from tidal.tools.ray_run import init_ray

    joined: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: joined.append(kwargs["address"]))
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeName": "far", "Resources": {"CPU": 4.0}}])
    cfg = load_config(None, ["runtime=ray", "device=cpu"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan, source = make_plan(cfg, ray_nodes=connected_ray_nodes)  # what `tidal plan runtime=ray` does
    init_ray(cfg)  # what `tidal run` does
    assert (source, [r.node for r in plan.resources], joined) == ("this machine", ["localhost"], ["local"])
    joined.clear()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    plan, source = make_plan(cfg, ray_nodes=connected_ray_nodes)
    init_ray(cfg)
    assert (source, [r.node for r in plan.resources], joined) == ("ray", ["far"], ["10.0.0.1:6379"] * 2)


def test_a_guest_of_several_trainer_ranks_sees_all_their_devices():
    from tidal.flow.ray.rollouts import visible_devices

    ranks = [{"visible_devices": {"CUDA_VISIBLE_DEVICES": "0"}}, {"visible_devices": {"CUDA_VISIBLE_DEVICES": "3,1"}}, {"visible_devices": {"CUDA_VISIBLE_DEVICES": None}}]
    assert visible_devices(ranks) == {"CUDA_VISIBLE_DEVICES": "0,3,1"}  # in rank order, as the guest's device indexes then follow
    assert visible_devices([ranks[1], {"visible_devices": {"CUDA_VISIBLE_DEVICES": "1"}}]) == {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert visible_devices([{}, {"visible_devices": {}}]) == {}


@pytest.mark.slow
def test_ctrl_c_at_the_driver_stops_the_ray_run_after_the_trainers_step_with_a_checkpoint(tmp_path):
    """SIGINT to `tidal run` (as Ctrl-C sends it): the driver relays it to trainer rank 0,
    which ends after its current step and saves a checkpoint there; exit 130 and the
    resume command names that checkpoint, and the run's steps are exactly those before it."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    small = [o for o in SMALL if not o.startswith("algorithm.num_steps")] + ["algorithm.num_steps=200"]
    cmd = [str(Path(sys.executable).parent / "tidal"), "run", "quickstart_cpu", "runtime=ray", f"run_dir={run_dir}", *small, "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"} | ENV | {"HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ENV["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)  # added to, not replaced
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "tidal run: interrupted (SIGINT), after saving a checkpoint" in err and "Traceback" not in err
    stopped_at = int(re.search(r"its last checkpoint is step-(\d+), continue with:", err).group(1))
    assert 3 <= stopped_at < 200
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, stopped_at + 1))
    assert json.loads((run_dir / "summary.json").read_text())["stopped_early"] == "SIGINT"


def test_each_rollout_instance_samples_its_own_seeded_stream():
    """Building the policy seeds torch with the recipe's seed, so every rollout actor used to
    sample the same random stream. Each instance's is now its own, and the same for the
    same seed and rank (no Ray needed: this runs inside each actor)."""
    import torch

    from tidal.tools.config import load_config, to_yaml
    from tidal.tools.ray_run import make_rollout_engine
    from tidal.tools.recipes import resolve_recipe

    cfg_yaml = to_yaml(load_config(resolve_recipe("quickstart_cpu"), ["seed=3"]))

    def draws(rank: int) -> torch.Tensor:
        make_rollout_engine(cfg_yaml, rank=rank)
        return torch.rand(8)

    first, again, other = draws(0), draws(0), draws(1)
    assert torch.equal(first, again) and not torch.equal(first, other)
