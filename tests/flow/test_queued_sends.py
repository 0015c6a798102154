"""`QueuedSends`: the trainer's weight versions sent on a thread of their own (`transport.overlap`)."""

from __future__ import annotations

import threading

import pytest

from tidal.flow.runtime import QueuedSends


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
