"""`flow.files.write_whole`: the errors it raises name the file written, not its temporary file."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tidal.flow.files import write_whole


def test_a_write_into_a_folder_that_takes_none_names_the_file_not_its_temporary_one(tmp_path, monkeypatch):
    """A read-only folder refuses the temporary file's open, and the error named
    `.metrics.jsonl.<pid>.<thread>.tmp`, a file the user never heard of and that is not there.
    The write is refused as the kernel refuses it (tests run as root, whom a chmod does not stop)."""
    write_text = Path.write_text

    def read_only(self: Path, *args, **kwargs):
        if self.parent == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    with pytest.raises(OSError) as refused:
        write_whole(tmp_path / "metrics.jsonl", "{}\n")
    assert (refused.value.errno, refused.value.filename) == (errno.EROFS, str(tmp_path / "metrics.jsonl"))
    assert list(tmp_path.iterdir()) == []
