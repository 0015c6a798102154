"""Liveness under `runtime: ray`: an actor alive but silent (SIGSTOP) is reported within
`silent_s`, and killed as dead `grace_s` later; Ray's count of restarts is where tidal's
starts; a weight receiver waits for the next version without a transfer's timeout."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch

from tidal.flow.ray import liveness, runtime
from tidal.flow.ray.liveness import Liveness, StepStall, transfer_timeout_s
from tidal.flow.ray.runtime import RayRollouts, RolloutActor


def _actor(*, max_restarts: int = 0):
    """A rollout actor stand-in: `describe` (its pid, and Ray's count of its restarts, as
    `RolloutActor.describe` reports them, and the warnings counting them raised), `ping`, and a `run` that waits until `stop`."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=max_restarts, max_task_retries=0, max_concurrency=4)
    class Stand:
        def __init__(self):
            self.stopped = threading.Event()

        def describe(self):
            import warnings

            from tidal.flow.ray.faults import num_restarts

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                restarts = num_restarts()
            return {"pid": os.getpid(), "restarts": restarts, "warnings": [str(w.message) for w in caught]}

        def ping(self):
            pass

        def run(self):
            self.stopped.wait(120)
            return {"samples": 0}

        def stop(self, last_version=None):
            self.stopped.set()

        def metrics(self):
            return {"paused_generations": 0, "handed_off": 0, "wait_s": {}, "started": 0}

    return Stand.remote()


class _Wiring:
    sender = None

    def attach(self, actors, which):
        pass

    def abort(self):
        pass


def _frozen(pid: int):
    """SIGSTOP `pid` (an actor process this test started); the returned function resumes it if it still runs."""
    os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    return resume


def test_a_stopped_actor_is_reported_then_handed_back_to_kill_and_one_that_answers_again_is_not(ray_session, caplog, wait_for):
    import ray

    actors = [_actor(), _actor()]
    pids = [ray.get(a.describe.remote())["pid"] for a in actors]
    watch = Liveness(actors, lambda i: f"rollout actor {i}", silent_s=0.6, grace_s=0.9)
    assert watch.every_s == pytest.approx(0.15)
    resume = [_frozen(pid) for pid in pids]
    try:
        killed: list[int] = []
        caplog.set_level(logging.WARNING, logger=liveness.__name__)
        begin = time.monotonic()
        wait_for(lambda: killed.extend(watch.check()) or watch.num_silences == 2, timeout=10)
        assert 0.5 < time.monotonic() - begin < 3 and killed == []
        assert "rollout actor 0 has not answered for 1s (stopped, or its machine overloaded?)" in caplog.text
        resume[1]()  # actor 1 was only slow: answered again, it is not killed
        wait_for(lambda: killed.extend(watch.check()) or killed, timeout=10)
        assert killed == [0] and watch.killed == {0} and 1.4 < time.monotonic() - begin < 5
        assert "rollout actor 1 answered again after" in caplog.text and "rollout actor 0 was silent for" in caplog.text
        for _ in range(5):
            assert watch.check() == []  # handed back once
            time.sleep(watch.every_s)
        assert watch.num_silences == 2
    finally:
        for r in resume:
            r()
        for a in actors:
            ray.kill(a)


def test_no_checks_and_no_pings_when_off():
    class NoPing:
        ping = None  # a call would fail

    watch = Liveness([NoPing()], str, silent_s=0.0, grace_s=0.0)
    assert not watch.on and watch.check() == []


def test_a_frozen_rollout_actor_is_killed_restarted_and_counted(ray_session, caplog, wait_for):
    """SIGSTOP for 60 s stopped a run with no word until it was resumed; nothing noticed
    before `lease_s` (an hour). Now the trainer's supervising loop reports it, kills it after
    the grace period, and Ray restarts it (one of its restarts)."""
    import ray

    actor = _actor(max_restarts=1)
    rollouts = RayRollouts([actor], _Wiring(), max_restarts=1, liveness_s=0.5, grace_s=0.5)
    pid = rollouts.descriptions[0]["pid"]
    resume = _frozen(pid)
    ended: list[BaseException] = []
    supervisor = threading.Thread(target=lambda: _capture(rollouts.run, ended), daemon=True)
    try:
        caplog.set_level(logging.WARNING)
        supervisor.start()
        rollouts.weights_wanted().result(timeout=60)  # killed, restarted, and back without weights
        assert rollouts.restarts == [1] and rollouts.liveness.killed == set()
        assert "rollout actor 0 (pid" in caplog.text and "has not answered for" in caplog.text
        assert "rollout actor 0 died (killed after it stopped answering (fault.liveness_s)); Ray restarts it (1 of 1)" in caplog.text
        assert rollouts.descriptions[0]["pid"] != pid and rollouts.descriptions[0]["restarts"] == 1  # a new process
        wait_for(lambda: rollouts.metrics()["silent_rollouts"] == 1)
        assert set(rollouts.metrics()) >= {"paused_generations", "handed_off", "silent_rollouts", "wait_s"}
    finally:
        resume()
        rollouts.stop()
        supervisor.join(30)
        ray.kill(actor)
    assert [type(e).__name__ for e in ended] == ["Stop"]


