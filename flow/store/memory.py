"""A store process keeps the memory it frees, to take the next rows in.

A store server holds every row until all its consumers have acked it, then frees it; the
next put's frames land in fresh allocations. glibc hands blocks over 128 KB (a 256-row
column of int64[256] is 512 KB) straight from the kernel with `mmap` and gives them back
on free, so every batch pays page faults on memory the kernel has to zero again, which
bounds a store process's throughput of large rows. Asking glibc to serve blocks up to
32 MB from its heap and not to trim the heap lets freed rows' pages carry the next rows
(what it gives: `tidal bench store`'s `tidal-tuned` rows in docs/benchmarks.md).

The cost: the process's resident memory stays at its high-water mark (for a store, the
partitions' capacity) instead of shrinking when it drains. So this is for processes that
are store servers - the store actor, a storage-unit actor, `tidal bench store`'s tuned
store process - and is never applied to a user's process behind its back.

A process that is a store server (those, and `tidal store serve`'s) also leaves the objects of its start-up (torch's and NumPy's modules: over
100,000 of them) out of Python's garbage collections (`freeze_startup_objects`): else the
first full collection, which its first few thousand rows trigger, walks them all and holds
every request up for 60-75 ms on this project's 2-vCPU machine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HEAP_BLOCK_MAX = 32 << 20
"""The largest block glibc can be asked to serve from its heap (its M_MMAP_THRESHOLD
ceiling on 64-bit); larger ones are always mapped and unmapped."""
TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of the heap that glibc keeps before giving any back (2 GiB, the
most `mallopt` takes)."""


def retain_freed_memory() -> bool:
    """Make this process's allocator reuse freed blocks up to `HEAP_BLOCK_MAX` instead of
    returning them to the kernel. True when applied; False (logged, harmless) where the C
    library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.info("store: C library %r has no mallopt; freed memory goes back to the system", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_MAX) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return ok


def freeze_startup_objects() -> int:
    """Collect this process's garbage once, then move every object left to the collector's
    permanent generation (`gc.freeze`), which no later collection walks: for a store
    server's process, once it is set up. The number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
