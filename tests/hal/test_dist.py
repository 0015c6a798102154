"""`Platform.init_process_group` across two real processes (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from tidal.hal import current_platform
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    platform = current_platform()
    if rank == 0:  # rank 0 makes the rendezvous store on a port the OS picks and says which
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        print(json.dumps({"port": store.port}), flush=True)
        platform.init_process_group(rank=rank, world_size=world, store=store, timeout_s=60)
    else:
        platform.init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60)
    t = torch.full((4,), float(rank + 1), device=platform.device())
    dist.all_reduce(t)
    objs = [None] * world
    dist.all_gather_object(objs, platform.descriptor.to_dict())
    print(json.dumps({"sum": t.tolist(), "backend": dist.get_backend(), "peers": objs}))
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("device", ["cpu", "fake:npu:8"])
def test_two_process_all_reduce(device):
    """Rank 0 joins with a store it made (port 0: no port to race for), rank 1 with its address."""
    world = 2
    env = {**os.environ, "TIDAL_DEVICE": device, "GLOO_SOCKET_IFNAME": "lo"}

    def start(rank: int, port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(world), str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [start(0, 0)]
    results = []
    try:
        first = procs[0].stdout.readline()
        assert first, procs[0].communicate(timeout=60)[1]
        port = json.loads(first)["port"]
        assert port > 0
        procs.append(start(1, port))
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
