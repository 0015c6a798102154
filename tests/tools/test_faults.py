"""Fault injection under `runtime: ray`: actors killed (SIGKILL, by pid) at random steps.

Each trial runs the real `tidal run` on a local Ray with fake devices, kills one actor
process when the run reaches a step drawn at random (seeded), and checks that the run
finishes and that its final lineage trained every prompt at most once and lost none:
every prompt the run admitted is trained, dropped by the staleness bound (counted), or
still in the store saved with the final checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.flow.store import persist

NUM_STEPS = 20
GROUP = 8
SMALL = [
    "task.max_value=9", "task.num_eval_prompts=8", "sft.steps=20", f"algorithm.num_steps={NUM_STEPS}", "checkpoint_every=5",
    "task.reward=tidal_test_rewards:starts_with_seven", "threads=1", "cluster.fake=true",
    "placement.train.count=1", "placement.rollout.count=2", "placement.rollout.devices_each=1",
]
ENV = {"PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
ONE_VENDOR = ["cluster.nodes=[{name: gpu, kind: cuda, devices: 3}]", "placement.train.requires=[gpu]", "placement.rollout.requires=[gpu]"]
MIXED = ["cluster.nodes=[{name: npu, kind: npu, devices: 1}, {name: gpu, kind: cuda, devices: 2}]"]
ONE_NODE_CPU = ["cluster.nodes=[{name: box, kind: cpu, devices: 2}]", "placement.train.requires=[cpu]", "placement.rollout.requires=[cpu]", "placement.rollout.count=1", "transport.overlap=true"]
"""One node's two CPUs (a local Ray has no more): the trainer and one rollout actor, weights
through a shared buffer, posted (the trainer does not wait for the answers); the killed
actor is the only one, so the run goes on only if its replacement is sent the version out."""

LONE = ["placement.rollout.count=1", "algorithm.max_staleness=0"]
"""One rollout actor, synchronous: when it dies, the trainer waits for the rows it was
generating, and only a second send of the current version lets its replacement make them."""


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def _run_and_kill(tmp_path: Path, overrides: list[str], *, at_step: int, victim, sig: signal.Signals = signal.SIGKILL) -> tuple[Path, str]:
    """Run the mixed recipe; when it reaches `at_step`, SIGKILL (or `sig`) the pid `victim(runtime_info)` names."""
    run_dir = tmp_path / "run"
    cmd = [str(Path(sys.executable).parent / "tidal"), "run", "mixed_npu_gpu", f"run_dir={run_dir}", *SMALL, *overrides, "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"} | ENV
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ENV["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)  # added to, not replaced
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while _steps_done(run_dir) < at_step:
            assert proc.poll() is None, f"the run ended before step {at_step}: {proc.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "the run did not reach the step to kill at"
            time.sleep(0.05)
        pid = victim(_read_json(run_dir / "runtime.json"))
        os.kill(pid, sig)
        _, err = proc.communicate(timeout=400)
    finally:
        if sig == signal.SIGSTOP:
            _resume(pid)  # when tidal did not kill it
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    return run_dir, err


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _check_lineage(run_dir: Path) -> list[dict]:
    """Every step once; no prompt trained twice; every admitted prompt accounted for."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, NUM_STEPS + 1))
    trained = [g for m in steps for g in m["groups"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    state = persist.load(checkpoint / "store.bin").state_dict()["partitions"]
    admitted = state["prompts"]["next_index"]
    waiting = {row[0] for row in state["prompts"]["rows"]}  # not generated yet (or generating when the run ended)
    acked_by_train = set(state["train"]["consumers"]["train"])
    generated = {group for index, group, _, _ in state["train"]["rows"] if index not in acked_by_train}
    missing = set(range(admitted)) - set(trained) - waiting - generated
    assert len(missing) * GROUP == sum(m["dropped"] for m in steps), f"prompts lost: {sorted(missing)}"
    assert len(trained) == NUM_STEPS * 16  # 16 prompts a step
    return steps


@pytest.mark.slow
@pytest.mark.parametrize(
    "cluster, transport",
    [(MIXED, "host"), ([*ONE_NODE_CPU, "train.backend=torch"], "ipc"), ([*ONE_VENDOR, *LONE], "collective")],
    ids=["host", "ipc-weights-in-place", "collective-lone"],  # collective with two actors: the stopped actor's test below; ipc with a copying (fsdp) sender: the receiver's restart path is the same
)
def test_a_killed_rollout_actor_is_restarted_and_the_run_loses_nothing(tmp_path, cluster, transport):
    at_step = random.Random(f"rollout-{transport}").randint(3, 12)
    killed: list[int] = []

    def rollout_pid(info: dict) -> int:
        killed.append(info["rollout_actors"][0]["pid"])
        return killed[0]

    run_dir, err = _run_and_kill(tmp_path, cluster, at_step=at_step, victim=rollout_pid)
    assert "rollout actor 0 died" in err and "the trainer died" not in err
    _check_lineage(run_dir)
    info = _read_json(run_dir / "runtime.json")
    assert info["transport"] == transport and info["trainer"]["attempt"] == 0
    # the torch engine keeps its weights in the ipc buffer (the new actor copied from them too); the fsdp engine copies them there
    assert info.get("weights_in_place", False) is ("train.backend=torch" in cluster)
    assert info["rollout_restarts"] == [1] + [0] * (len(info["rollout_actors"]) - 1)
    assert info["rollout_actors"][0]["pid"] != killed[0]  # a new process
    restarted, *kept = info["rollout_summaries"]
    assert restarted["samples"] > 0 and all(k["samples"] > 0 for k in kept)
    # the restarted actor took the then-current weights and went on with every later version
    assert restarted["versions_applied"][0] >= at_step
    assert restarted["version"] >= NUM_STEPS - 2 and all(k["version"] >= NUM_STEPS - 2 for k in kept)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1], ids=["follower"])  # rank 0's death is the stopped trainer's test's (the actor the driver waits on)
