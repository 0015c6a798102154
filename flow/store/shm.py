"""Shared memory for a message's large buffers between processes on one host.

Over a socket, every byte of a row is copied four times between a producer and a
consumer that talk through a store process (into the kernel and out, twice), and each
copy costs a thread's wake-up and the kernel's work on the socket. When the three share
a host, a message's buffers of at least `MIN_BYTES` go instead into one segment, a file
under `/dev/shm` (RAM): the sender writes them (`pwrite`), and the message carries only
(segment, offset, length) for each. The store server maps the segment and keeps its rows
as tensors over that mapping, so an in-process consumer gets views; when it hands those
rows to a consumer on the same host, the reply names the same segment again and that
consumer reads them once into memory of its own (`pread`). The rows are copied twice
(the sender's write, the consumer's read), with no socket between.

Segments are reused. A fresh file's pages cost the kernel more to allocate and zero than
the copy into them (a 8 MB buffer: about 4x), so once the store lets go of a segment the
server hands it back to its sender (renamed `.free`, under the sender's tag), and the
sender's next message of a size it fits goes into it (`Writer`). Reuse is safe because
nobody but the server maps a segment: consumers copy what they read, before their next
request, and until then the server keeps its last reply to them (and so the mapping).
A segment goes back only to a sender whose connection is still up; those handed back to a
connection that closes are unlinked (`Segments.disconnected`), as are a sender's own
unclaimed ones when it closes (`Writer.close`).

Ownership: the receiver that keeps the rows (the store server) owns a segment once it
has mapped it: when the last tensor over that mapping is freed, the file is handed back
to its sender or unlinked, so it lives as long as the store holds one of its rows, or
the server a reply that named it. Consumers read what they are handed after the server
has mapped it and before they ack those rows or send the server anything else; the
server keeps the last reply to each connection until its next request, and the store
lets go of rows only when every consumer has acked them (or a put replaced their cells),
so a segment is never reused or unlinked before a consumer has read it. A segment's name
ends in the tag of the process holding it (`tidal.hal.owner`): the sender's, after a
`.sent` mark, until the server maps it; the server takes it by renaming it (without the
mark, with its own tag), even in the sender's process, so the sender can tell which of
its segments it still holds: a client closed before the server read its put unlinks that
put's segment (`Writer.unlink`). A segment handed back is the sender's again (`.free`,
its tag). A sender killed before the server mapped its segment, or after it got one back,
or a store server killed before it let go of its rows, leaves the file behind; the next
store server to start on the host deletes it (`owner.sweep`), as does `tidal doctor
--clean`. Segment names are checked: nothing but `tidal-<hex>-<n>[.sent|.free][@<tag>]`
under `/dev/shm` is ever opened, renamed or unlinked. Segments are created mode 0600, so
the store server must run as the same user as its clients.

A sender falls back to socket frames when `/dev/shm` is missing, or when a new segment
would leave less than a reserve free (the larger of `RESERVE_MIN_BYTES` and
`RESERVE_FRACTION` of it, for collective libraries, DataLoader workers and others that
need it): a 64 MB Docker default is never used. The peers' `host_id`s, compared once per
connection, decide whether they share one `/dev/shm`.
"""

from __future__ import annotations

import bisect
import collections
import errno
import itertools
import logging
import mmap
import os
import re
import threading
import uuid
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tidal.hal import owner

log = logging.getLogger(__name__)

DIR = owner.DIR
MIN_BYTES = 64 << 10
"""Buffers from this size go into shared memory; smaller ones stay socket frames (below
it, opening and reading the segment costs about what the socket's copies do)."""
POOL_SEGMENTS = 64
POOL_BYTES = 256 << 20
"""A `Writer` remembers up to this many segments (and bytes) that it may get back; the
oldest beyond are forgotten: unlinked if they are back, else by the server when this
client disconnects. Those back and unused take that much of `/dev/shm` at most."""
RECLAIM_TRIES = 2
"""Segments a write tries to take back before it makes a new one (oldest first; one not
back yet goes to the end of the line)."""

