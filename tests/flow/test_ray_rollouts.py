"""`RayRollouts` and its `QueuedSends`: what the trainer does not wait for under `runtime: ray`."""

from __future__ import annotations

import threading
import time

import pytest

from tidal.flow.runtime import QueuedSends, RayRollouts


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


def test_rollout_metrics_never_wait_for_an_actor_busy_elsewhere(ray_session, wait_for):
    import ray

    @ray.remote(num_cpus=0)
    class SlowToAnswer:
        def __init__(self):
            self.calls = 0

        def describe(self):
            return {}

        def metrics(self):
            self.calls += 1
            time.sleep(0.5)  # the actor's process is busy generating
            return {"paused_generations": self.calls, "handed_off": 2, "wait_s": {"weights": 0.25}}

    actor = SlowToAnswer.remote()
    rollouts = RayRollouts([actor], _NoWiring())
    begin = time.perf_counter()
    assert rollouts.metrics() == {"paused_generations": 0, "handed_off": 0, "wait_s": {}}  # asked, not answered yet
    assert time.perf_counter() - begin < 0.4
    answered = []
    wait_for(lambda: answered.append(rollouts.metrics()) or answered[-1]["handed_off"] == 2)
    assert answered[-1] == {"paused_generations": 1, "handed_off": 2, "wait_s": {"weights": 0.25}}
    assert rollouts.metrics() == {"paused_generations": 1, "handed_off": 2, "wait_s": {}}  # asked again: the counts stand, no wait counted twice
    ray.kill(actor)
