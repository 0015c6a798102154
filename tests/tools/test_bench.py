"""Benchmark tables: ratios against the baselines measured in the same run."""

from __future__ import annotations

import pytest

from tidal.tools.bench import e2e as bench_e2e
from tidal.tools.bench import store as bench_store


def test_e2e_table_means_over_seeds_and_ratios_against_sync_and_trl():
    def run(samples_per_s: float, after: float) -> dict:
        return {"samples_per_s": samples_per_s, "tokens_per_s": 2 * samples_per_s, "rl_seconds": 10.0, "accuracy_before": 0.25, "accuracy_after": after}

    results = {"tidal-async": [run(300.0, 0.4), run(340.0, 0.5)], "tidal-sync": [run(200.0, 0.45), run(200.0, 0.45)], "trl": [run(80.0, 0.4), run(80.0, 0.4)]}
    header, async_row, sync_row, trl = bench_e2e.table(results)
    assert header[:4] == ["system", "samples/s", "x sync (tidal-sync)", "x TRL (trl)"]
    assert async_row[:6] == ["tidal-async", "320.0", "1.60", "4.00", "640.0", "10.0"]
    assert async_row[7] == "45.0% (+-5.0%)" and sync_row[2:4] == ["1.00", "2.50"]
    assert trl[:4] == ["trl", "80.0", "0.40", "1.00"]


def test_e2e_ratios_are_against_the_faster_thread_setting_of_each_baseline():
    """sync and TRL run with all threads and with one; a ratio is against the faster of the two."""
    def run(samples_per_s: float) -> dict:
        return {"samples_per_s": samples_per_s, "tokens_per_s": samples_per_s, "rl_seconds": 1.0, "accuracy_before": 0.25, "accuracy_after": 0.5}

    results = {"tidal-async": [run(300.0)], "tidal-sync": [run(150.0)], "tidal-sync-1t": [run(200.0)], "trl": [run(100.0)], "trl-1t": [run(50.0)]}
    header, *rows = bench_e2e.table(results)
    rows = {row[0]: row for row in rows}
    assert header[2:4] == ["x sync (tidal-sync-1t)", "x TRL (trl)"]
    assert rows["tidal-async"][2:4] == ["1.50", "3.00"]  # not 2.00 against the slower sync
    assert rows["tidal-sync"][2] == "0.75" and rows["trl-1t"][3] == "0.50"


def test_e2e_runs_each_one_stage_system_with_all_threads_with_one_and_sync_split(monkeypatch):
    from tidal.tools.bench import trl as bench_trl

    run = {"samples_per_s": 100.0, "tokens_per_s": 200.0, "rl_seconds": 1.0, "accuracy_before": 0.25, "accuracy_after": 0.5}
    tidal_runs, trl_runs = [], []
    monkeypatch.setattr(bench_e2e, "run_tidal", lambda system_overrides, **_: tidal_runs.append(tuple(system_overrides)) or run)
    monkeypatch.setattr(bench_trl, "available", lambda: True)
    monkeypatch.setattr(bench_trl, "run_trl", lambda *, seed, num_steps, overrides, recipe: trl_runs.append(tuple(overrides)) or run)
    results = bench_e2e.run(seeds=[0], num_steps=3, progress=lambda m: None)
    assert set(results) == {*bench_e2e.SYSTEMS, *bench_e2e.TRL_SYSTEMS}
    assert trl_runs == [(f"threads={bench_e2e.ALL_CORES}",), ("threads=1",), ("rollout.threads=1", f"train.threads={bench_e2e.ALL_CORES}")][: len(bench_e2e.TRL_SYSTEMS)]
    assert ("algorithm.max_staleness=0", f"threads={bench_e2e.ALL_CORES}") in tidal_runs
    if bench_e2e.ALL_CORES > 1:  # one core has no second setting to try
        assert ("algorithm.max_staleness=0", "threads=1") in tidal_runs and set(bench_e2e.TRL_SYSTEMS) == {"trl", "trl-1t", "trl-split"}
        assert ("algorithm.max_staleness=0", "rollout.threads=1", f"train.threads={bench_e2e.ALL_CORES}") in tidal_runs
        assert bench_e2e.BASELINES["sync"] == ["tidal-sync", "tidal-sync-1t", "tidal-sync-split"]
        assert bench_e2e.BASELINES["TRL"] == ["trl", "trl-1t", "trl-split"]  # TRL gets every thread setting sync gets


