"""`RayRollouts` and its `QueuedSends`: what the trainer does not wait for under `runtime: ray`."""

from __future__ import annotations

import threading
import time

import pytest

from tidal.flow.ray import runtime
from tidal.flow.ray.runtime import QueuedSends, RayRollouts, RolloutActor


def test_put_returns_while_a_send_runs_and_the_newest_version_replaces_one_not_sent_yet():
    release, started, sent = threading.Event(), threading.Event(), []

    def send(version, source):
        started.set()
        assert release.wait(10)
        sent.append((version, source))

    sends = QueuedSends(send)
    sends.put(1, "weights 1")
    assert started.wait(10)  # version 1 is being sent and blocks ...
    sends.put(2, "weights 2")  # ... yet put returns
    sends.put(3, "weights 3")  # 2 was not sent yet: 3 replaces it
    assert sent == []
    release.set()
    sends.flush()
    assert sent == [(1, "weights 1"), (3, "weights 3")]
    assert sends.replaced == 1
    sends.close()


def test_a_failed_send_is_raised_by_the_next_put_and_flush_and_nothing_later_is_sent():
    sent = []

    def send(version, source):
        if version == 2:
            raise ConnectionError("receiver gone")
        sent.append(version)

    sends = QueuedSends(send)
    sends.put(1, None)
    sends.flush()
    sends.put(2, None)
    with pytest.raises(RuntimeError, match="sending weights to rollout failed: ConnectionError: receiver gone"):
        sends.flush()
    with pytest.raises(RuntimeError, match="receiver gone"):
        sends.put(3, None)
    assert sent == [1]
    assert isinstance(sends.error, ConnectionError) and sends.drain(1) is True  # stopping sees the error, does not wait


def test_drain_waits_for_the_send_in_progress_and_gives_up_at_its_timeout():
    release = threading.Event()
    sends = QueuedSends(lambda version, source: release.wait(10))
    sends.put(1, None)
    assert sends.drain(0.2) is False
    release.set()
    assert sends.drain(10) is True
    sends.close()


def test_close_ends_the_thread_and_a_flush_after_it_does_not_wait():
    release = threading.Event()
    sends = QueuedSends(lambda version, source: release.wait(10))
    sends.put(1, None)
    sends.put(2, None)
    sends.close()
    release.set()
    sends.flush()  # returns: closed
    sends._thread.join(10)
    assert not sends._thread.is_alive()


class _NoWiring:
    def attach(self, actors, which):
        pass


def _metrics_actor(answer_s: float):
    """A rollout actor stand-in whose `metrics` takes `answer_s` to answer (its process busy
    generating) and counts the calls."""
    import ray

    @ray.remote(num_cpus=0)
    class Answering:
        def __init__(self):
            self.calls = 0

        def describe(self):
            return {}

        def metrics(self):
            self.calls += 1
            time.sleep(answer_s)
            return {"paused_generations": self.calls, "handed_off": 2, "wait_s": {"weights": 0.25}}

        def num_calls(self):
            return self.calls

    return Answering.remote()


def test_rollout_metrics_never_wait_for_an_actor_busy_elsewhere(ray_session, wait_for):
    import ray

    actor = _metrics_actor(0.5)
    rollouts = RayRollouts([actor], _NoWiring())
    begin = time.perf_counter()
    assert rollouts.metrics() == {"paused_generations": 0, "handed_off": 0, "silent_rollouts": 0, "wait_s": {}}  # asked, not answered yet
    assert time.perf_counter() - begin < 0.4
    answered = []
    wait_for(lambda: answered.append(rollouts.metrics()) or answered[-1]["handed_off"] == 2)
    assert answered[-1] == {"paused_generations": 1, "handed_off": 2, "silent_rollouts": 0, "wait_s": {"weights": 0.25}}
    assert rollouts.metrics() == {"paused_generations": 1, "handed_off": 2, "silent_rollouts": 0, "wait_s": {}}  # asked again: the counts stand, no wait counted twice
    ray.kill(actor)