def test_a_killed_trainer_rank_restarts_the_whole_trainer_group(tmp_path, rank):
    """Two fsdp ranks. Killing the follower fails the lead's next collective; killing the
    lead (rank 0, which talks to the store and the driver) kills the actor the driver
    waits on. Either way the driver restarts both ranks from the checkpoint."""
    at_step = random.Random(f"trainer-rank-{rank}").randint(6, 13)
    before: list[int] = []

    def rank_pid(info: dict) -> int:
        before.extend(r["pid"] for r in info["trainer"]["ranks"])
        return before[rank]

    ranks = ["cluster.nodes=[{name: gpu, kind: cuda, devices: 4}]", "placement.train.requires=[gpu]", "placement.rollout.requires=[gpu]", "placement.train.count=2", "train.backend=fsdp"]
    run_dir, err = _run_and_kill(tmp_path, ranks, at_step=at_step, victim=rank_pid)
    assert "the trainer died" in err and "resuming from the last checkpoint" in err
    _check_lineage(run_dir)
    summary = _read_json(run_dir / "summary.json")
    assert summary["trainer_restarts"] == 1 and summary["steps"] == NUM_STEPS
    after = [r["pid"] for r in summary["trainer_ranks"]]
    assert not set(after) & set(before), f"a rank of the old group kept running: {before} -> {after}"
    follower = summary["trainer_ranks"][1]
    assert 0 < follower["steps"] <= NUM_STEPS - 5  # the new group resumed from a checkpoint (every 5 steps), no warm start


LIVENESS = ["fault.liveness_s=3", "fault.liveness_grace_s=4"]
"""Silent 3 s: reported; 7 s: killed (the defaults, 30 s and 90 s, would make the test slow)."""


@pytest.mark.slow
def test_a_stopped_rollout_actor_is_reported_killed_and_restarted_and_the_run_loses_nothing(tmp_path):
    """SIGSTOP on a rollout actor stopped the run without a word until `lease_s` (an hour)."""
    at_step = random.Random("rollout-stopped").randint(3, 12)
    run_dir, err = _run_and_kill(tmp_path, [*ONE_VENDOR, *LIVENESS], at_step=at_step, victim=lambda info: info["rollout_actors"][0]["pid"], sig=signal.SIGSTOP)
    assert "rollout actor 0 (pid" in err and "has not answered for 3s" in err, err[-3000:]
    assert "rollout actor 0 died (killed after it stopped answering (fault.liveness_s)); Ray restarts it (1 of 3)" in err
    steps = _check_lineage(run_dir)
    assert steps[-1]["silent_rollouts"] == 1 and steps[0]["silent_rollouts"] == 0
    info = _read_json(run_dir / "runtime.json")
    assert info["rollout_restarts"] == [1, 0] and info["transport"] == "collective" and info["trainer"]["attempt"] == 0
    restarted, kept = info["rollout_summaries"]
    assert restarted["samples"] > 0 and kept["samples"] > 0
    assert restarted["versions_applied"][0] >= at_step  # the new actor took the then-current weights, and every later version


