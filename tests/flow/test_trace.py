"""`Tracer`: spans in Chrome trace format, and another process's spans merged onto its clock."""

from __future__ import annotations

import json
import time

from tidal.flow.trace import Tracer, Waits


def test_spans_are_saved_as_tracks_of_one_process(tmp_path):
    tracer = Tracer()
    with tracer.span("train", "train", step=1):
        pass
    tracer.instant("rollout", "paused")
    tracer.save(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == ["tidal"]
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"train", "rollout"}
    (span,) = [e for e in events if e["ph"] == "X"]
    assert span["name"] == "train" and span["args"] == {"step": 1} and span["dur"] >= 0


def test_a_merged_tracer_becomes_a_process_of_its_own_on_this_clock(tmp_path):
    here = Tracer()
    time.sleep(0.05)
    there = Tracer()  # started 50 ms later: its zero is 50 ms into `here`'s timeline
    with there.span("rollout", "generate", samples=8):
        time.sleep(0.01)
    with here.span("train", "train"):
        pass
    exported = json.loads(json.dumps(there.export()))  # what travels back from an actor: plain data
    here.merge(exported, process="rollout actor 0")
    assert [e["name"] for e in here.spans()] == ["train"]  # `spans` are this process's own
    here.save(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {1: "tidal", 2: "rollout actor 0"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks == {(1, 1): "train", (2, 1): "rollout"}
    (generate,) = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert generate["name"] == "generate" and generate["args"] == {"samples": 8}
    assert 40e3 < generate["ts"] < 1e6  # shifted by the 50 ms between the two starts
    assert generate["dur"] >= 10e3


def test_waits_added_while_they_are_taken_are_never_lost():
    import threading

    from tidal.flow.trace import Waits

    waits, taken, done = Waits(), [], threading.Event()

    def add():
        for _ in range(20000):
            waits.add("reward", 1.0)
        done.set()

    thread = threading.Thread(target=add)
    thread.start()
    while not done.is_set():
        taken.append(waits.take())
    thread.join()
    taken.append(waits.take())
    assert sum(t.get("reward", 0.0) for t in taken) == 20000.0
    assert waits.take() == {}


def test_a_wait_still_going_on_is_taken_in_parts_as_it_passes():
    waits = Waits()
    with waits.waiting("reward"):
        time.sleep(0.2)
        first = waits.take()
        time.sleep(0.1)
    second = waits.take()
    assert 0.2 <= first["reward"] < 0.3 and 0.1 <= second["reward"] < 0.2  # not 0, then 0.3
    assert waits.take() == {}
