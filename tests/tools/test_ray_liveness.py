"""The driver's liveness check of the trainer ranks (`runtime: ray`): a rank that stops
answering is reported and killed, and its death takes the trainer-restart path."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest


def test_a_stopped_trainer_rank_is_killed_and_raised_as_a_death(ray_session, tmp_path, caplog):
    """SIGSTOP on the trainer stopped the run with no word; only `lease_s` (an hour) would
    have ended it."""
    import ray

    from tidal.flow.ray.liveness import Liveness
    from tidal.tools.ray_run import _wait_with_progress, rank_died

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Rank:
        def ping(self) -> None:
            pass

        def pid(self) -> int:
            return os.getpid()

        def run(self) -> dict:
            time.sleep(120)
            return {}

    rank = Rank.remote()
    pid = ray.get(rank.pid.remote())
    ref = rank.run.remote()
    watch = Liveness([rank], lambda i: f"trainer rank {i} (pid {pid})", silent_s=0.5, grace_s=1.0)
    caplog.set_level(logging.WARNING)
    os.kill(pid, signal.SIGSTOP)
    begin = time.monotonic()
    try:
        with pytest.raises(ray.exceptions.RayActorError) as caught:
            _wait_with_progress([ref], tmp_path / "metrics.jsonl", total=1, progress=False, watch=watch)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert rank_died(caught.value) and watch.killed == {0} and time.monotonic() - begin < 30
    assert f"trainer rank 0 (pid {pid}) has not answered for" in caplog.text and f"trainer rank 0 (pid {pid}) was silent for" in caplog.text


def test_the_driver_says_so_when_the_steps_stop_while_the_ranks_answer(ray_session, tmp_path, capsys):
    """A rank that answers but finishes no step (one waiting in a collective its peers never
    join) is reported on the console by `StepStall`, naming the processes to look into; the
    run is left to go on (a warning: a long evaluation looks the same)."""
    import ray

    from tidal.flow.ray import liveness
    from tidal.flow.ray.liveness import StepStall
    from tidal.tools.ray_run import _wait_with_progress

    @ray.remote(num_cpus=0)
    def run() -> dict:
        time.sleep(3)
        return {"steps": 0}

    ticks = iter(range(10**6))
    stall = StepStall("trainer ranks: 4242", clock=lambda: next(ticks) * liveness.STALL_FIRST_S / 2)  # a third tick is past the bar
    assert _wait_with_progress([run.remote()], tmp_path / "metrics.jsonl", total=1, progress=False, stall=stall) == [{"steps": 0}]
    err = capsys.readouterr().err
    assert err.count("tidal: no RL step has finished for") == 1, err
    assert "since the run started" in err and "trainer ranks: 4242" in err