@pytest.mark.slow
def test_a_stopped_trainer_is_reported_killed_and_resumed_from_its_last_checkpoint(tmp_path):
    """SIGSTOP, then the liveness check's SIGKILL: the path of a trainer that dies (a killed
    trainer's own test was the same run without the silence)."""
    at_step = random.Random("trainer-stopped").randint(6, 13)  # after the first checkpoint (every 5 steps)
    first: dict = {}

    def trainer_pid(info: dict) -> int:
        first.update(info)
        return info["trainer"]["pid"]

    run_dir, err = _run_and_kill(tmp_path, [*MIXED, *LIVENESS], at_step=at_step, victim=trainer_pid, sig=signal.SIGSTOP)
    assert "trainer rank 0 (pid" in err and "has not answered for 3s" in err, err[-3000:]
    assert "the trainer died (killed after it stopped answering (fault.liveness_s)); resuming from the last checkpoint (restart 1 of 1)" in err
    _check_lineage(run_dir)
    summary = _read_json(run_dir / "summary.json")
    assert summary["trainer_restarts"] == 1 and summary["steps"] == NUM_STEPS
    info = _read_json(run_dir / "runtime.json")
    assert info["trainer"]["attempt"] == 1 and info["trainer"]["pid"] != first["trainer"]["pid"]
    # the resumed trainer started from the checkpoint at or before the kill, not from scratch
    resumed_at = min(v for s in info["rollout_summaries"] for v in s["versions_applied"])
    assert resumed_at % 5 == 0 and 5 <= resumed_at <= at_step + 10  # the kill comes up to liveness_s + grace_s after the stop


def test_only_a_dead_trainer_process_counts_as_a_death_not_an_error_it_raised():
    """An error raised inside a rank's call (say, its rollout actor could not be built) is
    not a death to restart from, even though Ray makes it an instance of the dead actor's
    error too; the trainer's own death is."""
    import ray.exceptions as errors

    from tidal.tools.ray_run import rank_died

    died = errors.ActorDiedError()
    raised = errors.RayTaskError("run", "Traceback ...", died).as_instanceof_cause()
    assert isinstance(raised, errors.RayActorError)  # what made it look like a death
    assert rank_died(died) and not rank_died(raised) and not rank_died(RuntimeError("x"))


def test_rank_0s_error_is_reported_when_a_follower_fails_first_on_the_lost_group(ray_session, tmp_path):
    """Rank 0 raises and gives up its process group; a follower's collective then fails at
    once with a connection error, and the driver may hear that first. The run's error is
    rank 0's, with the follower's as a note (not the other way round)."""
    import ray

    from tidal.tools.ray_run import _wait_with_progress

    @ray.remote(num_cpus=0)
    def rank0() -> None:
        time.sleep(1.0)
        raise ValueError("reward function 'x' is not defined")

    @ray.remote(num_cpus=0)
    def follower() -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:19145")

    @ray.remote(num_cpus=0)
    def fine() -> dict:
        return {}

    with pytest.raises(ValueError, match="reward function 'x' is not defined") as caught:
        _wait_with_progress([rank0.remote(), follower.remote(), fine.remote()], tmp_path / "metrics.jsonl", total=1, progress=False)
    assert caught.value.__notes__ == ["trainer rank 1 failed too: RuntimeError: Connection closed by peer [127.0.0.1]:19145"]
    with pytest.raises(RuntimeError, match="Connection closed") as caught:  # rank 0 fine: the one that failed, alone
        _wait_with_progress([fine.remote(), follower.remote()], tmp_path / "metrics.jsonl", total=1, progress=False)
    assert not getattr(caught.value, "__notes__", None)
