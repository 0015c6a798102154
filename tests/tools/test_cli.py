"""The real `tidal` command: help, doctor, run, config, exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tidal.hal import owner


def test_help_documents_every_command(tidal_cli):
    top = tidal_cli("--help")
    assert top.returncode == 0
    for word in ("run", "doctor", "config", "TIDAL_DEVICE", "fake:<kind>:<n>", "exit codes"):
        assert word in top.stdout
    for cmd, words in {
        "run": ("run directory", "config.yaml", "--check", "key=value"),
        "doctor": ("torch_npu", "deepspeed", "shipped recipes", "Exits with 1", "--clean deletes those"),
        "config": ("--keys", "resolved config"),
    }.items():
        out = tidal_cli(cmd, "--help")
        assert out.returncode == 0
        text = " ".join(out.stdout.split())  # argparse wraps lines where it likes
        for word in words:
            assert word in text, (cmd, word)
    assert tidal_cli().returncode == 2


def test_doctor_detects_cpu_here(tidal_cli):
    out = tidal_cli("doctor", env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    for word in ("platform", "detection", "device count", "gloo", "versions", "torch", "not installed", "quickstart_cpu"):
        assert word in out.stdout
    assert "…" not in out.stdout  # a long word in a narrow column folds, never cut off
    data = json.loads(tidal_cli("doctor", "--json").stdout)
    assert data["platform"]["kind"] == "cpu" and data["platform"]["chosen_by"] == "detection"
    assert data["versions"]["torch_npu"] == "not installed" and data["versions"]["vllm"] == "not installed"
    assert data["versions"]["torch"].startswith("2.")
    quick = next(r for r in data["recipes"] if r["recipe"] == "quickstart_cpu")
    assert quick["runs_here"] is True


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_doctor_lists_tidal_files_left_in_shared_memory(tidal_cli):
    left = Path("/dev/shm") / f"tidal-weights-{os.getpid()}-999"  # as a killed sender leaves it
    left.write_bytes(b"x" * 3000)
    try:
        data = json.loads(tidal_cli("doctor", "--json").stdout)["shared_memory"]
        assert data["usable"] is True and data["free_bytes"] > 0
        assert data["files"][left.name] == 3000 and data["files_bytes"] >= 3000
        assert "delete them if no tidal process runs" in " ".join(tidal_cli("doctor").stdout.split())
    finally:
        left.unlink()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK) or owner.tag() is None, reason="needs a writable /dev/shm and /proc")
def test_doctor_tells_what_killed_processes_left_in_shared_memory_and_clean_deletes_only_that(tidal_cli):
    dead = subprocess.run([sys.executable, "-c", "from tidal.hal import owner; print(owner.tag())"], capture_output=True, text=True, check=True).stdout.strip()
    left, held = Path("/dev/shm") / f"tidal-weights-1-999@{dead}", Path("/dev/shm") / owner.tagged("tidal-weights-1-998")
    held.write_bytes(b"x" * 100)

    def while_left_stays(look):
        """`look()` over a file a killed process left; again when another tidal process (a
        test running beside this one) swept it meanwhile, as every store server and
        shared-file sender does when it starts."""
        for _ in range(5):
            left.write_bytes(b"x" * 100)
            seen = look()
            if left.exists() or left.name in seen["removed"]:
                return seen
        pytest.fail("another process swept the left file each time")

    try:
        def look():
            data = json.loads(tidal_cli("doctor", "--json").stdout)["shared_memory"]
            return data | {"text": " ".join(tidal_cli("doctor").stdout.split())}

        data = while_left_stays(look)
        assert left.name in data["orphans"] and held.name not in data["orphans"] and data["removed"] == []
        assert "left by killed processes (`tidal doctor --clean` deletes them)" in data["text"]
        data = while_left_stays(lambda: json.loads(tidal_cli("doctor", "--clean", "--json").stdout)["shared_memory"])
        assert left.name in data["removed"] and not left.exists() and held.exists()
    finally:
        left.unlink(missing_ok=True)
        held.unlink()


def test_doctor_fake_npu_reports_eight_devices_with_hccl(tidal_cli):
    out = tidal_cli("doctor", env={"TIDAL_DEVICE": "fake:npu:8"})
    assert out.returncode == 0, out.stderr
    assert "fake:npu:8" in out.stdout and "hccl" in out.stdout and "NPU" in out.stdout
    data = json.loads(tidal_cli("doctor", "--json", env={"TIDAL_DEVICE": "fake:npu:8"}).stdout)
    p = data["platform"]
    assert (p["kind"], p["device_count"], p["dist_backend"], p["fake"], p["chosen_by"]) == ("npu", 8, "hccl", True, "TIDAL_DEVICE")


def test_doctor_npu_here_fails_saying_what_is_missing_and_torch_still_imports(tidal_cli):
    out = tidal_cli("doctor", env={"TIDAL_DEVICE": "npu"})
    assert out.returncode == 1
    assert "torch_npu" in out.stdout and "CANN" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.ones(2).sum().item())"], capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == "2.0"


def test_doctor_says_no_recipe_runs_when_tidal_device_names_a_platform_that_cannot_load(tidal_cli):
    """TIDAL_DEVICE overrides every recipe's `device` key: when it cannot load, the CPU
    quickstart does not run here either, and doctor says why."""
    data = json.loads(tidal_cli("doctor", "--json", env={"TIDAL_DEVICE": "npu"}).stdout)
    quick = next(r for r in data["recipes"] if r["recipe"] == "quickstart_cpu")
    assert quick["runs_here"] is False
    assert quick["why"] == "TIDAL_DEVICE=npu overrides its device (cpu) and cannot load here (see the platform error)"
    assert "needs torch_npu" in data["error"]
    auto = json.loads(tidal_cli("doctor", "--json", env={"TIDAL_DEVICE": "auto"}).stdout)  # auto: the recipe's device decides
    quick = next(r for r in auto["recipes"] if r["recipe"] == "quickstart_cpu")
    assert quick["runs_here"] is True and "TIDAL_DEVICE" not in quick["why"]


def test_doctor_bogus_device_lists_valid_values(tidal_cli):
    out = tidal_cli("doctor", env={"TIDAL_DEVICE": "bogus"})
    assert out.returncode == 2
    assert "TIDAL_DEVICE='bogus'" in out.stderr
    for value in ("auto", "cpu", "cuda", "npu", "fake:<kind>:<n>"):
        assert value in out.stderr
    assert "Traceback" not in out.stderr


def test_doctor_explains_torch_broken_by_torch_npu_without_cann(tidal_cli, tmp_path):
    # An installed torch_npu registers a torch device-backend entry point; without CANN
    # its import fails, and then so does `import torch`.
    site = tmp_path / "site"
    (site / "torch_npu").mkdir(parents=True)
    (site / "torch_npu" / "__init__.py").write_text('raise ImportError("libascendcl.so: cannot open shared object file")\n')
    dist = site / "torch_npu-2.13.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ndevice_backend = torch_npu:_autoload\n")
    out = tidal_cli("doctor", env={"PYTHONPATH": str(site)})
    assert out.returncode == 1
    assert "import torch` fails" in out.stderr and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_check_writes_resolved_config(tidal_cli, tmp_path):
    run_dir = tmp_path / "run1"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", "seed=7", "--check", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["seed"] == 7 and saved["name"] == "quickstart_cpu" and saved["run_dir"] == str(run_dir)
    assert saved["device"] == "cpu" and saved["runtime"] == "local"
    platform = json.loads((run_dir / "platform.json").read_text())
    assert platform["descriptor"]["kind"] == "cpu" and platform["chosen_by"] == "recipe device key"

    again = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", "--check", cwd=tmp_path)
    assert again.returncode == 2 and "already holds files" in again.stderr


def test_run_default_run_dir_is_timestamped_under_output_dir(tidal_cli, tmp_path):
    out = tidal_cli("run", "quickstart_cpu", "output_dir=out", "--check", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (run_dir,) = (tmp_path / "out").iterdir()
    assert run_dir.name.startswith("quickstart_cpu-") and (run_dir / "config.yaml").is_file()


def test_quickstart_trains_resumes_and_writes_its_run_directory(tidal_cli, tmp_path):
    """The real `tidal run` on the quickstart recipe with small overrides (seconds, not minutes).

    The reward is swapped, through the recipe's own `task.reward=module:function` key, for
    one the tiny model learns within 20 steps, so "reward goes up" is a reliable assertion.
    """
    import json

    env = {"PYTHONPATH": str(Path(__file__).parent)}
    small = ["keep_checkpoints=1", "task.max_value=9", "task.num_eval_prompts=40", "sft.steps=20", "algorithm.num_steps=20", "checkpoint_every=10", "task.reward=tidal_test_rewards:starts_with_seven"]
    run_dir = tmp_path / "run"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *small, env=env | {"TTY_COMPATIBLE": "1"}, cwd=tmp_path)  # progress bars as on a terminal
    assert out.returncode == 0, out.stderr
    assert "held-out accuracy " in out.stdout and "before RL ->" in out.stdout and "(strict)" not in out.stdout  # a user's reward: not labelled strict
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.stderr)
    assert "warm start step 20/20" in shown and "RL step 20/20" in shown, shown[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, 21))
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.2, f"reward did not go up: {first:.2f} -> {last:.2f}"
    assert all(max(map(int, m["version_gap"]), default=0) <= 1 for m in steps)
    trace = json.loads((run_dir / "timeline.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"rollout", "reward", "advantage", "train"} <= tracks
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"generate", "reward", "train", "weight update"}
    assert (run_dir / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(metrics.jsonl, tensorboard/," in out.stdout and any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert checkpoint.name == "step-000020"
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["latest", "step-000020"]  # keep_checkpoints=1: step 10's is gone
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer.pt", "store.bin", "state.json"} <= {p.name for p in checkpoint.iterdir()}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and 0.0 <= summary["accuracy_after"] <= 1.0

    resumed = tmp_path / "resumed"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={resumed}", f"resume={run_dir}", *small[:-3], "train.lr=0.0003", "algorithm.num_steps=24", small[-1], "--no-progress", env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "resuming" in out.stderr and "at version 20" in out.stderr and "Loading weights" not in out.stderr
    assert f"resuming {run_dir} with these keys changed (the others as it ran):\n  checkpoint_every: 10 -> 100\n  train.lr: 0.0002 -> 0.0003\n  algorithm.num_steps: 20 -> 24\n" in out.stdout
    record = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert record[:20] == steps  # the run's record: the resumed run's steps, then this one's
    more = record[20:]
    assert [m["step"] for m in more] == [21, 22, 23, 24]
    assert {m["lr"] for m in steps} == {0.0002} and {m["lr"] for m in more} == {0.0003}  # the new lr, not the checkpoint's
    assert sum(m["reward"] for m in more) / 4 > first  # it continued from the trained weights

    again = tmp_path / "again"  # a finished run resumed: no step left, its new directory still gets the checkpoint
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={again}", f"resume={resumed}", *small[:-3], "algorithm.num_steps=24", small[-1], "--no-progress", env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (again / "checkpoints" / "latest").read_text().strip() == "step-000024" and (again / "checkpoints" / "step-000024" / "trainer.pt").is_file()

    out = tidal_cli("run", "quickstart_cpu", f"resume={run_dir}", *small, "model.num_layers=2", "--check", env=env, cwd=tmp_path)
    assert out.returncode == 2 and "model.num_layers=2 (the run's: 3): drop the override" in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing is written for a resume that cannot continue"


def test_an_interrupted_run_saves_a_checkpoint_says_how_to_continue_and_that_command_does(tidal_cli, tmp_path):
    """Ctrl-C during step 8 or 9 (checkpoints every 5): the run finishes the step it is on,
    saves a checkpoint there, exits 130, and the printed command (same recipe and overrides,
    `resume=` the run) continues from that step to the end, every step once."""
    import shlex

    env = {"PYTHONPATH": str(Path(__file__).parent)}
    small = ["task.num_eval_prompts=20", "sft.steps=20", "algorithm.num_steps=12", "checkpoint_every=5", "task.reward=tidal_test_rewards:starts_with_seven_until_interrupted"]
    run_dir = tmp_path / "run"
    interrupt = {**env, "TIDAL_TEST_INTERRUPT_AFTER": str(40 + 8 * 128)}  # two evaluations of 20, then 8 steps of 128 samples
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *small, "--no-progress", env=interrupt, cwd=tmp_path)
    assert out.returncode == 130, out.stderr
    assert "tidal run: interrupted (SIGINT), after saving a checkpoint" in out.stderr and "Traceback" not in out.stderr
    stopped_at = int(re.search(r"its last checkpoint is step-(\d+), continue with:", out.stderr).group(1))
    assert 7 <= stopped_at < 12, out.stderr  # not the periodic step-5 one: where the run stopped
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, stopped_at + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGINT" and summary["steps"] == stopped_at and summary["accuracy_after"] is None
    hint = out.stderr.split("continue with:")[1].strip().splitlines()[0]
    assert shlex.split(hint) == ["tidal", "run", "quickstart_cpu", *small, f"resume={run_dir}"]

    out = tidal_cli(*shlex.split(hint)[1:], "--no-progress", env=env, cwd=tmp_path)  # into a new timestamped run directory
    assert out.returncode == 0, out.stderr
    assert f"at version {stopped_at}" in out.stderr
    (resumed,) = (tmp_path / "runs").iterdir()
    steps = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # the run's record: every step once


def test_no_resume_command_without_a_checkpoint(tmp_path, capsys):
    """A run stopped before its first checkpoint has nothing to continue from: no command."""
    import argparse

    from tidal.tools.cli import _print_resume_hint

    args = argparse.Namespace(recipe="quickstart_cpu", overrides=["seed=3"], made_run_dir=tmp_path)
    _print_resume_hint(args)
    assert capsys.readouterr().err == ""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-000007\n")
    _print_resume_hint(args)
    assert f"its last checkpoint is step-000007, continue with:\n  tidal run quickstart_cpu seed=3 resume={tmp_path}" in capsys.readouterr().err


def test_a_run_that_fails_on_its_data_leaves_no_run_directory_to_block_the_next(tidal_cli, tmp_path, tiny_hf_dir, gsm8k_files):
    """A file that is not there, or not data, is refused before the run directory is made;
    one found wanting once read (a column missing) removes the directory the run had made,
    so the same `run_dir=` takes the mended command."""
    (tmp_path / "bad.jsonl").write_text('{"problem": "1+1", "answer": "#### 2"}\n')
    qwen = ["run", "gsm8k_qwen", f"model.path={tiny_hf_dir}", "run_dir=r1", "algorithm.num_steps=1", "rollout.max_new_tokens=4", "--no-progress"]
    missing = tidal_cli(*qwen, "data.train_files=[nope.jsonl]", cwd=tmp_path)
    assert missing.returncode == 2 and "data.train_files: 'nope.jsonl' does not exist" in missing.stderr
    assert not (tmp_path / "r1").exists() and "config written" not in missing.stdout
    bad = tidal_cli(*qwen, "data.train_files=[bad.jsonl]", cwd=tmp_path)
    assert bad.returncode == 2 and "bad.jsonl: no column 'question' (data.prompt_key); its columns: ['problem', 'answer']" in bad.stderr
    assert f"removed {tmp_path / 'r1'}: the run wrote nothing there yet" in bad.stderr and not (tmp_path / "r1").exists()
    good = tidal_cli(*qwen, f"data.train_files=[{gsm8k_files['train_jsonl']}]", "--check", cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    assert (tmp_path / "r1" / "config.yaml").is_file()


def test_only_a_run_directory_holding_what_prepare_run_wrote_is_removed(tmp_path, capsys):
    import argparse

    from tidal.tools.cli import _remove_unused_run_dir

    for name in ("config.yaml", "platform.json", "metrics.jsonl"):
        (tmp_path / name).write_text("x")
    args = argparse.Namespace(command="run", made_run_dir=tmp_path)
    _remove_unused_run_dir(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "metrics.jsonl", "platform.json"] and capsys.readouterr().err == ""
    (tmp_path / "metrics.jsonl").unlink()
    _remove_unused_run_dir(args)
    assert not tmp_path.exists() and "the run wrote nothing there yet" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sed=1"], "unknown key 'sed'"),
        (["seed=abc"], "key 'seed' in the command-line overrides expects int, got 'abc'"),
        (["device=tpu"], "valid values"),
        (["bogus"], "is not key=value"),
        (["rollout.backend=sglang"], "rollout.backend='sglang' is not available in this version; choices: hf, vllm"),
        (["resume=no_such_run"], "resume='no_such_run': no_such_run has no checkpoint to resume from"),
        (["cluster.nodes=[{name: a, devices: 2, tags: [{x: 1}]}]"], "cluster.nodes[0].tags holds {'x': 1}: tags are strings"),
        (["cluster.nodes=[{name: a, devices: 2, count: -1}]"], "cluster.nodes[0].count=-1 must be >= 1"),
    ],
)
def test_run_user_errors_exit_2_without_traceback(tidal_cli, tmp_path, args, message):
    out = tidal_cli("run", "quickstart_cpu", *args, "--check", cwd=tmp_path)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing is written for an invalid config"


def test_run_missing_recipe(tidal_cli, tmp_path):
    out = tidal_cli("run", "no_such_recipe", cwd=tmp_path)
    assert out.returncode == 2 and "shipped recipes" in out.stderr


def test_run_platform_that_cannot_load_exits_1(tidal_cli, tmp_path):
    out = tidal_cli("run", "quickstart_cpu", "device=npu", "--check", cwd=tmp_path)
    assert out.returncode == 1 and "torch_npu" in out.stderr and "Traceback" not in out.stderr


def test_config_prints_resolved_and_keys(tidal_cli):
    out = tidal_cli("config", "quickstart_cpu", "seed=5")
    assert out.returncode == 0 and yaml.safe_load(out.stdout)["seed"] == 5
    keys = tidal_cli("config", "--keys")
    assert keys.returncode == 0
    for word in ("seed", "device", "runtime", "one of local | ray", "TIDAL_DEVICE"):
        assert word in keys.stdout
    assert tidal_cli("--version").stdout.startswith("tidal ")


LAYOUTS = {
    "disaggregated": [],
    "colocated": ["placement.rollout.requires=[]", "placement.rollout.colocate_with=train"],
    "hybrid": ["placement.rollout.requires=[]", "placement.rollout.colocate_with=train", "placement.rollout.count=16"],
    "multiplexed": ["placement.rollout.requires=[]", "placement.train.lend_to=rollout"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_prints_the_four_layouts_of_the_mixed_cluster(tidal_cli, layout):
    out = tidal_cli("plan", "mixed_npu_gpu", *LAYOUTS[layout])
    assert out.returncode == 0, out.stderr
    assert f"plan: {layout}" in out.stdout and "npu-1" in out.stdout and "gpu-1" in out.stdout
    data = json.loads(tidal_cli("plan", "mixed_npu_gpu", *LAYOUTS[layout], "--json").stdout)
    assert data["layout"] == layout and data["cluster_from"] == "recipe"
    train = [a for a in data["assignments"] if a["role"] == "train"]
    assert len(train) == 16 and {a["node"] for a in train} == {"npu-0", "npu-1"}


def test_plan_reverse_assignment_and_infeasible_request(tidal_cli):
    data = json.loads(tidal_cli("plan", "mixed_npu_gpu", "placement.train.requires=[gpu]", "placement.rollout.requires=[npu]", "--json").stdout)
    assert {a["kind"] for a in data["assignments"] if a["role"] == "train"} == {"cuda"}
    assert {a["kind"] for a in data["assignments"] if a["role"] == "rollout"} == {"npu"}
    out = tidal_cli("plan", "mixed_npu_gpu", "placement.rollout.count=9")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot place role 'rollout'" in out.stderr and "1 more do not fit" in out.stderr


def test_bench_systems_choose_what_store_and_weights_measure_and_name_an_unknown_one(tidal_cli):
    out = tidal_cli("bench", "weights", "--systems", "ipc,ipc-placed", "--sizes", "1", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert sorted(json.loads(out.stdout)) == ["ipc", "ipc-placed"]
    out = tidal_cli("bench", "weights", "--systems", "ipc,shm")
    assert out.returncode == 2 and "unknown system(s) ['shm']; systems: host, collective, ipc, ipc-placed" in out.stderr
    out = tidal_cli("bench", "store", "--systems", "tidal,nats")
    assert out.returncode == 2 and "unknown system(s) ['nats']" in out.stderr
    out = tidal_cli("bench", "e2e", "--systems", "tidal-async,tidal-asink")
    assert out.returncode == 2 and "unknown system(s) ['tidal-asink']; systems: tidal-async, tidal-sync" in out.stderr


def test_bench_overrides_are_for_e2e_only(tidal_cli):
    out = tidal_cli("bench", "weights", "device=cuda")
    assert out.returncode == 2 and "weights takes no recipe overrides (got device=cuda); only e2e does" in out.stderr
    out = tidal_cli("bench", "store", "--repeats", "1", "device=cuda", "seed=2")  # after an option too
    assert out.returncode == 2 and "store takes no recipe overrides (got device=cuda seed=2)" in out.stderr


@pytest.mark.parametrize(("option", "value"), [("--seeds", "a"), ("--seeds", "0,,x"), ("--seeds", ","), ("--sizes", "4,big")])
def test_bench_number_lists_that_are_not_numbers_are_usage_errors(tidal_cli, option, value):
    name = "e2e" if option == "--seeds" else "weights"
    out = tidal_cli("bench", name, option, value)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"argument {option}: {value!r} is not a comma-separated list of integers" in out.stderr


def test_a_finished_run_resumed_with_no_step_left_lists_only_the_files_it_wrote(tidal_cli, tmp_path):
    """Resuming a run whose steps are all done trains nothing: its new directory gets the
    checkpoint (and the timeline), the run's record (metrics.jsonl and its plot), and the
    closing line names only what is there."""
    small = ["sft.steps=0", "task.num_eval_prompts=8", "algorithm.num_steps=1", "tensorboard=false", "--no-progress"]
    done, again = tmp_path / "done", tmp_path / "again"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={done}", *small, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"tidal: run directory {done} (metrics.jsonl, timeline.json, progress.png, checkpoints/)" in out.stdout
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={again}", f"resume={done}", *small, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("tidal: run directory"))
    assert line == f"tidal: run directory {again} (metrics.jsonl, timeline.json, progress.png, checkpoints/)"
    assert (again / "timeline.json").is_file() and (again / "checkpoints" / "latest").is_file()
    assert (again / "metrics.jsonl").read_text() == (done / "metrics.jsonl").read_text() and (again / "progress.png").is_file()


def test_a_kl_run_keeps_the_warm_start_as_its_reference_through_a_resume(tidal_cli, tmp_path):
    """`algorithm.kl_coef > 0`: the trainer keeps the warm start's weights as the reference
    policy (KL 0 at the first step, above 0 later), checkpoints them, and a resumed run goes
    on against that reference, not against the checkpoint's weights."""
    import json

    import torch
    from safetensors.torch import load_file

    small = ["task.num_eval_prompts=20", "sft.steps=20", "algorithm.kl_coef=0.05", "checkpoint_every=5", "--no-progress"]
    run_dir, resumed = tmp_path / "run", tmp_path / "resumed"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", "algorithm.num_steps=10", *small, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    kl = [json.loads(line)["kl"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and max(kl) > 0
    saved = torch.load(run_dir / "checkpoints" / "step-000010" / "trainer.pt", weights_only=False)["reference"]
    warm = load_file(run_dir / "cache" / "warm_start" / "model.safetensors")
    assert warm.keys() <= saved.keys() and all(torch.equal(saved[k], warm[k]) for k in warm)

    out = tidal_cli("run", "quickstart_cpu", f"run_dir={resumed}", f"resume={run_dir}", "algorithm.num_steps=12", *small, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    again = [json.loads(line)["kl"] for line in (resumed / "metrics.jsonl").read_text().splitlines()][10:]  # after the resumed run's steps
    assert len(again) == 2 and min(again) > 0  # against the warm start: the checkpoint's own weights would give 0 at step 11
    saved = torch.load(resumed / "checkpoints" / "step-000012" / "trainer.pt", weights_only=False)["reference"]
    assert all(torch.equal(saved[k], warm[k]) for k in warm)


def test_the_held_out_accuracy_of_a_built_in_verifier_is_labelled_strict():
    from tidal.tools.cli import strict_reward
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe

    def cfg(*overrides):
        return load_config(resolve_recipe("quickstart_cpu"), list(overrides))

    assert strict_reward(cfg()) and strict_reward(cfg("task.name=countdown")) and strict_reward(cfg("task.reward=math"))
    assert not strict_reward(cfg("task.reward=tidal_test_rewards:starts_with_seven"))
