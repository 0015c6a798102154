"""`tidal bench store` measures the user's path: medians with their spread, the consumer
reading what it gets, ratios against the baselines of the same run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.tools.bench import store as bench_store


def _throughput(rows_per_s: float, mb_per_s: float, spread: float = 0.1) -> dict:
    def rates(scale: float) -> dict:
        return {"seconds": 1.0 / scale, "rows_per_s": rows_per_s * scale, "mb_per_s": mb_per_s * scale}

    return {**rates(1.0), "slowest": rates(1 - spread), "fastest": rates(1 + spread)}


def test_store_table_gives_medians_with_their_spread_and_ratios_of_medians():
    latency = {"p99_ms": 2.0, "run_p50_ms": [0.9, 1.0, 1.2], "p50_min_ms": 0.9, "p50_max_ms": 1.2, "put_p50_ms": 0.5}
    results = {
        "tidal": {"small-64": _throughput(40_000.0, 200.0), "small-256": _throughput(80_000.0, 400.0), "large": _throughput(600.0, 600.0), "trickle": _throughput(3_000.0, 15.0), "latency": latency},
        "raw-zmq": {"small-64": _throughput(400_000.0, 2000.0), "small-256": _throughput(400_000.0, 2000.0), "large": _throughput(1200.0, 1200.0), "trickle": _throughput(30_000.0, 150.0), "latency": {"p99_ms": 0.5, "run_p50_ms": [0.4, 0.5], "p50_min_ms": 0.4, "p50_max_ms": 0.5}},
        "transferqueue": {"small-64": _throughput(2_000.0, 10.0), "small-256": _throughput(4_000.0, 20.0), "large": _throughput(300.0, 300.0), "trickle": _throughput(200.0, 1.0)},
        "saved-before-trickle": {"small-64": _throughput(2_000.0, 10.0), "small-256": _throughput(4_000.0, 20.0), "large": _throughput(300.0, 300.0)},
    }
    header, tidal, raw, tq, old = bench_store.table(results)
    assert header == ["system", "small b64 rows/s", "x TQ", "small b256 rows/s", "x TQ", "1MB-row MB/s", "% raw", "trickle rows/s", "x TQ", "hand-off p50 ms", "x raw", "p99 ms", "put p50 ms"]
    assert tidal == ["tidal", "40,000 (36,000-44,000)", "20.0", "80,000 (72,000-88,000)", "20.0", "600 (540-660)", "50%", "3,000 (2,700-3,300)", "15.0", "1.00 (0.90-1.20)", "2.2", "2.00", "0.50"]
    assert raw[-4:] == ["0.45 (0.40-0.50)", "1.0", "0.50", "-"] and tq[2] == "1.0" and tq[-6:] == ["200 (180-220)", "1.0"] + ["-"] * 4
    assert old[7:9] == ["-", "-"]


def test_store_summaries_keep_every_run_and_split_hand_offs_into_runs():
    work = bench_store.Workload("w", bench_store.SMALL, 100, 10)
    s = bench_store.summary(work, [2.0, 1.0, 4.0])
    assert s["seconds"] == 2.0 and s["rows_per_s"] == 50.0 and s["slowest"]["seconds"] == 4.0 and s["fastest"]["seconds"] == 1.0 and len(s["runs"]) == 3
    lat = bench_store.latency_summary({"handoff": [0.001] * 5 + [0.003] * 5, "put": [0.0005] * 10}, repeats=2)
    assert lat["run_p50_ms"] == pytest.approx([1.0, 3.0]) and lat["p50_min_ms"] == pytest.approx(1.0) and lat["put_p50_ms"] == pytest.approx(0.5)


def test_the_consumer_reads_one_byte_of_every_page_and_raw_frames_are_the_tensors_buffers():
    data = torch.zeros(3 * bench_store.PAGE, dtype=torch.uint8)
    data[:: bench_store.PAGE] = 1
    assert bench_store.read_pages(data) == 3 and bench_store.read_pages(data.numpy().tobytes()) == 3
    assert bench_store.read_pages(torch.zeros(0)) == 0
    batch = {"a": torch.arange(4, dtype=torch.int64).reshape(2, 2), "b": torch.ones(2, 1)}
    frames = bench_store.raw_frames(batch)
    assert [f.nbytes for f in frames] == [32, 8] and np.shares_memory(frames[0], batch["a"].numpy())


def test_the_default_tidal_path_is_the_users_and_the_tuned_one_is_labelled():
    assert bench_store.PATHS["tidal"] == bench_store.Path(window=1, pipelined=False, retain=False, shm=True)
    tuned = bench_store.PATHS["tidal-tuned"]
    assert tuned.window > 1 and tuned.pipelined and tuned.retain
    assert bench_store.SYSTEMS[:2] == ("tidal", "tidal-tuned") and bench_store.SMALL_BATCHES == (64, 256)


def test_every_tidal_path_moves_every_row_in_each_run():
    work = bench_store.Workload("small", bench_store.SMALL, 64, 16)
    for system in ("tidal", "tidal-tuned", "tidal-embedded"):
        seconds = bench_store.tidal_runs(work, bench_store.PATHS[system], repeats=2)
        assert len(seconds) == 2 and all(s > 0 for s in seconds), system
    assert len(bench_store.zmq_runs(work, repeats=2)) == 2


def test_the_trickle_workload_puts_one_row_at_a_time_and_gets_batches():
    work = bench_store.TRICKLE
    batches = work.batches()
    assert len(batches) == work.num_rows and all(len(b["reward"]) == 1 for b in batches) and work.batch_size == 256
    assert ("trickle", work) in bench_store.workloads()
    small = bench_store.Workload("trickle", bench_store.SMALL, 32, 8, put_size=1)
    seconds = bench_store.tidal_runs(small, bench_store.PATHS["tidal"], repeats=1)  # every row arrives, in gets of 8
    assert len(seconds) == 1 and seconds[0] > 0 and len(bench_store.zmq_runs(small, repeats=1)) == 1
