"""The real `tidal` command on mistakes and on pipes: exit codes, messages, no tracebacks."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

SIGPIPE_EXIT = 128 + 13


def _tidal_into_closed_pipe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`tidal ARGS | head -0`, deterministically: stdout is a pipe whose reader is gone
    before tidal writes anything, so every write to it fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    exe = Path(sys.executable).with_name("tidal")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tidal.tools.cli"]
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    try:
        return subprocess.run([*cmd, *args], stdout=write_end, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [("config", "--keys"), ("config", "quickstart_cpu"), ("--version",)])
def test_output_into_a_closed_pipe_ends_quietly_with_the_sigpipe_exit_code(tmp_path, args):
    """`tidal config --keys | head` printed a BrokenPipeError traceback and exited 1 (or,
    when the output was still buffered at exit, "Exception ignored ... BrokenPipeError" and
    120). A reader that went away stops the command as SIGPIPE would: 128 + 13, no noise."""
    out = _tidal_into_closed_pipe(*args, cwd=tmp_path)
    assert out.returncode == SIGPIPE_EXIT, out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr and "Exception ignored" not in out.stderr


@pytest.mark.parametrize(
    ("key", "where"),
    [("run_dir", "/proc/tidal-no-such-run"), ("output_dir", "/proc/tidal-no-such-runs"), ("run_dir", "{file}/run")],
)
def test_a_run_directory_that_cannot_be_made_is_named_with_the_reason_and_exit_2(tidal_cli, tmp_path, key, where):
    """A run_dir or output_dir on a read-only path (/proc), or under a file, raised a
    FileNotFoundError / NotADirectoryError traceback with exit 1."""
    (tmp_path / "a_file").write_text("x")
    where = where.format(file=tmp_path / "a_file")
    out = tidal_cli("run", "quickstart_cpu", f"{key}={where}", "--check", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"{key}={where!r}" in out.stderr and "cannot create" in out.stderr
    assert "choose a writable run_dir or output_dir" in out.stderr


def test_an_override_written_as_an_option_suggests_the_key_value_form(tidal_cli, tmp_path):
    """`tidal run quickstart_cpu --seed=3` said only "unrecognized arguments: --seed=3"."""
    out = tidal_cli("run", "quickstart_cpu", "--seed=3", "--check", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unrecognized arguments: --seed=3" in out.stderr
    assert "overrides are key=value without dashes: seed=3" in out.stderr
    assert not (tmp_path / "runs").exists()
    out = tidal_cli("doctor", "--seed=3")  # doctor takes no overrides: no suggestion
    assert out.returncode == 2 and "without dashes" not in out.stderr


def test_a_full_disk_is_one_line_naming_the_file_with_exit_1(tmp_path):
    """A write the disk refuses (here a file-size limit of 64 bytes stands in for a full
    disk: config.yaml is longer) printed an OSError traceback."""
    import resource
    import signal

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing tidal
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))

    exe = Path(sys.executable).with_name("tidal")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tidal.tools.cli"]
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    run_dir = tmp_path / "run"
    out = subprocess.run([*cmd, "run", "quickstart_cpu", f"run_dir={run_dir}", "--check"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, preexec_fn=small_files)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == []  # no half-written config.yaml, nor its temporary file
    assert f"cannot write {run_dir / 'config.yaml'}: File too large; free space there, or choose another run_dir or output_dir" in out.stderr


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=["read_only_filesystem", "no_permission"])
def test_an_existing_run_dir_that_takes_no_write_is_named_with_the_reason_and_exit_2(tmp_path, monkeypatch, capsys, code):
    """An empty run_dir on a read-only mount said "cannot write <run_dir>/.config.yaml.<pid>.<thread>.tmp:
    Read-only file system; free space there" (exit 1), and one this user may not write
    printed a PermissionError traceback. Writes are refused as the kernel refuses them (the
    temporary file's open fails, naming it): tests run as root, whom a chmod does not stop."""
    from tidal.tools.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_text = Path.write_text

    def refused(self: Path, *args, **kwargs):
        if self.parent == run_dir:
            raise OSError(code, os.strerror(code), str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refused)
    assert main(["run", "quickstart_cpu", f"run_dir={run_dir}", "--check"]) == 2
    err = capsys.readouterr().err
    assert err == f"tidal run: error: run_dir={str(run_dir)!r}: cannot write the run directory {str(run_dir)!r} ({os.strerror(code)}); choose a writable run_dir or output_dir\n"
    assert list(run_dir.iterdir()) == []


def test_help_lists_the_exit_codes_of_a_stopped_command(tidal_cli):
    """The top-level help named 0, 1 and 2 only; 130/143 (a run stopped by a signal) and
    141 (a closed pipe) were nowhere but in `tidal run --help` and the architecture page."""
    text = " ".join(tidal_cli("--help").stdout.split())
    assert "128 + the signal's number when stopped by one (130 Ctrl-C, 143 SIGTERM, 141" in text


def test_a_misspelt_recipe_name_suggests_the_close_shipped_one(tidal_cli, tmp_path):
    """`tidal run quickstart_cu` listed every shipped recipe; as for keys, the close match is named."""
    out = tidal_cli("run", "quickstart_cu", "--check", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "recipe 'quickstart_cu' is neither a file nor a shipped recipe; did you mean quickstart_cpu?" in out.stderr
    from tidal.tools.recipes import shipped_recipes

    names = sorted(path.stem for path in shipped_recipes())
    assert {"gsm8k_qwen", "quickstart_cpu", "rlhf_qwen"} <= set(names) and f"shipped recipes: {names}" in out.stderr  # every one, in order


def test_an_override_of_one_list_entry_is_a_usage_error_naming_the_list(tidal_cli, tmp_path):
    """`tidal plan mixed_npu_gpu cluster.nodes[0].devices=4` printed OmegaConf's
    "TypeError: Cannot merge incompatible container types" traceback and exited 1."""
    out = tidal_cli("config", "mixed_npu_gpu", "cluster.nodes[0].devices=4", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "key 'cluster.nodes' in the command-line overrides expects a list of NodeConfig, got a mapping" in out.stderr
    assert "a list is given whole (cluster.nodes=[...])" in out.stderr


def test_config_without_a_recipe_takes_overrides_of_the_schema_defaults(tidal_cli, tmp_path):
    """`tidal config [recipe] [key=value ...]`, the recipe defaulting to the schema's: but
    `tidal config seed=5` took `seed=5` for the recipe and failed, "neither a file nor a
    shipped recipe"."""
    import yaml

    out = tidal_cli("config", "seed=5", "name=no", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert (cfg["seed"], cfg["name"], cfg["device"]) == (5, "no", "auto")


@pytest.mark.parametrize("command", [("run", "quickstart_cpu", "--check"), ("plan", "quickstart_cpu"), ("bench", "e2e", "--steps", "1")])
def test_a_tidal_device_that_names_no_platform_is_a_usage_error_for_run_and_plan(tidal_cli, tmp_path, command):
    """`tidal doctor` answered a bad TIDAL_DEVICE with exit 2 and the valid values; `tidal
    run` and `tidal plan` printed a ValueError traceback and exited 1."""
    out = tidal_cli(*command, env={"TIDAL_DEVICE": "bogus"}, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"tidal {command[0]}: error: TIDAL_DEVICE='bogus' is not a platform; valid values: auto, cpu" in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("name", "option", "value"), [("store", "--repeats", "0"), ("store", "--trials", "0"), ("store", "--put-window", "0"), ("e2e", "--steps", "-1"), ("weights", "--sizes", "4,0")])
def test_a_bench_count_below_one_is_a_usage_error(name, option, value, capsys):
    """`--repeats 0` was a traceback (`max()` of no runs) once the first system was set up;
    `--sizes 0` measured an empty model at 0.00 GB/s."""
    from tidal.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", name, option, value])
    assert e.value.code == 2 and f"argument {option}: " in capsys.readouterr().err


@pytest.mark.parametrize("name", ["store", "weights"])
def test_bench_systems_that_name_no_system_are_a_usage_error(name, capsys):
    """`--systems ,` ran nothing, and `tidal bench weights` then failed on its empty table
    with a StopIteration traceback."""
    from tidal.tools.cli import main

    assert main(["bench", name, "--systems", ","]) == 2
    assert "--systems ',' names no system; systems: " in capsys.readouterr().err