def test_e2e_runs_one_round_per_seed_alternating_the_order(monkeypatch):
    from tidal.tools.bench import trl as bench_trl

    run = {"samples_per_s": 100.0, "tokens_per_s": 200.0, "rl_seconds": 1.0, "accuracy_before": 0.25, "accuracy_after": 0.5}
    names = {tuple(o): name for name, o in bench_e2e.SYSTEMS.items()}
    calls = []
    monkeypatch.setattr(bench_e2e, "run_tidal", lambda system_overrides, *, seed, **_: calls.append((names[tuple(system_overrides)], seed)) or run)
    monkeypatch.setattr(bench_trl, "available", lambda: True)
    monkeypatch.setattr(bench_trl, "run_trl", lambda *, seed, num_steps, overrides, recipe: calls.append((tuple(overrides), seed)) or run)
    results = bench_e2e.run(seeds=[3, 4, 5], num_steps=3, progress=lambda m: None)
    order = [*bench_e2e.SYSTEMS, *(tuple(o) for o in bench_e2e.TRL_SYSTEMS.values())]
    assert calls == [*((s, 3) for s in order), *((s, 4) for s in reversed(order)), *((s, 5) for s in order)]
    assert list(results) == [*bench_e2e.SYSTEMS, *bench_e2e.TRL_SYSTEMS]  # the table's rows keep their order
    assert all(len(runs) == 3 for runs in results.values())


def test_e2e_table_without_trl_says_how_to_install_it():
    run = {"samples_per_s": 100.0, "tokens_per_s": 200.0, "rl_seconds": 1.0, "accuracy_before": 0.25, "accuracy_after": 0.5}
    header, sync_row, trl = bench_e2e.table({"tidal-sync": [run]})
    assert sync_row[2:4] == ["1.00", "-"]
    assert trl[0] == "trl" and "pip install -c constraints.txt -e '.[bench]'" in trl[-1]


def test_e2e_system_whose_roles_do_not_fit_is_skipped_saying_why(monkeypatch):
    from tidal.flow.placement import PlacementError
    from tidal.tools.bench import trl as bench_trl

    run = {"samples_per_s": 100.0, "tokens_per_s": 200.0, "rl_seconds": 1.0, "accuracy_before": 0.25, "accuracy_after": 0.5}
    calls = []

    def fake_run(system_overrides, *, seed, num_steps, overrides, recipe, workload):
        calls.append((tuple(system_overrides), seed, tuple(overrides)))
        if "runtime=ray" in system_overrides:
            raise PlacementError("role 'rollout' needs 1 device with [cuda]: none is free")
        return run

    monkeypatch.setattr(bench_e2e, "run_tidal", fake_run)
    monkeypatch.setattr(bench_trl, "available", lambda: False)
    results = bench_e2e.run(seeds=[0, 1], num_steps=3, overrides=["device=cuda"], progress=lambda m: None)
    assert [c for c in calls if "runtime=ray" in c[0]] == [(tuple(bench_e2e.SYSTEMS["tidal-async-ray"]), 0, ("device=cuda",))]  # the second seed is not tried
    assert len(results["tidal-async"]) == len(results["tidal-sync"]) == 2
    rows = {row[0]: row for row in bench_e2e.table(results)[1:]}
    assert rows["tidal-async"][2] == "1.00" and rows["tidal-async-ray"][1] == "-"
    assert rows["tidal-async-ray"][-1] == "not measured: its roles do not fit this machine: role 'rollout' needs 1 device with [cuda]: none is free"


def test_store_bench_moves_every_row_through_each_tidal_deployment():
    """The consumer process returns only once it received every row (or times out)."""
    work = bench_store.Workload("small", bench_store.SMALL, 64, 16)
    for split, shm, window in ((False, True, 4), (True, True, 4), (False, False, 1)):  # tidal, tidal-split, tidal-socket one put at a time
        rates = bench_store.tidal_throughput(work, split=split, shm=shm, window=window)
        assert rates["rows_per_s"] > 0 and rates["mb_per_s"] == pytest.approx(rates["rows_per_s"] * work.row_bytes / 1e6), (split, shm, window)
    with pytest.raises(ValueError, match="put_window must be >= 1"):
        bench_store.run(systems=("tidal",), put_window=0)
    assert bench_store.embedded_throughput(work)["rows_per_s"] > 0


