"""Host memory on the cpu and fake platforms: cgroup limits and the resident-set peak,
read from a fake procfs and cgroup tree (`hostmem.PROC_SELF`, `hostmem.CGROUP_ROOT`)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tidal.hal import hostmem
from tidal.hal.cpu import CpuPlatform, fake_platform

GIB = 2**30
UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 writes for no limit


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """(proc, cgroup) folders standing in for /proc/self and /sys/fs/cgroup."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    monkeypatch.setattr(hostmem, "PROC_SELF", proc, raising=False)
    monkeypatch.setattr(hostmem, "CGROUP_ROOT", cgroup, raising=False)
    return proc, cgroup


@pytest.fixture(params=["cpu", "fake:npu:2"])
def platform(request):
    return CpuPlatform() if request.param == "cpu" else fake_platform("npu", 2)


def test_a_cgroup_v2_limit_below_the_host_is_what_mem_get_info_reports(fake_tree, platform):
    """A container limited to 2 GiB on a bigger host: total is the limit, free is the limit
    less the working set (usage without inactive page cache, which the kernel reclaims)."""
    proc, cgroup = fake_tree
    (proc / "cgroup").write_text("0::/\n")
    _write(cgroup, {"memory.max": f"{2 * GIB}\n", "memory.current": f"{GIB}\n", "memory.stat": f"anon {GIB // 2}\ninactive_file {GIB // 4}\nactive_file 0\n"})
    assert psutil.virtual_memory().total > 2 * GIB  # the host has more: else this proves nothing
    free, total = platform.mem_get_info()
    assert total == 2 * GIB
    assert free == min(2 * GIB - (GIB - GIB // 4), psutil.virtual_memory().available)


def test_the_tightest_limit_on_the_path_of_a_v2_cgroup_wins(fake_tree, platform):
    """Each ancestor's memory.max holds too (a pod's limit over its container's); folders of
    the path that the mount does not show are skipped."""
    proc, cgroup = fake_tree
    (proc / "cgroup").write_text("0::/kubepods/pod1/ctr\n")
    _write(cgroup / "kubepods", {"memory.max": "max\n", "memory.current": f"{3 * GIB}\n"})
    _write(cgroup / "kubepods" / "pod1", {"memory.max": f"{GIB}\n", "memory.current": f"{GIB // 2}\n"})
    _write(cgroup / "kubepods" / "pod1" / "ctr", {"memory.max": f"{3 * GIB // 2}\n", "memory.current": f"{GIB // 4}\n"})
    assert hostmem.cgroup_memory() == (GIB // 2, GIB)  # the pod's headroom and limit, not the container's
    assert platform.mem_get_info()[1] == GIB


def test_a_cgroup_outside_the_namespace_root_reads_the_mount_root(fake_tree):
    """A cgroup namespace shows a cgroup outside its root as `/../x`: never a folder above
    the mount."""
    proc, cgroup = fake_tree
    (proc / "cgroup").write_text("0::/../other\n")
    _write(cgroup, {"memory.max": f"{GIB}\n", "memory.current": "0\n"})
    _write(cgroup.parent / "other", {"memory.max": "1\n", "memory.current": "0\n"})  # beside the mount: not ours
    assert hostmem.cgroup_memory() == (GIB, GIB)


def test_a_cgroup_v1_memory_limit_is_read_from_its_own_hierarchy(fake_tree, platform):
    """v1 (and hybrid hosts): the `memory` controller's line and folder; a path the mount
    does not show (a container sees only its own cgroup at the mount's root) falls back
    to the mount's root."""
    proc, cgroup = fake_tree
    (proc / "cgroup").write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n")
    _write(cgroup / "memory", {"memory.limit_in_bytes": f"{GIB}\n", "memory.usage_in_bytes": f"{GIB // 2}\n", "memory.stat": f"inactive_file 1\ntotal_inactive_file {GIB // 4}\n"})
    assert hostmem.cgroup_memory() == (GIB - GIB // 4, GIB)
    assert platform.mem_get_info() == (min(GIB - GIB // 4, psutil.virtual_memory().available), GIB)


@pytest.mark.parametrize(
    ("cgroup_line", "files"),
    [
        ("0::/\n", {"memory.max": "max\n", "memory.current": "100\n"}),
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": UNLIMITED_V1 + "\n", "memory/memory.usage_in_bytes": "100\n"}),
        ("0::/\n", {}),  # no memory controller files (the v2 root cgroup, a hybrid host)
        (None, {}),  # no /proc/self/cgroup (macOS)
    ],
    ids=["v2-max", "v1-unlimited", "no-files", "no-procfs"],
)
def test_no_cgroup_limit_reports_the_host(fake_tree, platform, cgroup_line, files):
    proc, cgroup = fake_tree
    if cgroup_line is not None:
        (proc / "cgroup").write_text(cgroup_line)
    for name, text in files.items():
        _write((cgroup / name).parent, {Path(name).name: text})
    free, total = platform.mem_get_info()
    assert total == psutil.virtual_memory().total
    assert 0 < free <= total


def test_usage_above_the_limit_reports_no_free_memory_not_a_negative_number(fake_tree, platform):
    proc, cgroup = fake_tree
    (proc / "cgroup").write_text("0::/\n")
    _write(cgroup, {"memory.max": f"{GIB}\n", "memory.current": f"{GIB + 4096}\n"})
    assert platform.mem_get_info() == (0, GIB)


class _Rss:
    """A resident set the test sets, in place of psutil's."""

    def __init__(self, platform: CpuPlatform, value: int) -> None:
        self.value = value
        platform.memory_allocated = lambda: self.value  # type: ignore[method-assign]


def _status(proc: Path, *, hwm_kb: int) -> None:
    (proc / "status").write_text(f"Name:\tpython\nVmPeak:\t999999 kB\nVmHWM:\t{hwm_kb} kB\nVmRSS:\t1 kB\n")


def test_a_reset_the_kernel_refuses_still_starts_the_peak_over(fake_tree, platform):
    """Where clear_refs cannot be written (a sandbox, an old kernel), the kernel's peak is
    the one since start: the peak since the reset is the sampled resident set until the
    kernel's peak rises past its value at the reset, and that peak from then on."""
    proc, _ = fake_tree  # no clear_refs in it: writing it fails
    _status(proc, hwm_kb=1000)
    rss = _Rss(platform, 400 * 1024)
    assert platform.max_memory_allocated() == 1000 * 1024  # since start: the kernel's
    platform.reset_peak_memory_stats()
    assert platform.max_memory_allocated() == 400 * 1024  # not the 1000 kB before the reset
    rss.value = 700 * 1024
    assert platform.max_memory_allocated() == 700 * 1024
    rss.value = 300 * 1024
    assert platform.max_memory_allocated() == 700 * 1024  # a peak, not the current figure
    _status(proc, hwm_kb=1200)  # a new high since the reset: exact again
    assert platform.max_memory_allocated() == 1200 * 1024
    platform.reset_peak_memory_stats()
    assert platform.max_memory_allocated() == 300 * 1024


def test_a_reset_the_kernel_takes_reads_its_peak(fake_tree, platform):
    proc, _ = fake_tree
    _status(proc, hwm_kb=1000)
    (proc / "clear_refs").write_text("")
    rss = _Rss(platform, 400 * 1024)
    platform.reset_peak_memory_stats()
    assert (proc / "clear_refs").read_text() == "5"
    _status(proc, hwm_kb=rss.value // 1024)  # what the kernel does on "5"
    assert platform.max_memory_allocated() == 400 * 1024


def test_without_procfs_the_peak_is_sampled(fake_tree, platform):
    rss = _Rss(platform, 500)
    assert platform.max_memory_allocated() == 500
    rss.value = 200
    platform.reset_peak_memory_stats()
    assert platform.max_memory_allocated() == 200
