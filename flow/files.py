"""Writing a file whole: through a temporary file beside it, renamed over it.

A reader (a resumed run, Perfetto, the Ray driver) then finds the old contents or the
new, never half of either, even after a kill or a full disk part way.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Raise an operating-system error from inside that names no file as one naming `path`.
    A write the disk refuses (full, over quota) fails at a flush or close, where Python's
    error names no file, and `tidal run` can then only print a traceback instead of the
    file to free space for."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` through `.<name>.<pid>.<thread>.tmp` beside it, renamed over
    it (a temporary file of each writer's own: two threads writing one file, such as a Ray
    run's info file, neither rename the other's half-written one nor find it gone).

    Raises:
        OSError: naming `path`, also where the temporary file was refused (a read-only
            folder: its open fails, naming it); the temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with naming(path):
            tmp.write_text(text)
            os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename == str(tmp):
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