def test_rollout_metrics_call_ray_at_most_every_metrics_every_s(ray_session):
    import ray

    actor = _metrics_actor(0.0)
    rollouts = RayRollouts([actor], _NoWiring())
    begin = time.monotonic()
    steps = []
    while time.monotonic() - begin < 2.2 * runtime.METRICS_EVERY_S:  # a trainer stepping as fast as it can
        steps.append(rollouts.metrics())
    asked = ray.get(actor.num_calls.remote())
    assert len(steps) > 100 and 2 <= asked <= 3  # at 0, METRICS_EVERY_S and 2 * METRICS_EVERY_S
    assert sum(m["wait_s"].get("weights", 0.0) for m in steps) == 0.25 * (asked - 1)  # each answer counted once; the last is not in yet
    assert steps[-1]["paused_generations"] == asked - 1
    ray.kill(actor)


def test_rollout_counts_go_on_past_an_actor_restart(ray_session, wait_for, monkeypatch):
    """A restarted actor counts from 0 again; the run's totals keep what it counted before
    (they once fell back by it)."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=1)
    class Counting:
        def __init__(self):
            self.calls, self.started = 0, time.time_ns()

        def describe(self):
            return {}

        def metrics(self):
            self.calls += 1
            return {"paused_generations": self.calls, "handed_off": 10 * self.calls, "wait_s": {}, "started": self.started}

    monkeypatch.setattr(runtime, "METRICS_EVERY_S", 0.0)
    actor = Counting.remote()
    rollouts = RayRollouts([actor], _NoWiring())
    seen = []
    wait_for(lambda: seen.append(rollouts.metrics()) or seen[-1]["paused_generations"] >= 3)
    before = seen[-1]
    ray.kill(actor, no_restart=False)
    wait_for(lambda: seen.append(rollouts.metrics()) or seen[-1]["paused_generations"] > before["paused_generations"] + 1, timeout=30)
    counts = [(m["paused_generations"], m["handed_off"]) for m in seen]
    assert counts == sorted(counts), counts  # never back
    assert seen[-1]["handed_off"] == 10 * seen[-1]["paused_generations"]  # both counts carried alike
    ray.kill(actor)


class _PostingWiring:
    """A wiring that posts (as `IpcWiring` does); `collect` fails once while `fail_collect` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail_collect = False

    def attach(self, actors, which):
        self.calls.append(("attach", list(which)))

    def post(self, version, source):
        self.calls.append(("post", version, [name for name, _ in source.tensors()]))

    def post_again(self):
        self.calls.append(("post_again",))

    def collect(self, timeout_s=None):
        self.calls.append(("collect",) if timeout_s is None else ("collect", timeout_s))
        if self.fail_collect:
            self.fail_collect = False
            raise RuntimeError("a receiver went away")


def test_with_overlap_a_posting_transport_is_written_in_the_callers_thread_and_answered_before_the_next_version(ray_session):
    import torch

    wiring = _PostingWiring()
    rollouts = RayRollouts([], wiring, overlap=True)
    assert rollouts._queued is None  # no copy, no send thread: the post is the copy
    weights = [("w", torch.ones(2))]
    rollouts.publish(1, weights)
    assert wiring.calls == [("attach", []), ("collect",), ("post", 1, ["w"])]  # returned without waiting for the answers
    rollouts.publish(2, weights)
    assert wiring.calls[3:] == [("collect",), ("post", 2, ["w"])]  # version 1's answers first: the buffer is free again
    rollouts.flush()
    assert wiring.calls[5:] == [("collect",)]
    # a receiver died with version 2 out: Ray restarted it; it is wired in again and sent version 2 (still in the buffer)
    wiring.fail_collect = True
    rollouts._restarted.add(0)
    rollouts._died.set()
    rollouts.publish(3, weights)
    assert wiring.calls[6:] == [("collect",), ("attach", [0]), ("post_again",), ("collect",), ("post", 3, ["w"])]
    rollouts.stop()
    assert wiring.calls[-1] == ("collect", runtime.SEND_ON_STOP_S)  # the last version is in before the actors are told to stop
    # the trainer's step in progress publishes once more: the actors were told to stop, so nothing is posted, and stopping again waits for nothing
    rollouts.publish(4, weights)
    rollouts.stop()
    assert wiring.calls[-1] == ("collect", runtime.SEND_ON_STOP_S) and ("post", 4, ["w"]) not in wiring.calls
    assert len([c for c in wiring.calls if c[0] == "collect" and len(c) == 2]) == 1


