"""Every train backend takes the torch engine's steps on a local Hugging Face checkpoint,
through the real `tidal run gsm8k_qwen` (one rank, `runtime: local`): deepspeed and
megatron on CPU, all four on a GPU.

The engines' own tests compare them with the torch engine on the tiny built-in model
(tests/engines); this one goes the user's way: the checkpoint loaded with
`AutoModelForCausalLM` (for megatron, converted to megatron-core's GPTModel), the
rollout engine fed each backend's weights, the recipe's loss, sampling cut to top-k and
top-p (a backend taking its logprobs without the cut would weigh every token's behavior
importance weight otherwise, and its loss would differ). `max_staleness=0` makes the
runs repeat each other, so the first steps' loss and gradient norm must agree up to float32
noise (1e-5 relative, seen 1e-7 on CPU), the rewards exactly, and the weights each
backend's last checkpoint holds within two steps of lr (AdamW turns float noise in a
near-zero gradient, such as an unused token's embedding's, into a step of up to lr; seen
5e-5 at lr 1e-2), so a weight saved under another name, layout or shard would show.

On a real GPU (`gpu` marker) the same in float32, and each backend's mixed-precision step
(`train.precision=bf16`, the recipe's default) runs and stays finite: no GPU has run
the deepspeed, fsdp or megatron engines yet (issue 39).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

LR = 0.001
BACKENDS = {"torch": None, "fsdp": None, "deepspeed": "deepspeed", "megatron": "megatron.core"}
"""Each train backend and the package it needs beyond tidal's own."""
SMALL = [
    "threads=1", "tensorboard=false", "rollout.max_new_tokens=4", "algorithm.num_steps=2", "algorithm.prompts_per_step=4",
    "algorithm.group_size=4", "algorithm.max_staleness=0", "train.micro_batch_size=8", f"train.lr={LR}", "checkpoint_every=100",
    "model.gradient_checkpointing=false", "task.reward=tidal_test_rewards:first_token_even", "rollout.top_k=40", "rollout.top_p=0.9", "--no-progress",
]  # fmt: skip


def _installed(backends) -> list[str]:
    import importlib.util

    return [b for b in backends if BACKENDS[b] is None or importlib.util.find_spec(BACKENDS[b].split(".")[0]) is not None]


def _steps(tidal_cli, runs, tmp_path: Path, tiny_hf_dir: Path, gsm8k_files: dict, *, backend: str, device: str, precision: str) -> list[dict]:
    run_dir = tmp_path / f"{backend}-{device}-{precision}"
    data = [f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_parquet']}]"]
    out = tidal_cli(
        "run", "gsm8k_qwen", f"run_dir={run_dir}", *data, *SMALL, f"device={device}", f"train.backend={backend}", f"train.precision={precision}",
        env={"PYTHONPATH": str(Path(__file__).parent)}, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, f"{backend}: {out.stderr[-3000:]}"
    steps = runs.steps(run_dir)
    assert [m["step"] for m in steps] == [1, 2], backend
    return steps


def _assert_agree(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files, *, device: str, backends: tuple[str, ...] = tuple(BACKENDS), steps: int = 2) -> None:
    """The first `steps` steps' rewards, losses and gradient norms, and the last checkpoint's weights."""
    backends = _installed(backends)
    got = {b: _steps(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files, backend=b, device=device, precision="fp32") for b in backends}
    want = got["torch"]
    assert any(m["loss"] != 0.0 for m in want), "no step had a signal: the comparison would prove nothing"
    weights = {b: _final_weights(tmp_path / f"{b}-{device}-fp32") for b in backends}
    for backend in backends[1:]:
        for step, (g, w) in enumerate(zip(got[backend][:steps], want[:steps], strict=True), start=1):
            assert g["reward"] == w["reward"], (backend, step)  # the same rollouts: each backend gave the rollout engine the same weights
            for key in ("loss", "grad_norm"):
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (backend, step, key)
        assert weights[backend].keys() == weights["torch"].keys(), backend  # each backend's checkpoint: the Hugging Face names, gathered whole
        for name, tensor in weights["torch"].items():
            torch.testing.assert_close(weights[backend][name], tensor, atol=LR * 2, rtol=0, msg=lambda m, name=name: f"{backend}: {name}: {m}")


def _final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / "step-000002" / "model.safetensors")


def test_every_train_backend_takes_the_torch_engines_steps_on_a_local_checkpoint(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files):
    _assert_agree(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files, device="cpu", backends=("torch", "deepspeed", "megatron"))  # fsdp against torch on CPU: tests/tools/test_fsdp_run.py


@pytest.mark.gpu
def test_gpu_every_train_backend_takes_the_torch_engines_steps_and_runs_in_bf16(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files):
    _assert_agree(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files, device="cuda", steps=1)  # the second step's samples may differ: a GPU's kernels differ between backends by float noise, which can tip a sampled token
    for backend in _installed(BACKENDS):
        for m in _steps(tidal_cli, runs, tmp_path, tiny_hf_dir, gsm8k_files, backend=backend, device="cuda", precision="bf16"):
            assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["nonfinite_grad"] == 0, (backend, m)