def test_store_latency_p99_is_the_99th_percentile_not_the_maximum():
    """Of 100 hand-offs (the default trials) p99 is the 99th smallest (nearest rank); it was the
    100th, the slowest, for every system alike."""
    latencies = [ms / 1e3 for ms in range(1, 101)][::-1]  # 1 .. 100 ms, in any order
    assert bench_store._percentiles(latencies) == pytest.approx({"p50_ms": 50.5, "p99_ms": 99.0})
    assert bench_store._percentiles([0.001] * 199 + [0.5])["p99_ms"] == pytest.approx(1.0)  # one outlier in 200 is above p99
    assert bench_store._percentiles([0.002])["p99_ms"] == pytest.approx(2.0)


def test_store_bench_ipc_endpoints_leave_no_socket_file_behind(monkeypatch, tmp_path):
    """libzmq keeps a Unix-domain socket's file after the socket closes: every `--transport ipc`
    run left one in the temp folder per store server, storage unit and raw-ZeroMQ consumer.
    The process that makes an ipc endpoint removes its file when it exits."""
    import atexit
    import tempfile

    import zmq

    at_exit = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args, **kwargs: at_exit.append(lambda: fn(*args, **kwargs)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(bench_store.endpoint("ipc"))
    sock.close(linger=0)
    assert len(list(tmp_path.iterdir())) == 1  # the socket closed, its file stays
    for fn in at_exit:
        fn()
    assert not list(tmp_path.iterdir())


def test_e2e_table_reports_response_length_and_counts_the_runs_that_drifted():
    def run(start: float, end: float, after: float) -> dict:
        return {"samples_per_s": 100.0, "tokens_per_s": 200.0, "rl_seconds": 1.0, "accuracy_before": 0.6, "accuracy_after": after, **bench_e2e.length_drift([start] * 10 + [end] * 10)}

    assert bench_e2e.length_drift([2.0] * 9 + [5.0]) == {"response_len_start": 2.0, "response_len_end": 5.0}  # a tenth: one step of ten
    assert bench_e2e.length_drift([]) == {}
    results = {"tidal-async": [run(2.5, 5.0, 0.28), run(2.5, 2.4, 0.9)], "tidal-sync": [run(2.5, 2.5, 0.9), run(2.4, 3.5, 0.9)]}
    header, async_row, sync_row, trl = bench_e2e.table(results)
    assert header[-2:] == ["response length, first -> last tenth", f"runs drifted (length x{bench_e2e.DRIFT_RATIO}+)"]
    assert async_row[-2:] == ["2.50 -> 3.70", "1 of 2"] and async_row[7] == "59.0% (+-31.0%)"
    assert sync_row[-2:] == ["2.45 -> 3.00", "0 of 2"]  # 3.5 is not more than 1.5 x 2.4
    assert bench_e2e.drifted({"samples_per_s": 1.0}) is None
    header, row = bench_e2e.table({"tidal-async": [{"samples_per_s": 1.0, "tokens_per_s": 1.0, "rl_seconds": 1.0, "accuracy_before": 0.5, "accuracy_after": 0.5}]}, with_trl=False)
    assert row[-2:] == ["-", "-"]  # a run without lengths


def test_e2e_runs_only_the_systems_asked_for(monkeypatch):
    from tidal.tools.bench import trl as bench_trl

    calls = []
    names = {tuple(o): name for name, o in bench_e2e.SYSTEMS.items()}
    monkeypatch.setattr(bench_e2e, "run_tidal", lambda system_overrides, *, seed, **_: calls.append((names[tuple(system_overrides)], seed)) or {})
    monkeypatch.setattr(bench_trl, "available", lambda: True)
    monkeypatch.setattr(bench_trl, "run_trl", lambda **_: pytest.fail("TRL was not asked for"))
    results = bench_e2e.run(seeds=[0, 1], num_steps=3, systems=["tidal-sync", "tidal-async"], progress=lambda m: None)
    assert calls == [("tidal-async", 0), ("tidal-sync", 0), ("tidal-sync", 1), ("tidal-async", 1)] and list(results) == ["tidal-async", "tidal-sync"]
    with pytest.raises(ValueError, match=r"unknown e2e system\(s\) \['tidal-asink'\]"):
        bench_e2e.run(seeds=[0], num_steps=3, systems=["tidal-asink"], progress=lambda m: None)


def test_e2e_a_system_that_fails_is_skipped_saying_why_and_the_others_are_measured(monkeypatch):
    # On an H200 `tidal-async-ray` failed to place its roles and the bench printed no table:
    # every measured number was lost (issue 40).
    from tidal.tools.bench import trl as bench_trl

    run = {"samples_per_s": 100.0, "tokens_per_s": 200.0, "rl_seconds": 1.0, "accuracy_before": 0.25, "accuracy_after": 0.5}

    def fake_run(system_overrides, *, seed, num_steps, overrides, recipe, workload):
        if "runtime=ray" in system_overrides:
            raise RuntimeError("placement: cannot place role 'rollout': 0/1 free\n(details)")
        if "threads=1" in system_overrides and seed == 1:
            raise ValueError("out of memory")
        return run

    monkeypatch.setattr(bench_e2e, "run_tidal", fake_run)
    monkeypatch.setattr(bench_trl, "available", lambda: False)
    results = bench_e2e.run(seeds=[0, 1, 2], num_steps=3, progress=lambda m: None)
    assert results["tidal-async-ray"] == [{"skipped": "failed at seed 0: RuntimeError: placement: cannot place role 'rollout': 0/1 free"}]
    assert len(results["tidal-async"]) == 3
    if "tidal-sync-1t" in bench_e2e.SYSTEMS:  # a machine with more than one core
        assert len(results["tidal-sync-1t"]) == 1  # its seed 0 kept; seed 2 not tried after seed 1 failed
    rows = {row[0]: row for row in bench_e2e.table(results)[1:]}
    assert rows["tidal-async-ray"][-1].startswith("not measured: failed at seed 0: RuntimeError") and rows["tidal-async"][1] == "100.0"


def test_e2e_quickstart_workload_is_the_quickstart_recipe_as_it_ships(monkeypatch):
    from tidal.tools.bench import trl as bench_trl

    calls = []
    monkeypatch.setattr(bench_e2e, "run_tidal", lambda system_overrides, *, overrides, recipe, **_: calls.append((recipe, tuple(overrides))) or {})
    monkeypatch.setattr(bench_trl, "available", lambda: False)
    bench_e2e.run(seeds=[0], num_steps=2, overrides=["device=cpu"], systems=["tidal-async"], progress=lambda m: None)
    assert calls == [("quickstart_cpu", ("device=cpu",))]


def test_e2e_longtail_workload_runs_gsm8k_qwen_on_its_files(monkeypatch, tmp_path):
    from tidal.tools.bench import fixture as bench_fixture
    from tidal.tools.bench import trl as bench_trl

    files = {"model": tmp_path / "model", "train": tmp_path / "train.jsonl"}
    monkeypatch.setattr(bench_fixture, "longtail_workload", lambda: files)  # no build: the files are not read here
    calls = []
    run = {"samples_per_s": 10.0, "tokens_per_s": 800.0, "rl_seconds": 1.0, "accuracy_before": None, "accuracy_after": None}
    monkeypatch.setattr(bench_e2e, "run_tidal", lambda system_overrides, *, overrides, recipe, workload, **_: calls.append((recipe, tuple(workload), tuple(system_overrides), tuple(overrides))) or run)
    monkeypatch.setattr(bench_trl, "available", lambda: False)
    results = bench_e2e.run(seeds=[0], num_steps=2, overrides=["rollout.max_new_tokens=64"], systems=["tidal-async"], workload="longtail", progress=lambda m: None)
    workload = (f"model.path={files['model']}", f"data.train_files=[{files['train']}]", *bench_e2e.LONGTAIL_OVERRIDES)
    assert calls == [("gsm8k_qwen", workload, tuple(bench_e2e.SYSTEMS["tidal-async"]), ("rollout.max_new_tokens=64",))]  # workload, then system (its threads win), then the user's
    header, async_row = bench_e2e.table(results, with_trl=False)
    assert async_row[6:8] == ["-", "-"]  # no held-out prompts: no accuracy, not 0%
    # TRL on the workload: tests/tools/test_bench_trl_longtail.py


def test_e2e_unknown_workload_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="longtail"):
        bench_e2e.run(seeds=[0], num_steps=1, workload="nope", progress=lambda m: None)


@pytest.mark.slow
def test_e2e_longtail_workload_really_runs_one_system(monkeypatch, tmp_path):
    """Two real steps of tidal-async on the longtail checkpoint (built into a fresh cache)."""
    from tidal.tools.bench.fixture import LONGTAIL_VERSION

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    results = bench_e2e.run(seeds=[0], num_steps=2, systems=["tidal-async"], workload="longtail", progress=lambda m: None)
    (run,) = results["tidal-async"]
    assert "skipped" not in run, run
    assert run["steps"] == 2 and run["samples_per_s"] > 0 and run["accuracy_before"] is None
    assert 1 <= run["response_len_start"] < 256  # most responses end before the budget
    assert (tmp_path / "tidal" / f"bench-longtail-v{LONGTAIL_VERSION}" / "model" / "model.safetensors").is_file()