def test_stopping_gives_up_on_a_posted_version_nobody_takes_with_a_warning(ray_session, caplog):
    import torch

    wiring = _PostingWiring()
    rollouts = RayRollouts([], wiring, overlap=True)
    rollouts.publish(1, [("w", torch.ones(2))])
    wiring.fail_collect = True  # as the real collect does at SEND_ON_STOP_S when a receiver does not answer
    begin = time.monotonic()
    rollouts.stop()
    assert time.monotonic() - begin < 5  # no wait for a dead actor to come back
    assert "was not taken as the run ended" in caplog.text


def test_a_failed_collect_with_no_actor_dead_is_raised_by_the_next_publish(ray_session, monkeypatch):
    import torch

    monkeypatch.setattr(runtime, "DEATH_NOTICE_S", 0.1)
    wiring = _PostingWiring()
    rollouts = RayRollouts([], wiring, overlap=True)
    rollouts.publish(1, [("w", torch.ones(2))])
    wiring.fail_collect = True
    with pytest.raises(RuntimeError, match="a receiver went away"):
        rollouts.publish(2, [("w", torch.ones(2))])
    assert ("post", 2, ["w"]) not in wiring.calls


class _Worker:
    def __init__(self, stopping: threading.Event) -> None:
        self.stopped = stopping
        self.num_samples = self.num_paused = self.num_handed_off = 0
        self.versions_applied: list[int] = []

    def stop(self) -> None:
        self.stopped.set()

    def apply_weights(self) -> None:
        raise AssertionError("a stopped actor applies no weights")


def _bare_actor() -> RolloutActor:
    """A `RolloutActor` with only what `stop` and `run` touch (no engine, store or receiver)."""
    from tidal.flow.trace import Tracer
    from tidal.hal.cpu import CpuPlatform

    actor = RolloutActor.__new__(RolloutActor)
    actor.stopping, actor._first = threading.Event(), threading.Event()
    actor.worker, actor.last_version, actor._errors, actor._received = _Worker(actor.stopping), None, [], threading.Condition()
    actor.num_versions, actor.engine, actor.platform, actor.sharing, actor.tracer = 0, type("Engine", (), {"version": 0})(), CpuPlatform(), None, Tracer()
    return actor


def test_a_rollout_actor_restarted_as_the_run_ends_returns_from_run_when_told_to_stop():
    """Restarted by Ray while the run stopped, it never gets a first version: `run` returned
    only when one came (the run's end waited 60 s for it, and lost its summary)."""
    actor = _bare_actor()
    result: list = []
    running = threading.Thread(target=lambda: result.append(actor.run()))
    running.start()
    time.sleep(0.1)
    assert running.is_alive()  # waits for its first version
    actor.stop()
    running.join(5)
    assert not running.is_alive() and result[0]["samples"] == 0 and result[0]["last_version_received"] is None


def _arrive(actor: RolloutActor, version: int) -> None:
    with actor._received:  # as the receiver thread records a version
        actor.last_version = version
        actor._received.notify_all()


def test_a_rollout_actor_told_to_stop_first_takes_the_last_version_sent(monkeypatch):
    monkeypatch.setattr(runtime, "SEND_ON_STOP_S", 10.0)
    actor = _bare_actor()
    stopping = threading.Thread(target=actor.stop, args=(0,))  # version 0: the warm start, still on its way
    stopping.start()
    time.sleep(0.1)
    assert not actor.worker.stopped.is_set()  # waits for it ...
    _arrive(actor, 0)
    stopping.join(5)
    assert actor.worker.stopped.is_set() and not stopping.is_alive()  # ... and stops once it arrived


def test_a_rollout_actor_stops_at_once_without_a_version_to_wait_for_and_gives_up_at_the_timeout(monkeypatch):
    monkeypatch.setattr(runtime, "SEND_ON_STOP_S", 0.2)
    actor = _bare_actor()
    actor.stop()
    assert actor.worker.stopped.is_set()
    actor = _bare_actor()
    _arrive(actor, 3)
    start = time.monotonic()
    actor.stop(4)  # never arrives
    assert actor.worker.stopped.is_set() and 0.15 < time.monotonic() - start < 5