_ALIGN = 64
SENT = ".sent"
"""The mark of a segment its sender still holds (the server has not taken it yet)."""
FREE = ".free"
"""The mark of a segment the server handed back to its sender, for its next message."""
_NAME = re.compile(rf"tidal-[0-9a-f]{{12}}-[0-9]+(?:{re.escape(SENT)}|{re.escape(FREE)})?(?:{owner.TAG_PATTERN})?")
_PAGE = mmap.ALLOCATIONGRANULARITY
_host_id: list[str | None] = []


class ShmError(ValueError):
    """A segment reference that cannot be followed (bad name, gone, out of range)."""


ENV_VAR = "TIDAL_STORE_SHM"
"""Set to 0 to keep every store byte on the sockets (read once per process)."""


def host_id() -> str | None:
    """Who shares this process's `/dev/shm`: the boot and the mount; None without one, or
    with shared memory turned off (`TIDAL_STORE_SHM=0`)."""
    if not _host_id:
        if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
            _host_id.append(None)
            return None
        try:
            st = os.stat(DIR)
            if not os.access(DIR, os.W_OK):
                raise PermissionError(DIR)
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            _host_id.append(f"{boot}:{st.st_dev}:{st.st_ino}")
        except OSError:
            _host_id.append(None)
    return _host_id[0]


