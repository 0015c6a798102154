"""This process's host memory as Linux reports it: the resident-set peak (procfs) and the
memory limit of the container or cgroup it runs in (cgroup v2 or v1).

The CPU and fake platforms build their memory figures on these. A container limited to
8 GiB on a 512 GiB host must report 8 GiB, not the host's memory: what a caller sizes
from `mem_get_info` (buffers, batch sizes) would otherwise get the process killed by
the kernel's OOM killer long before the host runs short. Everything here returns None
(or False) where the file is missing or unreadable (macOS, a kernel without it).

`PROC_SELF` and `CGROUP_ROOT` are read at each call, so tests point them at a fake tree.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_SELF = Path("/proc/self")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# (limit, usage, reclaimable page-cache key in memory.stat) of each cgroup version; both
# usages count the cgroup's whole subtree, as does the stat key.
_V2_FILES = ("memory.max", "memory.current", "inactive_file")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def status_kb(field: str) -> int | None:
    """A `kB` field of `/proc/self/status` (`VmRSS`, `VmHWM`), or None."""
    try:
        with open(PROC_SELF / "status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss() -> int | None:
    """The resident set's high-water mark (`VmHWM`) in bytes: since start or since the last
    successful `reset_peak_rss`; None where procfs does not report it."""
    kb = status_kb("VmHWM")
    return None if kb is None else kb * 1024


def reset_peak_rss() -> bool:
    """Reset `VmHWM` to the current resident set (write 5 to `clear_refs`, Linux >= 4.0);
    False where that is refused (no procfs, a sandbox such as gVisor, an older kernel)."""
    try:
        fd = os.open(PROC_SELF / "clear_refs", os.O_WRONLY)  # no O_CREAT: the kernel's file or nothing
    except OSError:
        return False
    try:
        os.write(fd, b"5")
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def cgroup_memory() -> tuple[int, int] | None:
    """`(free, limit)` in bytes under the tightest memory limit on this process's cgroup and
    its ancestors, or None where no limit is set or none can be read.

    `free` is the limit less what the cgroup uses, not counting inactive page cache
    (which the kernel reclaims before it kills; the "working set" kubelet and
    `docker stats` report). Each ancestor's limit holds too, so the least headroom and
    the least limit over the chain are returned.
    """
    found = [figures for folder, files in _cgroup_folders() if (figures := _limit_in(folder, files)) is not None]
    if not found:
        return None
    return min(free for free, _ in found), min(limit for _, limit in found)


def _cgroup_folders() -> list[tuple[Path, tuple[str, str, str]]]:
    """Folders of this process's memory cgroup and its ancestors, innermost first, each
    with its version's file names. A folder that does not exist is skipped: a container
    whose mount shows only its own cgroup lists the host's path for it."""
    found = _memory_cgroup()
    if found is None:
        return []
    base, files, path = found
    names = [p for p in path.strip("/").split("/") if p]
    if ".." in names:  # a cgroup outside this cgroup namespace's root: only the mount's root is ours
        names = []
    chain = [base.joinpath(*names[:depth]) for depth in range(len(names), -1, -1)]
    return [(folder, files) for folder in chain if folder.is_dir()]


def _memory_cgroup() -> tuple[Path, tuple[str, str, str], str] | None:
    """(mount, file names, cgroup path) of the hierarchy holding the memory controller,
    from `/proc/self/cgroup`: the v1 `memory` one when listed (a controller is in one
    hierarchy only), else the v2 unified one (`0::<path>`)."""
    try:
        lines = (PROC_SELF / "cgroup").read_text().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory", _V1_FILES, path
        if number == "0" and controllers == "":
            v2 = path
    return None if v2 is None else (CGROUP_ROOT, _V2_FILES, v2)


def _limit_in(folder: Path, files: tuple[str, str, str]) -> tuple[int, int] | None:
    """`(free, limit)` of one cgroup folder, or None when it sets no limit ("max" in v2;
    v1 writes a number near 2**63 for none, which the caller's min with the host's memory
    absorbs)."""
    limit_name, usage_name, cache_key = files
    try:
        text = (folder / limit_name).read_text().strip()
        if text == "max":
            return None
        limit = int(text)
        usage = int((folder / usage_name).read_text().strip())
    except (OSError, ValueError):
        return None
    working_set = max(0, usage - _stat(folder / "memory.stat", cache_key))
    return max(0, limit - working_set), limit


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's `memory.stat`; 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return 0
    return 0