class _SendingWiring:
    """A wiring whose sender sends in the caller's thread (as `collective` and `host` do)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.sender = self

    def attach(self, actors, which):
        self.calls.append(("attach", list(which)))

    def send(self, version, source):
        self.calls.append(("send", version))

    def abort(self):
        pass


def _dies_once(marker: str, *, max_restarts: int = 1):
    """A rollout actor stand-in whose first `run` kills its process; Ray restarts it (once
    by default), and the new process runs until stopped."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=max_restarts)
    class DiesOnce:
        def __init__(self):
            self.stopped = threading.Event()

        def describe(self):
            return {}

        def run(self):
            import os
            from pathlib import Path

            if not Path(marker).exists():
                Path(marker).touch()
                os._exit(1)
            self.stopped.wait(60)
            return {"samples": 0}

        def stop(self, last_version=None):
            self.stopped.set()

    return DiesOnce.options(max_concurrency=2).remote()


def test_a_restarted_actor_over_a_transport_without_a_buffer_asks_for_the_current_version(ray_session, tmp_path):
    import torch

    wiring = _SendingWiring()
    rollouts = RayRollouts([_dies_once(str(tmp_path / "died"))], wiring, max_restarts=1)
    rollouts.publish(1, [("w", torch.ones(2))])
    wanted = rollouts.weights_wanted()
    assert wiring.calls == [("attach", [0]), ("send", 1)] and not wanted.done()
    ended: list[BaseException] = []
    supervisor = threading.Thread(target=lambda: _capture(rollouts.run, ended))
    supervisor.start()
    wanted.result(timeout=60)  # the actor died with version 1 and is back without it
    assert wiring.calls == [("attach", [0]), ("send", 1)] and rollouts.restarts == [1]
    rollouts.publish(1, [("w", torch.ones(2))])  # the trainer, waiting for rows, sends it again
    assert wiring.calls[2:] == [("attach", [0]), ("send", 1)]  # wired in again first
    assert not rollouts.weights_wanted().done()  # answered: the next restart completes a new one
    rollouts.stop()
    supervisor.join(30)
    assert not supervisor.is_alive() and [type(e).__name__ for e in ended] == ["Stop"]


def _capture(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # checked by the test
        errors.append(e)


class _BlockedWiring(_SendingWiring):
    """A sender blocked on a receiver that died (until `abort`, as a real one is)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = threading.Event()

    def send(self, version, source):
        self.calls.append(("send", version))
        if not self.aborted.wait(60):
            raise AssertionError("never aborted")
        raise ConnectionError("receiver gone")

    def abort(self):
        self.aborted.set()


def test_an_actor_with_no_restarts_left_fails_a_send_blocked_on_it_at_once(ray_session, tmp_path):
    """The send waited out the reply timeout and then DEATH_NOTICE_S (about four minutes)
    before the run could end."""
    import ray
    import torch

    wiring = _BlockedWiring()
    actor = _dies_once(str(tmp_path / "died"))
    rollouts = RayRollouts([actor], wiring, max_restarts=0)
    ended: list[BaseException] = []
    sent: list[BaseException] = []
    publisher = threading.Thread(target=lambda: _capture(lambda: rollouts.publish(1, [("w", torch.ones(2))]), sent))
    publisher.start()
    supervisor = threading.Thread(target=lambda: _capture(rollouts.run, ended))
    supervisor.start()
    supervisor.join(60)
    publisher.join(10)
    assert not publisher.is_alive()  # it heard at once
    assert [str(e) for e in ended] == [str(e) for e in sent] and "rollout actor 0 died 1 times (fault.rollout_restarts=0)" in str(sent[0])
    ray.kill(actor)


def test_a_guest_that_dies_for_good_gives_up_its_seat_so_the_trainers_turn_goes_on(ray_session, tmp_path):
    """A rollout actor time-sharing the trainer's devices dies with its state resident and
    no restarts left: nothing parks that state, so the trainer's turn waited for ever (the
    run never reached `RemoteRollouts.close`, which makes the seat leave). `on_death` is
    told, its seat leaves, and the trainer's waiting turn gets the devices."""
    import ray

    from tidal.flow.turns import Turns

    turns = Turns()
    turns.join("rollout-0")
    assert turns.acquire("rollout-0") is True
    turns.release("rollout-0")  # its state stays on the devices until another seat asks it to park
    turns.join("train")
    with pytest.raises(TimeoutError, match="state of 'rollout-0' on the devices"):
        turns.acquire("train", timeout=0.3)  # nobody parks the dead seat's state: the fault
    actor = _dies_once(str(tmp_path / "died"), max_restarts=0)
    told: list[int] = []
    rollouts = RayRollouts([actor], _SendingWiring(), max_restarts=0, on_death=lambda i: (told.append(i), turns.leave(f"rollout-{i}")))
    ended: list[BaseException] = []
    supervisor = threading.Thread(target=lambda: _capture(rollouts.run, ended))
    supervisor.start()
    got: list[bool] = []
    trainer = threading.Thread(target=lambda: got.append(turns.acquire("train", timeout=60)))  # the trainer's next step
    trainer.start()
    supervisor.join(60)
    trainer.join(10)
    assert not trainer.is_alive() and got == [True] and told == [0]  # the devices are the trainer's again
    assert "rollout actor 0 died 1 times (fault.rollout_restarts=0)" in str(ended[0])
    ray.kill(actor)


