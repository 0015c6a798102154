"""`Platform.init_process_group` across two real processes (gloo on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from tidal.hal import current_platform
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    platform = current_platform()
    platform.init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60)
    t = torch.full((4,), float(rank + 1), device=platform.device())
    dist.all_reduce(t)
    objs = [None] * world
    dist.all_gather_object(objs, platform.descriptor.to_dict())
    print(json.dumps({"sum": t.tolist(), "backend": dist.get_backend(), "peers": objs}))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", ["cpu", "fake:npu:8"])
def test_two_process_all_reduce(device):
    port, world = _free_port(), 2
    env = {**os.environ, "TIDAL_DEVICE": device, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), str(world), str(port)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:  # only the processes this test started
            if p.poll() is None:
                p.kill()
    for r in results:
        assert r["sum"] == [3.0] * 4
        assert r["backend"] == "gloo"
        assert [peer["kind"] for peer in r["peers"]] == [device.split(":")[-2] if ":" in device else "cpu"] * 2
