"""Test-session settings shared by every folder.

Hardware markers: `gpu` tests run only where CUDA is usable, `npu` tests only where
torch_npu is installed; elsewhere they are skipped with the reason. CPU is the default.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tidal.tools.bench.fixture import build_tiny_hf_checkpoint, write_gsm8k_files

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tidal.hal import cuda, npu

    have = {"gpu": cuda.available(), "npu": npu.installed()}
    for item in items:
        for marker, ok in have.items():
            if item.get_closest_marker(marker) and not ok:
                item.add_marker(pytest.mark.skip(reason=f"needs a real {marker.upper()}"))


@pytest.fixture(autouse=True)
def _fresh_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test selects its platform from a clean slate."""
    from tidal.hal import reset_platform

    monkeypatch.delenv("TIDAL_DEVICE", raising=False)
    reset_platform()
    yield
    reset_platform()


def with_env(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment (less `TIDAL_DEVICE`) with `env` over it, `PYTHONPATH`
    entries put before the inherited ones."""
    full_env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    for key, value in (env or {}).items():
        inherited = full_env.get(key) if key == "PYTHONPATH" else None
        full_env[key] = f"{value}{os.pathsep}{inherited}" if value and inherited else value
    return full_env


def run_tidal(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real `tidal` command (the console script beside this interpreter). A
    `PYTHONPATH` in `env` goes before the one this process has, not in its place: where the
    package is on the interpreter's path that way (a GPU machine's bundle), replacing it lost
    tidal itself (issue 40)."""
    full_env = with_env(env)
    exe = Path(sys.executable).with_name("tidal")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tidal.tools.cli"]
    return subprocess.run([*cmd, *args], env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def wait_for():
    """`wait_for(condition, timeout=5.0)`: poll `condition` until true (for effects that travel asynchronously); fail at the timeout."""
    return _wait_for


@pytest.fixture
def tidal_cli():
    return run_tidal


@pytest.fixture
def child_env():
    """`with_env(env)`: the environment `tidal_cli` gives a child process."""
    return with_env


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole test session (it costs ~4 s and ~370 MB to start); a Ray of
    its own (`address="local"`), never the cluster a `ray start` on this machine left for
    `ray.init()` to join (the deploy rehearsal starts one, maybe while this runs beside it)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


# --- a small Hugging Face checkpoint and GSM8K-format data files, built locally (tidal.tools.bench.fixture) ---


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Qwen2 checkpoint folder (`build_tiny_hf_checkpoint`), built once per session; do not modify it."""
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def gsm8k_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GSM8K-format train / eval files in jsonl and parquet (`write_gsm8k_files`), written once per session."""
    return write_gsm8k_files(tmp_path_factory.mktemp("gsm8k"))


REMOTE_CONFIG = '''from transformers import Qwen2Config


class TidalTestConfig(Qwen2Config):
    model_type = "tidal_test_qwen2"
'''
REMOTE_MODEL = '''from transformers import Qwen2ForCausalLM

from .configuration_tidal_test import TidalTestConfig


class TidalTestForCausalLM(Qwen2ForCausalLM):
    config_class = TidalTestConfig
'''


@pytest.fixture(scope="session")
def remote_code_hf_dir(tiny_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_hf_dir` as a checkpoint whose model is code of its own (config.json's `auto_map`
    naming the folder's configuration and modeling files), which transformers loads only with
    `trust_remote_code=True`; do not modify it."""
    folder = tmp_path_factory.mktemp("remote-code") / "tidal-test-qwen2"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "configuration_tidal_test.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tidal_test.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "model_type": "tidal_test_qwen2",
        "architectures": ["TidalTestForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tidal_test.TidalTestConfig", "AutoModelForCausalLM": "modeling_tidal_test.TidalTestForCausalLM"},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _drop_vllm() -> dict[str, Any]:
    gone = {k: m for k, m in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in gone:
        del sys.modules[k]
    return gone


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The fake vLLM 0.32.0 of tests/engines/fake_vllm importable as `vllm` (first on sys.path)
    for one test, then gone again; yields the `vllm` package."""
    saved = _drop_vllm()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "engines" / "fake_vllm"))
    import vllm

    assert vllm.FAKE
    yield vllm
    _drop_vllm()
    sys.modules.update(saved)
