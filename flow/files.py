"""Writing a file whole: through a temporary file beside it, renamed over it.

A reader (a resumed run, Perfetto, the Ray driver) then finds the old contents or the
new, never half of either, even after a kill or a full disk part way.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` through `.<name>.<pid>.tmp` beside it, renamed over it.

    Raises:
        OSError: naming `path` (a write the disk refuses fails at the file's close, where
            Python's error names no file); the temporary file is removed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
