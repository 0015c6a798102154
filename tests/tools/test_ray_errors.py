"""Errors under `runtime: ray` are printed as the local runtime prints them: one line naming
the cause (a full disk, a dead actor), not Ray's wrapper with the remote traceback.

The errors are Ray's own, raised by real actors that fail; `tidal run` gets each as
`run_on_ray` raised it."""

from __future__ import annotations

import errno
import os
import time

import pytest


def _raised(ref) -> BaseException:
    import ray

    try:
        ray.get(ref)
    except Exception as e:  # the error under test
        return e
    raise AssertionError("the call did not fail")


def _raised_once_dead(actor, timeout: float = 30.0) -> BaseException:
    """The error of the first `ping` after `ray.kill(actor)` took effect: the kill is
    asynchronous, so a call sent at once may still be answered by the living actor."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(actor.ping.remote())
        except Exception as e:  # the error under test
            return e
        if time.monotonic() > deadline:
            raise AssertionError(f"the actor still answered {timeout:.0f} s after ray.kill")
        time.sleep(0.05)


def _failing_actors():
    import ray

    @ray.remote(num_cpus=0)
    class Inner:
        def ping(self) -> int:
            return os.getpid()

        def die(self) -> None:
            os._exit(1)

    @ray.remote(num_cpus=0)
    class Trainer:
        def write_metrics(self) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/metrics.jsonl")

        def give_up(self) -> None:
            from tidal.flow.ray.faults import ActorLost

            raise ActorLost("rollout actor 0 died 4 times (fault.rollout_restarts=3): ActorDiedError: actor RolloutActor (pid 7) died: its worker process has died")

        def call_a_dying_actor(self) -> int:
            inner = Inner.remote()
            ray.get(inner.ping.remote())
            inner.die.remote()
            time.sleep(0.5)
            return ray.get(inner.ping.remote())

    return Inner, Trainer


def _tidal_run_raising(error, monkeypatch, capsys, tmp_path) -> str:
    """`tidal run` under runtime=ray whose `run_on_ray` raises `error`; its stderr."""
    import ray

    from tidal.tools import ray_run
    from tidal.tools.cli import main

    def run_on_ray(*args, **kwargs):
        raise error

    monkeypatch.setattr(ray_run, "run_on_ray", run_on_ray)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # the test session's Ray stays up
    assert main(["run", "quickstart_cpu", "runtime=ray", f"run_dir={tmp_path / 'run'}", "--no-progress"]) == 1
    return capsys.readouterr().err


def test_a_full_disk_inside_the_trainer_actor_is_one_line_naming_the_file(ray_session, monkeypatch, capsys, tmp_path):
    """63 lines (Ray's wrapper: the remote traceback, then the driver's) where the local runtime prints one."""
    _, Trainer = _failing_actors()
    error = _raised(Trainer.remote().write_metrics.remote())
    assert type(error).__name__ == "RayTaskError(OSError)" and error.errno is None  # what the one-line check missed
    err = _tidal_run_raising(error, monkeypatch, capsys, tmp_path)
    assert err.strip().splitlines() == ["tidal run: error: cannot write /runs/r/metrics.jsonl: No space left on device; free space there, or choose another run_dir or output_dir"]


def test_a_rollout_actor_that_died_for_good_is_one_line_with_the_notes_of_the_other_ranks(ray_session, monkeypatch, capsys, tmp_path):
    _, Trainer = _failing_actors()
    error = _raised(Trainer.remote().give_up.remote())
    error.add_note("trainer rank 1 failed too: RuntimeError: Connection closed by peer")  # as the driver adds them (`_first_error`)
    err = _tidal_run_raising(error, monkeypatch, capsys, tmp_path)
    assert err.strip().splitlines() == [
        "tidal run: error: rollout actor 0 died 4 times (fault.rollout_restarts=3): ActorDiedError: actor RolloutActor (pid 7) died: its worker process has died",
        "trainer rank 1 failed too: RuntimeError: Connection closed by peer",
    ]


@pytest.mark.parametrize("nested", [False, True], ids=["driver", "inside-an-actor"])
def test_a_dead_actor_is_one_line_naming_it_and_why(ray_session, monkeypatch, capsys, tmp_path, nested):
    """Ray's report of a death is a dozen lines (class, id, pid, namespace, ip, cause, advice
    on the OOM killer); wrapped by the call that needed the actor, a traceback more."""
    import ray

    Inner, Trainer = _failing_actors()
    if nested:
        error = _raised(Trainer.remote().call_a_dying_actor.remote())
        assert isinstance(error, ray.exceptions.RayTaskError)
    else:
        inner = Inner.remote()
        pid = ray.get(inner.ping.remote())
        inner.die.remote()
        time.sleep(0.5)
        error = _raised(inner.ping.remote())
        assert f"pid: {pid}" in str(error)
    assert len(str(error).splitlines()) > 5
    err = _tidal_run_raising(error, monkeypatch, capsys, tmp_path)
    (line,) = err.strip().splitlines()
    assert line.startswith("tidal run: error: ActorDiedError: actor Inner (pid ") and line.endswith(" died: its worker process has died (SYSTEM_ERROR)"), line


def test_a_death_summary_says_an_actor_was_killed(ray_session):
    import ray

    from tidal.flow.ray.faults import death_summary

    Inner, _ = _failing_actors()
    inner = Inner.remote()
    pid = ray.get(inner.ping.remote())
    ray.kill(inner)
    summary = death_summary(_raised_once_dead(inner))
    assert summary.startswith(f"ActorDiedError: actor Inner (pid {pid} at ") and summary.endswith(" died: it was killed by `ray.kill`"), summary


def test_a_death_with_nothing_to_read_is_still_one_line():
    import ray.exceptions

    from tidal.flow.ray.faults import death_summary, remote_cause

    assert death_summary(ray.exceptions.ActorDiedError()) == "ActorDiedError: actor died: The actor died unexpectedly before finishing this task."
    error = ValueError("reward function 'x' is not defined")
    assert remote_cause(error) is error  # not Ray's: as it is