def test_a_guest_ray_restarts_is_not_given_up_and_its_new_process_rejoins_the_seat(ray_session, tmp_path):
    """With a restart left the seat stays: the new process joins it again, which drops the
    dead one's claims (a `leave` that could land after that join would drop the new one's)."""
    from tidal.flow.turns import Turns

    turns = Turns()
    turns.join("rollout-0")
    turns.acquire("rollout-0")
    turns.release("rollout-0")
    told: list[int] = []
    rollouts = RayRollouts([_dies_once(str(tmp_path / "died"))], _SendingWiring(), max_restarts=1, on_death=told.append)
    ended: list[BaseException] = []
    supervisor = threading.Thread(target=lambda: _capture(rollouts.run, ended))
    supervisor.start()
    rollouts.weights_wanted().result(timeout=60)  # back from its restart
    assert told == [] and rollouts.restarts == [1]
    turns.join("rollout-0")  # what the restarted process's `Seat` does
    assert turns.acquire("train", timeout=5) is True  # the dead process's state no longer stands in the way
    rollouts.stop()
    supervisor.join(30)
    assert not supervisor.is_alive() and [type(e).__name__ for e in ended] == ["Stop"]


class _Stub:
    """A rollout actor stand-in (no process): `describe` answers at once, `stop` records the
    version it is told to wait for, and `run`/`describe` answer with `run_ref`/`describe_ref`
    when set (refs of tasks that raise what a dead actor's calls raise)."""

    def __init__(self) -> None:
        import types

        import ray

        self.told: list = []
        self.run_ref = self.describe_ref = None
        self.describe = types.SimpleNamespace(remote=lambda: self.describe_ref or ray.put({}))
        self.run = types.SimpleNamespace(remote=lambda: self.run_ref)
        self.stop = types.SimpleNamespace(remote=self.told.append)


def test_an_actor_back_from_a_restart_and_not_wired_in_again_is_not_told_to_wait_for_the_last_version(ray_session):
    """Sent nothing since its restart, it waited SEND_ON_STOP_S (10 s) for the version sent
    before it at the run's end; the others wait for it as before."""
    import torch

    actors = [_Stub(), _Stub()]
    rollouts = RayRollouts(actors, _SendingWiring())
    rollouts.publish(7, [("w", torch.ones(2))])
    rollouts._restarted.add(1)  # as `run` leaves an actor Ray restarted, until the next publish wires it in
    rollouts.stop()
    assert [a.told for a in actors] == [[7], [None]]


def test_a_restarted_actor_whose_new_process_fails_is_named_in_the_runs_error(ray_session):
    import ray
    import ray.exceptions

    @ray.remote(num_cpus=0)
    def dead() -> None:
        raise ray.exceptions.ActorDiedError()

    actor = _Stub()
    rollouts = RayRollouts([actor], _SendingWiring(), max_restarts=1)
    actor.run_ref = actor.describe_ref = dead.remote()  # it died, and so did the process Ray started in its place
    with pytest.raises(RuntimeError, match=r"(?s)^rollout actor 0 died, and Ray could not restart it \(restart 1 of 1\): .*ActorDiedError"):
        rollouts.run()
    assert rollouts.restarts == [1]
