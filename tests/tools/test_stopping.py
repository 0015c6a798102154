"""`tools/stopping.py`: the first SIGINT / SIGTERM asks the run to stop, a second stops at once."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tidal.tools.stopping import RunStopped, StopRequest, stop_on_signals


def _requested(stop: StopRequest) -> threading.Event:
    seen = threading.Event()
    stop.on_request(lambda reason: seen.set())
    return seen


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_first_signal_requests_a_stop_and_the_handlers_come_back_after(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest()
    seen = _requested(stop)
    with stop_on_signals(stop):
        os.kill(os.getpid(), signum)
        assert seen.wait(timeout=10)
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]  # already: a second Ctrl-C stops at once
    assert stop.reason == signum.name
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_ctrl_c_interrupts_at_once():
    stop = StopRequest()
    seen = _requested(stop)
    with pytest.raises(KeyboardInterrupt), stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGINT)
        assert seen.wait(timeout=10)
        os.kill(os.getpid(), signal.SIGINT)
        threading.Event().wait(10)  # the KeyboardInterrupt lands here
    assert stop.reason == "SIGINT"


def test_a_request_made_before_the_callback_is_in_calls_it_on_arrival_and_only_once():
    stop = StopRequest()
    stop.request("asked by the driver")
    stop.request("asked again")
    calls: list[str] = []
    stop.on_request(calls.append)
    assert calls == ["asked by the driver"] and stop.reason == "asked by the driver"


def test_outside_the_main_thread_nothing_changes():
    before = signal.getsignal(signal.SIGINT)
    inside: list[object] = []

    def body() -> None:
        with stop_on_signals(StopRequest()):
            inside.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert inside == [before]


def test_run_stopped_exits_as_the_shell_does_for_the_signal():
    assert RunStopped("SIGINT").exit_code == 130 and RunStopped("SIGTERM").exit_code == 143
    assert RunStopped("asked by the driver").exit_code == 130
    assert isinstance(RunStopped("SIGTERM"), KeyboardInterrupt)


def test_a_signal_the_process_ignores_stays_ignored():
    """A run started with SIGINT ignored (a background job of a script: Ctrl-C at the
    terminal is for the script) is not stopped by it, as Python itself leaves it ignored."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_signals(StopRequest()):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)  # SIGTERM still asks for a stop
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
