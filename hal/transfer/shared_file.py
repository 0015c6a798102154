"""Host buffers other processes of the node map by path: a file in /dev/shm, named for its
holder (`tidal.hal.owner`), so that what a killed holder left behind is deleted by the next
one on the host (or `tidal doctor --clean`).

`SharedFile` makes one (its pages taken at once: a full /dev/shm fails there, not as a
SIGBUS on a write into the mapping) and deletes it when closed, dropped or at exit;
`map_shared` maps one another process made. The `ipc` weight transport keeps its host
buffer in one; the `vllm` rollout engine hands weights to its workers through one.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from tidal.hal import owner
from tidal.hal.transfer import TransferError

SHM = Path(owner.DIR) if Path(owner.DIR).is_dir() else Path(tempfile.gettempdir())
"""Where shared files live (a temporary folder where the host has no /dev/shm)."""
_names = itertools.count()


class SharedFile:
    """A host buffer of `nbytes` in a file of `SHM`, mapped here (`buffer`, uint8)."""

    def __init__(self, nbytes: int, *, prefix: str = "tidal-weights", remedy: str = "give it more room (e.g. docker run --shm-size)") -> None:
        """Raises TransferError, naming the size, the folder's free space and `remedy`, when
        the folder cannot hold `nbytes`."""
        owner.sweep(str(SHM))  # what killed holders left behind (their exit handlers never ran)
        self.path = SHM / owner.tagged(f"{prefix}-{os.getpid()}-{next(_names)}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._unlink = weakref.finalize(self, self.path.unlink, missing_ok=True)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as e:
            self.close()
            free = shutil.disk_usage(SHM).free
            raise TransferError(f"cannot hold {nbytes / 2**20:.1f} MiB of weights in {SHM} ({free / 2**20:.1f} MiB free: {e.strerror}): {remedy}") from None
        finally:
            os.close(fd)
        self.buffer = torch.from_file(str(self.path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def close(self) -> None:
        """Delete the file (once) and drop this mapping (`buffer` then holds nothing); tensors
        mapped from it elsewhere keep their pages until they go."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._unlink()


def map_shared(path: str, nbytes: int, *, what: str = "shared weight buffer") -> torch.Tensor:
    """The whole file `path` (in `SHM`) mapped as uint8, shared with its writer.

    Raises:
        TransferError: naming `what` and `path`: outside `SHM`, missing or unreadable (its
            holder closed it, died, or runs on another host), or shorter than `nbytes`.
    """
    if not path.startswith(str(SHM) + os.sep) or "/.." in path:
        raise TransferError(f"{what} {path!r} is outside {SHM}")
    try:
        size = os.path.getsize(path)
        mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError) as e:  # torch.from_file raises RuntimeError
        raise TransferError(f"cannot map the {what} {path!r} ({getattr(e, 'strerror', None) or e}): its holder closed it or died, or runs on another host") from None
    if size < nbytes:
        raise TransferError(f"{what} {path!r} holds {size} bytes, {nbytes} are needed")
    return mapped