def _path(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ShmError(f"not a tidal shared-memory segment name: {name!r}")
    return os.path.join(DIR, name)


def leftovers() -> dict[str, int]:
    """tidal's files now under `/dev/shm` and their sizes: store segments and weight
    buffers of running processes, and any that a killed process left behind."""
    out = {}
    try:
        with os.scandir(DIR) as entries:
            for entry in entries:
                if not entry.name.startswith("tidal-"):
                    continue
                try:
                    if entry.is_file(follow_symlinks=False):
                        out[entry.name] = entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue  # deleted meanwhile (its holder freed it): the others still count
    except OSError:
        pass
    return dict(sorted(out.items()))


RESERVE_FRACTION = 0.25
RESERVE_MIN_BYTES = 256 << 20
"""Writers leave the larger of these free in `/dev/shm` for everything else that needs
it (collective libraries, DataLoader workers, the weight transport); past that, rows go by socket."""


class Writer:
    """Writes a message's large buffers into a segment (the sender's side): one the server
    handed back when one fits, else a new one."""

    def __init__(self) -> None:
        self._prefix = f"tidal-{uuid.uuid4().hex[:12]}-"
        self._count = itertools.count()
        self._failed = False  # /dev/shm cannot be written at all
        self._full = False  # the last write found too little room (logged once per episode)
        self._pool: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Segments written and not given up, oldest first: base name (no mark, no tag) -> size."""
        self._pool_lock = threading.Lock()  # a client's threads share its writer
        self.num_by_socket = 0
        """Messages whose large buffers went by socket because `/dev/shm` was short of room."""
        self.num_reused = 0
        """Writes into a segment the server had handed back."""

    def write(self, buffers: Sequence[Any]) -> tuple[str, list[int]] | None:
        """Write `buffers` (contiguous arrays) into one segment; return its name and each
        buffer's offset, or None to send them as socket frames: shared memory is unusable,
        or a new segment would leave less than the reserve free."""
        if self._failed:
            return None
        offsets, size = [], 0
        for buf in buffers:
            offsets.append(size)
            size += -(-buf.nbytes // _ALIGN) * _ALIGN
        name = self._reclaim(size)
        fresh = name is None
        if name is None:
            if not has_room(size):
                self._short_of_room(f"{size} bytes would leave less than the reserve free")
                return None
            base = f"{self._prefix}{next(self._count)}"
            name = owner.tagged(base + SENT)
            try:
                fd = os.open(os.path.join(DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except OSError as e:
                log.warning("store: cannot write shared memory in %s (%s); sending rows over the socket", DIR, e)
                self._failed = True
                return None
            self._remember(base, size)
        else:
            fd = os.open(os.path.join(DIR, name), os.O_WRONLY)
        try:
            if fresh:  # a reused one keeps its size: the server maps it whole
                os.ftruncate(fd, size)
            for buf, offset in zip(buffers, offsets):
                view = memoryview(buf).cast("B")
                while view:  # pwrite may write less than asked
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
        except BaseException as e:  # no message will name it
            os.close(fd)
            self.unlink([name])
            if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise
            self._short_of_room(str(e))
            return None
        os.close(fd)
        self._full = False
        return name, offsets

    def _reclaim(self, size: int) -> str | None:
        """A segment the server handed back that fits `size` bytes (at most twice that), made
        ours again (`.sent`), or None. Tries the `RECLAIM_TRIES` oldest; one that came back
        too small or too large is unlinked."""
        with self._pool_lock:
            for base, capacity in list(self._pool.items())[:RECLAIM_TRIES]:
                sent = owner.tagged(base + SENT)
                try:
                    os.rename(os.path.join(DIR, owner.tagged(base + FREE)), os.path.join(DIR, sent))
                except OSError:
                    self._pool.move_to_end(base)  # not back yet (a consumer has not acked its rows), or gone with its server
                    continue
                if size <= capacity <= 2 * size:
                    self._pool.move_to_end(base)
                    self.num_reused += 1
                    return sent
                del self._pool[base]
                _unlink(os.path.join(DIR, sent))
        return None

    def _remember(self, base: str, size: int) -> None:
        with self._pool_lock:
            self._pool[base] = size
            while len(self._pool) > POOL_SEGMENTS or (len(self._pool) > 1 and sum(self._pool.values()) > POOL_BYTES):
                forgotten, _ = self._pool.popitem(last=False)
                _unlink(os.path.join(DIR, owner.tagged(forgotten + FREE)))  # back already: ours to drop; else the server drops it when we disconnect

    def discard(self, placed: Sequence[Sequence[Any]]) -> None:
        """Unlink the segments this writer wrote among `place`'s entries: their message
        was never sent (it failed after its buffers were written)."""
        self.unlink({entry[1] for entry in placed})

    def written(self, placed: Sequence[Sequence[Any]]) -> list[str]:
        """The segments among `place`'s entries that this writer wrote."""
        return sorted({entry[1] for entry in placed if entry[1].startswith(self._prefix)})

    def unlink(self, names: Iterable[str]) -> None:
        """Unlink those of `names` that this writer wrote and no server has taken yet (a
        taken one has another name now: it is left alone)."""
        for name in names:
            base = owner.TAG.sub("", name)
            if name.startswith(self._prefix) and base.endswith(SENT):
                with self._pool_lock:
                    self._pool.pop(base.removesuffix(SENT), None)
                _unlink(os.path.join(DIR, name))

    def close(self) -> None:
        """Unlink the segments the server handed back that this writer has not used again
        (those it still holds go when this client disconnects: `Segments.disconnected`)."""
        with self._pool_lock:
            bases, self._pool = list(self._pool), collections.OrderedDict()
        for base in bases:
            _unlink(os.path.join(DIR, owner.tagged(base + FREE)))

    def _short_of_room(self, why: str) -> None:
        if not self._full:
            log.warning("store: %s is short of room (%s); sending rows over the socket until it has room", DIR, why)
            self._full = True
        self.num_by_socket += 1


def has_room(size: int) -> bool:
    """Whether `size` more bytes in `/dev/shm` leave the reserve free."""
    try:
        st = os.statvfs(DIR)
    except OSError:
        return False
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return free - size >= max(RESERVE_MIN_BYTES, RESERVE_FRACTION * total)


class Segments:
    """Segments this process reads. With `own` (a store server), it maps each whole and
    keeps it while tensors over it live, then hands it back to its sender (or unlinks it);
    without (a client), it copies the buffers it is handed out of them.

    `find` says whether a buffer lies in one of the owned segments, so a reply can name
    the segment instead of sending the bytes again.
    """

    def __init__(self, *, own: bool) -> None:
        self.own = own
        self._lock = threading.RLock()  # a finalizer run by the garbage collector may take it inside our own critical section
        self._bases: list[int] = []  # sorted start addresses of the owned mappings
        self._spans: dict[int, tuple[int, str, weakref.ref]] = {}  # start -> (size, name, the mapping while it lives)
        self._live: set[Any] = set()  # the connections (`origin`s) segments may go back to
        self._returned: dict[str, tuple[Any, str]] = {}  # base name -> (origin, name) of the segments handed back
        self._closed = False
        self.num_mapped = 0
        """Segments an owner mapped."""
        self.num_read = 0
        """Buffers a client copied out of segments."""
        self.num_referred = 0
        self.num_returned = 0
        """Segments an owner handed back to their sender."""

    def map(self, name: str, offset: int, nbytes: int, cache: dict[str, Any], origin: Any = None) -> memoryview:
        """The `nbytes` at `offset` of segment `name`. An owner maps a segment once, whole
        (`cache` holds this message's mappings) and may hand it back, once it lets go, to
        the connection `origin` that sent it (while `origin` is not `disconnected`); a
        client reads the bytes into memory of its own, through one descriptor per segment
        for the message (`cache` holds them until `done`)."""
        path = _path(name)
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or offset < 0 or nbytes < 0:
            raise ShmError(f"bad range ({offset!r}, {nbytes!r}) in segment {name}")
        if self.own:
            mm = cache.get(name)
            if mm is None:
                mm = cache[name] = self._map_owned(name, path, origin)
            if offset + nbytes > len(mm):
                raise ShmError(f"segment {name} holds {len(mm)} bytes; asked for {nbytes} at {offset}")
            return memoryview(mm)[offset : offset + nbytes]
        opened = cache.get(name)
        if opened is None:
            fd = _open(name, path)
            try:
                opened = cache[name] = (fd, os.fstat(fd).st_size)
            except OSError as e:
                os.close(fd)
                raise ShmError(f"cannot read segment {name}: {e}") from e
        fd, size = opened
        if offset + nbytes > size:
            raise ShmError(f"segment {name} holds {size} bytes; asked for {nbytes} at {offset}")
        out = np.empty(nbytes, dtype=np.uint8).data  # not zeroed: every byte is read into it
        done = 0
        try:
            while done < nbytes:  # preadv may read less than asked
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    raise ShmError(f"segment {name} ended at {offset + done} bytes; asked for {nbytes} at {offset}")
                done += n
        except OSError as e:
            raise ShmError(f"cannot read segment {name}: {e}") from e
        self.num_read += 1
        return out

    def done(self, cache: dict[str, Any]) -> None:
        """A message's buffers are read: close the descriptors a client opened for them
        (an owner's mappings live on in the tensors over them)."""
        if not self.own:
            for fd, _ in cache.values():
                os.close(fd)
        cache.clear()

    def _map_owned(self, name: str, path: str, origin: Any) -> mmap.mmap:
        bare = owner.TAG.sub("", name)
        back = None
        if origin is not None and bare.endswith(SENT):  # where it goes once we let go: its sender's, marked free
            back = bare.removesuffix(SENT) + FREE + name[len(bare) :]
        held = owner.retag(bare.removesuffix(SENT))  # ours now: a sweep tells by the name whether its holder is gone
        if held != name:
            try:
                os.rename(path, os.path.join(DIR, held))
            except FileNotFoundError:
                raise ShmError(f"segment {name} does not exist: its sender was killed, or the file was deleted") from None
            except OSError as e:
                raise ShmError(f"cannot take over segment {name}: {e}") from e
            name, path = held, os.path.join(DIR, held)
        fd = _open(name, path)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                _unlink(path)
                raise ShmError(f"segment {name} is empty")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:  # e.g. ENOMEM: vm.max_map_count mappings already; the sender's put fails
            _unlink(path)  # the request was ours to serve, so was its segment
            raise ShmError(_cannot_map(name, e)) from e
        finally:
            os.close(fd)
        base = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
        alive = weakref.ref(mm)
        with self._lock:
            if base not in self._spans:  # else a dead mapping's entry at this address, not yet finalized
                bisect.insort(self._bases, base)
            self._spans[base] = (size, name, alive)
            self._returned.pop(bare.removesuffix(SENT), None)  # taken back by its sender and sent again
            if back is not None:
                self._live.add(origin)
        weakref.finalize(mm, self._unmapped, base, path, alive, back, origin)
        self.num_mapped += 1
        return mm

    def _unmapped(self, base: int, path: str, alive: weakref.ref, back: str | None, origin: Any) -> None:
        """The last tensor over an owned segment is gone: hand it back to its sender (`back`,
        while its connection `origin` is up), else unlink it. CPython unmaps the pages first,
        with the GIL released, so a new mapping may already sit at this address: only the
        entry of this mapping (`alive`) is removed."""
        with self._lock:
            entry = self._spans.get(base)
            if entry is not None and entry[2] is alive:
                del self._spans[base]
                k = bisect.bisect_left(self._bases, base)
                if k < len(self._bases) and self._bases[k] == base:
                    del self._bases[k]
            if back is not None and origin in self._live and not self._closed:
                try:
                    os.rename(path, os.path.join(DIR, back))
                except OSError:
                    pass  # gone meanwhile (a sweep, a clean-up): nothing to hand back
                else:
                    self._returned[owner.TAG.sub("", back).removesuffix(FREE)] = (origin, back)
                    self.num_returned += 1
                    return
        _unlink(path)

    def disconnected(self, origin: Any) -> None:
        """The connection `origin` is gone: no segment goes back to it from now on, and
        those handed back to it that its client has not taken again are unlinked."""
        with self._lock:
            self._live.discard(origin)
            gone = [key for key, (o, _) in self._returned.items() if o == origin]
            names = [self._returned.pop(key)[1] for key in gone]
        for name in names:
            _unlink(os.path.join(DIR, name))

    def find(self, buf: np.ndarray) -> tuple[str, int] | None:
        """(segment, offset) when `buf` lies inside a live owned segment, else None."""
        address = buf.__array_interface__["data"][0]
        with self._lock:
            k = bisect.bisect_right(self._bases, address) - 1
            if k < 0:
                return None
            base = self._bases[k]
            size, name, alive = self._spans[base]
        if alive() is None or address + buf.nbytes > base + size:  # a dying mapping reads as dead
            return None
        self.num_referred += 1
        return name, address - base

    def __len__(self) -> int:
        """How many owned segments are mapped now."""
        return len(self._spans)

    def unlink_all(self) -> None:
        """Unlink every owned segment and every one handed back and not taken again (the
        server is closing; mappings stay valid, and none goes back from now on)."""
        with self._lock:
            self._closed = True
            names = [name for _, name, _ in self._spans.values()] + [name for _, name in self._returned.values()]
            self._returned.clear()
        for name in names:
            _unlink(os.path.join(DIR, name))


def _cannot_map(name: str, error: OSError) -> str:
    return f"cannot map segment {name}: {error} (too many mappings? raise vm.max_map_count, or set {ENV_VAR}=0 to send rows over the socket)"


def _open(name: str, path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise ShmError(f"segment {name} does not exist: its rows were acked by every consumer, or the store restarted") from None
    except OSError as e:
        raise ShmError(f"cannot open segment {name}: {e}") from e


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def place(buffers: Sequence[Any], *, writer: Writer | None = None, owned: Segments | None = None) -> list[list[Any]]:
    """Which of a message's buffers go by shared memory: `[[index, segment, offset, nbytes],
    ...]`. A buffer already inside an `owned` segment is named where it lies; the others of
    at least `MIN_BYTES` go into one segment by `writer` (when given)."""
    placed, fresh = [], []
    for i, buf in enumerate(buffers):
        if buf.nbytes < MIN_BYTES:
            continue
        where = owned.find(buf) if owned is not None else None
        if where is not None:
            placed.append([i, where[0], where[1], buf.nbytes])
        elif writer is not None:
            fresh.append(i)
    if fresh:
        written = writer.write([buffers[i] for i in fresh])  # type: ignore[union-attr]
        if written is not None:
            name, offsets = written
            placed += [[i, name, offset, buffers[i].nbytes] for i, offset in zip(fresh, offsets)]
    return placed