def test_a_rollout_death_while_the_trainer_warmed_up_counts_against_its_restarts(ray_session, wait_for):
    """Ray restarted an actor that died before the group existed, and tidal did not count it:
    runtime.json said 0 restarts, and with one restart allowed a later death was "restart 1
    of 1" that Ray could no longer make. Ray's count is where tidal's starts."""
    import ray

    actor = _actor(max_restarts=1)
    first = ray.get(actor.describe.remote())
    assert first["restarts"] == 0 and first["warnings"] == []  # Ray's restart flag read without its deprecation warning in every actor's log
    ray.kill(actor, no_restart=False)  # dies while the trainer warms up: Ray restarts it
    wait_for(lambda: _back(actor, first["pid"]), timeout=60)
    assert ray.get(actor.describe.remote())["warnings"] == []
    rollouts = RayRollouts([actor], _Wiring(), max_restarts=1)
    assert rollouts.restarts == [1] and rollouts.descriptions[0]["restarts"] == 1
    ended: list[BaseException] = []
    supervisor = threading.Thread(target=lambda: _capture(rollouts.run, ended), daemon=True)
    supervisor.start()
    time.sleep(0.5)
    ray.kill(actor, no_restart=False)  # no restart left
    supervisor.join(60)
    assert not supervisor.is_alive()
    assert len(ended) == 1 and str(ended[0]).startswith("rollout actor 0 died 2 times (fault.rollout_restarts=1): ")
    assert type(ended[0]).__name__ == "ActorLost" and "\n" not in str(ended[0])


def _back(actor, old_pid: int) -> bool:
    import ray

    try:
        return ray.get(actor.describe.remote(), timeout=5)["pid"] != old_pid
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def _capture(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # checked by the test
        errors.append(e)


def test_a_weight_receiver_waits_for_the_next_version_longer_than_a_transfer_may_take(monkeypatch):
    """The receiver thread waited an hour for the next version and then failed the actor (a
    long step or checkpoint ended the run); a transfer that started had the same hour. The
    wait for the start is now unbounded (liveness watches the trainer), the transfer bounded
    by its size, and stopping ends the wait."""
    from tidal.hal.cpu import CpuPlatform
    from tidal.hal.transfer import expected_specs
    from tidal.hal.transfer.ipc import IpcReceiver, IpcSender

    monkeypatch.setattr(liveness, "TRANSFER_BASE_S", 0.2)
    monkeypatch.setattr(runtime, "STOP_CHECK_S", 0.05)
    actor = RolloutActor.__new__(RolloutActor)
    actor.stopping = threading.Event()
    weights = [("w", torch.arange(4.0))]
    receiver, sender = IpcReceiver(CpuPlatform()), IpcSender(CpuPlatform())
    try:
        receive = actor._next_version(receiver, expected_specs(weights))
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(receive()), daemon=True)
        waiting.start()
        time.sleep(1.0)  # a train step five times what the transfer may take
        assert waiting.is_alive() and got == []
        sender.connect(receiver.address)
        sender.post(3, weights)
        waiting.join(10)
        sender.collect()
        assert got[0].version == 3 and torch.equal(got[0].tensors["w"], weights[0][1])
        waiting = threading.Thread(target=lambda: got.append(receive()), daemon=True)
        waiting.start()
        actor.stopping.set()
        waiting.join(5)
        assert not waiting.is_alive() and got[1] is None
    finally:
        sender.close()
        receiver.close()


def test_a_transfer_may_take_longer_the_larger_it_is():
    assert transfer_timeout_s(0) == liveness.TRANSFER_BASE_S == 30.0
    assert transfer_timeout_s(16 << 30) == pytest.approx(30 + (16 << 30) / 50e6)  # an 8B model in bf16: about 6 minutes


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_run_whose_steps_stop_while_its_ranks_answer_is_reported_once_per_stall():
    """Two ranks disagreeing on what to run wait in a collective for ever and still answer
    pings (a two-rank deepspeed ZeRO-3 run hung so, silently: tests/engines/test_deepspeed_train.py
    has that bug's test). Before the first step the bar is high (loading, evaluation); after
    it, ten median steps and at least ten minutes."""
    clock = _Clock()
    stall = StepStall("trainer ranks: 11, 12", clock=clock)
    clock.now = liveness.STALL_FIRST_S - 1
    assert stall.check(None) is None
    clock.now = liveness.STALL_FIRST_S + 1
    message = stall.check(None)
    assert message is not None and "since the run started" in message and "py-spy dump --pid PID" in message and "trainer ranks: 11, 12" in message
    assert stall.check(None) is None  # once per stall
    for step in range(1, 4):  # 100 s a step from here
        clock.now += 100
        assert stall.check(step) is None
        assert stall.check(None) is None  # a line being written reads as no step: not a new one
    assert stall.limit_s() == 10 * 100
    clock.now += 1000
    assert stall.check(3) is None
    clock.now += 1
    message = stall.check(3)
    assert message is not None and "for 1001s (since step 3; steps took 100.0s (median))" in message
    clock.now += 5
    assert stall.check(4) is None and stall.check(4) is None  # steps again: quiet until the next stall
    fast = StepStall("-", clock=clock)
    for step in range(1, 5):
        clock.now += 1
        fast.check(step)
    assert fast.limit_s() == liveness.STALL_FLOOR_S  # ten one-second steps would be ten seconds: the floor
