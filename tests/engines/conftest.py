"""Helpers shared by the engine tests of this folder that run a process group of real processes.

A worker script is written into the test's folder and run once per rank (a plain `pytest`
run cannot import `tests.*` in a child); it reads what to do from `data.pt` there
(`write_rank_data`) and writes its results beside it. The helpers are handed to tests as
session fixtures (`spawn`, `write_data`, `six_rows`, `run_torch`): test files of this folder cannot
import each other or this file.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engines.tiny import CharTokenizer
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (rank 0 hosts the group's store there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_WORKER = Path(__file__).with_name("rank_worker.py")
"""What the worker scripts share (`import rank_worker`): copied beside each."""


def _rank_worker() -> Any:
    """`rank_worker.py` as a module (this folder is no package, and pytest imports it with importlib)."""
    spec = importlib.util.spec_from_file_location("rank_worker", RANK_WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spawn_ranks(work: Path, script: str, world: int = 2, device: str | None = None) -> None:
    """Run `script` as ranks 0 .. world-1 of one group (gloo on CPU, or the `device` platform's
    backend); fail with every rank's exit code and log if one fails. The ranks run with
    faulthandler on, so a crash in native code (a SIGABRT from a C++ thread at exit, say)
    leaves each thread's Python stack in its rank's log."""
    from tidal.engines.fsdp_train import TORCHRUN_VARS  # torch.distributed only for the tests that spawn

    (work / "worker.py").write_text(script)
    shutil.copyfile(RANK_WORKER, work / RANK_WORKER.name)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_DEVICE", *TORCHRUN_VARS)}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **({"TIDAL_DEVICE": device} if device else {}))
    logs = [work / f"rank{rank}.log" for rank in range(world)]  # files, not pipes: a full pipe would stall a rank
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            procs.append(subprocess.Popen([sys.executable, "-X", "faulthandler", str(work / "worker.py"), str(rank), str(world), str(port), str(work)], env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=300)
        codes = [p.returncode for p in procs]
        assert codes == [0] * world, "\n".join(f"rank {rank} exited {code}:\n{log.read_text()[-3000:]}" for rank, (code, log) in enumerate(zip(codes, logs)))
    finally:
        for p in procs:  # only the processes this helper started
            if p.poll() is None:
                p.kill()
                p.wait()


def write_rank_data(work: Path, batch: TokenBatch, advantages: torch.Tensor, **fields: Any) -> None:
    """`work/data.pt`, what the worker scripts load: the batch (its fields as a tuple, in
    `TokenBatch` order), the advantages, and `fields` (each rank's rows under "shards", the
    model's and the engine's keyword arguments, ...)."""
    torch.save({"batch": batch.tensors(), "advantages": advantages, **fields}, work / "data.pt")


def six_row_batch(tokenizer: CharTokenizer) -> tuple[TokenBatch, torch.Tensor]:
    """Six rows of different lengths; rows 2 and 3 have no policy token (no loss), rows 4
    and 5 no advantage (both engines skip all four in policy steps: in an SPMD pair whose
    rank 0 holds rows 0-3, rank 1 has no row to run)."""
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(6):
        prompt = torch.randint(3, tokenizer.vocab_size, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        tokens = torch.randint(3, tokenizer.vocab_size, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        t = Trajectory(prompt_ids=prompt)
        if row in (2, 3):
            t.append_env(tokens)
        else:
            t.extend(tokens, (-0.5 - 3 * torch.rand(len(tokens), generator=g)).tolist(), 0)
        trajectories.append(t)
    advantages = torch.randn(6, generator=g)
    advantages[4:] = 0.0
    return to_token_batch(trajectories, pad_id=tokenizer.pad_id), advantages


@pytest.fixture(scope="session")
def run_torch():
    """`run_torch(engine, batch, advantages, plan)`: `rank_worker.run_plan`, the steps the rank
    processes take, on a `TorchTrainEngine` (the reference they are held to)."""
    return _rank_worker().run_plan


@pytest.fixture(scope="session")
def spawn():
    """`spawn(work, script, world=2, device=None)`: see `spawn_ranks`."""
    return spawn_ranks


@pytest.fixture(scope="session")
def write_data():
    """`write_data(work, batch, advantages, **fields)`: see `write_rank_data`."""
    return write_rank_data


@pytest.fixture(scope="module")
def six_rows() -> tuple[TokenBatch, torch.Tensor]:
    """`six_row_batch` for the character tokenizer: (batch, advantages), one per test file."""
    return six_row_batch(CharTokenizer())
