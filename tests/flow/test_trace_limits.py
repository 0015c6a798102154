"""`Tracer` on long and broken runs: a bounded size, spans that never ended, a save that fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

from tidal.flow.trace import Tracer


def _saved(path) -> dict:
    return json.loads(path.read_text())


def test_a_long_run_keeps_the_most_recent_spans_up_to_the_bound_and_says_how_many_it_dropped(tmp_path):
    """Every span stayed in memory until the end of the run: about 6 events a quickstart
    step at 540 bytes each, so 100k steps held ~340 MB in the trainer and wrote a ~90 MB
    file. The tracer keeps the most recent `max_events` of its own and counts the rest."""
    from tidal.flow.trace import MAX_EVENTS

    assert 50_000 <= MAX_EVENTS <= 500_000
    tracer = Tracer(max_events=100)
    for step in range(1, 1001):
        with tracer.span("train", "train", step=step):
            pass
    assert [e["args"]["step"] for e in tracer.spans()] == list(range(901, 1001))
    there = Tracer(max_events=10)
    for step in range(30):
        with there.span("rollout", "generate", step=step):
            pass
    tracer.merge(json.loads(json.dumps(there.export())), process="rollout actor 0")
    tracer.save(tmp_path / "t.json")
    saved = _saved(tmp_path / "t.json")
    spans = [e for e in saved["traceEvents"] if e["ph"] == "X"]
    assert len([e for e in spans if e["pid"] == 1]) == 100 and len([e for e in spans if e["pid"] == 2]) == 10
    assert saved["otherData"]["dropped_events"] == {"tidal": 900, "rollout actor 0": 20}


def test_a_span_that_never_ended_is_saved_up_to_now_and_marked_unfinished(tmp_path):
    """A stage stuck inside a span (a hung generate, a thread that never came back) was
    missing from the timeline altogether: exactly the span one opens the timeline to find."""
    tracer = Tracer()
    inside, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with tracer.span("rollout", "generate", samples=8):
            inside.set()
            release.wait()

    thread = threading.Thread(target=stuck)
    thread.start()
    inside.wait()
    with tracer.span("train", "train"):
        pass
    time.sleep(0.02)
    tracer.save(tmp_path / "t.json")
    exported = tracer.export()
    release.set()
    thread.join()
    events = _saved(tmp_path / "t.json")["traceEvents"]
    (generate,) = [e for e in events if e.get("name") == "generate"]
    assert generate["ph"] == "X" and generate["args"] == {"samples": 8, "unfinished": True} and generate["dur"] >= 20e3
    assert [e["name"] for e in exported["events"]] == ["train", "generate"]  # an actor's export carries it too
    tracer.save(tmp_path / "after.json")  # once it ends, it is an ordinary span
    (generate,) = [e for e in _saved(tmp_path / "after.json")["traceEvents"] if e.get("name") == "generate"]
    assert generate["args"] == {"samples": 8}


def test_a_save_that_fails_part_way_leaves_the_previous_timeline_whole(tmp_path):
    """`save` wrote over timeline.json in place: a full disk (or a kill) part way through
    the write left a cut-off file that Perfetto refuses, and the earlier attempt's timeline
    of a run resumed in its own directory was gone. A file-size limit stands in for the
    full disk here."""
    path = tmp_path / "timeline.json"
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        from tidal.flow.trace import Tracer
        small = Tracer()
        with small.span("train", "train"):
            pass
        small.save({str(path)!r})
        big = Tracer()
        for step in range(2000):
            with big.span("train", "train", step=step):
                pass
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
        try:
            big.save({str(path)!r})
        except OSError as e:
            print("save failed:", e.strerror, e.filename)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"save failed: File too large {path}" in out.stdout  # names the file
    events = _saved(path)["traceEvents"]  # the first save's, whole
    assert len([e for e in events if e["ph"] == "X"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]  # no temporary file left beside it
