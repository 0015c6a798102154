"""Files in /dev/shm named for their holder, and the sweep that deletes what killed
processes left (`tidal.hal.owner`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tidal.hal import owner
from tidal.hal.cpu import CpuPlatform
from tidal.hal.transfer.ipc import IpcSender

pytestmark = pytest.mark.skipif(owner.tag() is None, reason="needs /proc")


def _dead_tag() -> str:
    """The tag of a process of this namespace that has exited (and been reaped)."""
    out = subprocess.run([sys.executable, "-c", "from tidal.hal import owner; print(owner.tag())"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_tag_names_this_process_and_a_file_changes_hands_by_rename():
    namespace, pid, started = owner.tag().split(".")
    assert int(pid) == os.getpid() and int(namespace, 16) == os.stat("/proc/self/ns/pid").st_ino and int(started) > 0
    mine = owner.tagged("tidal-abc-0")
    assert mine == f"tidal-abc-0@{owner.tag()}"
    assert owner.retag(f"tidal-abc-0@{_dead_tag()}") == mine and owner.retag(mine) == mine
    assert not owner.is_orphan(mine)  # we are running


def test_only_files_of_gone_holders_in_this_namespace_are_swept(tmp_path):
    namespace, pid, started = owner.tag().split(".")
    names = {
        "dead": f"tidal-1-0@{_dead_tag()}",
        "reused pid": f"tidal-2-0@{namespace}.{pid}.{int(started) + 1}",  # our pid, another start: the holder is gone
        "alive": owner.tagged("tidal-3-0"),
        "other namespace": f"tidal-4-0@{int(namespace, 16) + 1:x}.1.1",  # cannot tell: kept
        "untagged": "tidal-5-0",
        "not ours": f"other-6-0@{_dead_tag()}",  # another prefix
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert {k: owner.holder(v) for k, v in names.items()} == {
        "dead": "gone", "reused pid": "gone", "alive": "running", "other namespace": "unknown", "untagged": "unknown", "not ours": "gone"
    }
    removed = owner.sweep(str(tmp_path))
    assert sorted(removed) == sorted([names["dead"], names["reused pid"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k not in ("dead", "reused pid"))
    assert owner.sweep(str(tmp_path)) == []  # nothing more to do
    assert owner.sweep(str(tmp_path / "missing")) == []  # never raises


def test_a_zombie_holder_counts_as_gone(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]
        name = f"tidal-7-0@{owner.tag().split('.')[0]}.{child.pid}.{started}"
        (tmp_path / name).write_bytes(b"x")
        assert not owner.is_orphan(name)
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        assert owner.is_orphan(name) and owner.sweep(str(tmp_path)) == [name]
    finally:
        child.kill()
        child.wait()


def test_a_killed_weight_sender_leaves_a_file_the_next_sender_deletes():
    script = textwrap.dedent("""
        import os, signal, torch
        from tidal.hal.cpu import CpuPlatform
        from tidal.hal.transfer.ipc import IpcSender
        sender = IpcSender(CpuPlatform())
        sender._ensure(4096, torch.device("cpu"))
        print(sender._path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    left = out.stdout.strip()
    assert os.path.exists(left) and owner.is_orphan(os.path.basename(left))
    sender = IpcSender(CpuPlatform())
    try:
        sender._ensure(4096, torch.device("cpu"))
        assert not os.path.exists(left) and os.path.exists(sender._path)
    finally:
        sender.close()
