"""Files in `/dev/shm` that name the process holding them.

tidal keeps large host buffers in `/dev/shm` (the store's segments, the weight
transport's buffers). A process that is killed (SIGKILL, an out-of-memory kill, a Ray
actor being stopped) runs none of its exit handlers, so its files stay in RAM until
someone deletes them. Each such file's name therefore ends in its holder's *tag*,
`@<pid namespace>.<pid>.<start time>`, and `sweep` deletes the files whose holder is
gone: same pid namespace (a pid means nothing in another one), and that pid is not
running, is a zombie, or started at another time (the pid was reused). A file whose
holder cannot be told (another pid namespace, no tag, no `/proc`) is never touched.

A holder hands a file to another process by renaming it to that process's tag
(`retag`): rename is atomic, so a sweep sees the file under exactly one holder.
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

DIR = "/dev/shm"
TAG_PATTERN = r"@([0-9a-f]+)\.([0-9]+)\.([0-9]+)"
"""A holder's tag: `@<pid namespace, hex>.<pid>.<start time, clock ticks>`."""
TAG = re.compile(TAG_PATTERN + "$")
"""The tag at the end of a held file's name."""
_tags: dict[int, str | None] = {}  # pid -> its tag (a forked child computes its own)


def _namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _started(pid: int | str) -> tuple[int, str] | None:
    """(start time, state) of `pid` from `/proc/<pid>/stat`, or None when it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[19]), fields[0].decode()  # fields 22 and 3 of proc(5)


def tag() -> str | None:
    """This process's tag, or None where it cannot be told (no `/proc`)."""
    pid = os.getpid()
    if pid not in _tags:
        namespace, started = _namespace(), None
        try:
            started = _started("self")
        except (OSError, ValueError, IndexError):
            pass
        _tags[pid] = None if namespace is None or started is None else f"{namespace:x}.{pid}.{started[0]}"
    return _tags[pid]


def tagged(name: str) -> str:
    """`name` held by this process (unchanged where this process has no tag)."""
    mine = tag()
    return f"{name}@{mine}" if mine else name


def retag(name: str) -> str:
    """The name a file called `name` takes when this process holds it."""
    return tagged(TAG.sub("", name))


def holder(name: str) -> str:
    """Whose the file `name` is: "running" (its holder runs), "gone" (its holder, of this
    pid namespace, is not running, is a zombie, or its pid was reused), or "unknown" (no
    tag, another pid namespace, or no `/proc` to tell)."""
    match = TAG.search(name)
    namespace = _namespace()
    if match is None or namespace is None or int(match[1], 16) != namespace:
        return "unknown"
    try:
        running = _started(match[2])
    except (OSError, ValueError, IndexError):
        return "unknown"
    return "gone" if running is None or running[1] in ("Z", "X") or running[0] != int(match[3]) else "running"


def is_orphan(name: str) -> bool:
    """Whether the file `name` was held by a process of this pid namespace that is gone."""
    return holder(name) == "gone"


def sweep(directory: str = DIR, prefix: str = "tidal-") -> list[str]:
    """Delete the files under `directory` named `prefix...@<tag>` whose holder is gone;
    return their names. Never raises: a sweep is housekeeping."""
    removed: list[str] = []
    try:
        with os.scandir(directory) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix) and e.is_file(follow_symlinks=False)]
    except OSError:
        return removed
    for name in names:
        if is_orphan(name):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                continue  # taken over or deleted meanwhile
            removed.append(name)
    if removed:
        log.info("removed %d files from %s that killed tidal processes left behind", len(removed), directory)
    return removed
