"""A fake vLLM `Worker`: one tensor-parallel rank, its model runner holding a `FusedCausalLM`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vllm.model_executor.models.fused import FusedCausalLM
from vllm.v1.worker.worker_base import WorkerBase


class GPUModelRunner:
    def __init__(self, model: FusedCausalLM) -> None:
        self.model = model

    def get_model(self) -> FusedCausalLM:
        return self.model


class Worker(WorkerBase):
    """One rank: loads the checkpoint's weights into its model at start, as vLLM's loader does."""

    def __init__(self, model_dir: str, rank: int, *, trust_remote_code: bool = False) -> None:
        self.rank, self.model_dir = rank, Path(model_dir)
        self.model_runner = GPUModelRunner(FusedCausalLM(model_dir, trust_remote_code=trust_remote_code))
        self.load_model()
        self._saved: dict[str, torch.Tensor] | None = None

    def load_model(self) -> None:
        from safetensors.torch import load_file

        model = self.model_runner.model
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(self.model_dir.glob("*.safetensors")):
            weights.update(load_file(path))
        loaded = model.load_weights(weights.items())
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"Following weights were not initialized from checkpoint: {missing}")

    def get_model(self) -> FusedCausalLM:
        return self.model_runner.get_model()

    def sleep(self, level: int = 1) -> None:
        model = self.model_runner.model
        if level == 2:  # weights discarded: what is there after the wake-up is garbage
            for p in model.parameters():
                p.data.fill_(float("nan"))
        model.released = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            self.model_runner.model.released = False

    def update_weights(self, update_info: Any) -> None:
        raise NotImplementedError("vLLM's weight transfer engine is not part of the fake")

    def compute_weight_checksums(self) -> dict[str, str]:
        return {name: f"{float(p.double().sum()):.6e}" for name, p in self.get_model().named_parameters()}
