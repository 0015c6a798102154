"""`MetricsLog` when the disk refuses a step's line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path


def _with_step_2_refused(run_dir: Path, then: str) -> subprocess.CompletedProcess:
    """In a process of its own: write step 1, have the disk refuse step 2 (a file-size limit
    stands in for a full disk; "refused: <why> <file>" is printed), then run `then`."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        from tidal.tools.metrics import MetricsLog
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        log = MetricsLog(Path({str(run_dir)!r}), tensorboard=False)
        step = lambda n: {{"step": n, "time": 1.0, "reward": 0.5, "note": "x" * 60}}
        log.write(step(1))
        size = (Path({str(run_dir)!r}) / "metrics.jsonl").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 30, resource.RLIM_INFINITY))
        try:
            log.write(step(2))
        except OSError as e:
            print("refused:", e.strerror, e.filename)
        """
    ) + textwrap.dedent(then)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_a_refused_line_names_the_file_and_is_written_whole_once_there_is_room(tmp_path):
    """A full disk made `write` raise an OSError that named no file (`tidal run` could only
    print a traceback). The line is not lost or cut: it is written, whole and in order, by
    the next write once the disk has room."""
    out = _with_step_2_refused(
        tmp_path,
        """
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        log.write(step(3))
        log.close()
        """,
    )
    assert f"refused: File too large {tmp_path / 'metrics.jsonl'}" in out.stdout
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_closing_on_a_disk_that_still_refuses_the_line_names_the_file(tmp_path):
    """The run that a refused line stops closes its metrics on the way out, on the same full
    disk: `close` raised an OSError that named no file, in place of `write`'s (so `tidal run`
    printed a traceback instead of the file to free space for)."""
    out = _with_step_2_refused(
        tmp_path,
        """
        try:
            log.close()
        except OSError as e:
            print("close refused:", e.strerror, e.filename)
        log.close()  # closed already: nothing more to say
        """,
    )
    assert out.stdout.splitlines() == [f"refused: File too large {tmp_path / 'metrics.jsonl'}", f"close refused: File too large {tmp_path / 'metrics.jsonl'}"]
