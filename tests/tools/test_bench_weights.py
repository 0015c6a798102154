"""`tidal bench weights`: every system moves a real model between two processes; ratios in the table."""

from __future__ import annotations

import pytest

from tidal.tools.bench import weights as bench_weights


def test_model_of_has_the_requested_size_in_pieces():
    model = bench_weights.model_of(10 << 20)
    sizes = [t.numel() * t.element_size() for t in model.values()]
    assert abs(sum(sizes) - (10 << 20)) < 16 and max(sizes) <= bench_weights.TENSOR_BYTES


@pytest.mark.parametrize("system", bench_weights.SYSTEMS)
def test_every_system_completes_transfers_between_two_processes(system):
    times = bench_weights.measure(system, 1 << 20, 2)
    assert len(times) == 2 and all(0 < t < 60 for t in times)


def test_weights_table_ratios_against_the_raw_channel_under_each_transport():
    results = {
        "host": {"4": 1.0, "64": 1.4},
        "collective": {"4": 0.5, "64": 0.9},
        "raw-zmq": {"4": 2.0, "64": 2.0},
        "raw-gloo": {"4": 1.0, "64": 1.0},
    }
    header, host, collective, raw_zmq, _ = bench_weights.table(results)
    assert header == ["system", "4 MB GB/s", "64 MB GB/s", "4 MB % raw", "64 MB % raw"]
    assert host == ["host", "1.00", "1.40", "50%", "70%"]
    assert collective[-2:] == ["50%", "90%"] and raw_zmq[-2:] == ["-", "-"]


def test_raw_zmq_receiver_builds_nothing_while_a_transfer_is_timed(monkeypatch):
    """The raw-zmq receiver's timed receive only takes frames and copies them out, as the host
    receiver does: it once built a whole model of `size` bytes (allocated and filled) for its
    shapes inside every transfer, which at 1 GB took longer than the transfer and made the
    baseline look slow (host at 107-264% of "raw")."""
    import queue
    import threading

    import torch
    import zmq

    built_while_timed = []
    sending = threading.Event()
    real_model_of = bench_weights.model_of

    def model_of(size):
        built_while_timed.append(sending.is_set())
        return real_model_of(size)

    monkeypatch.setattr(bench_weights, "model_of", model_of)
    ready, done = queue.Queue(), queue.Queue()
    threads = torch.get_num_threads()
    receiver = threading.Thread(target=bench_weights._receiver, args=("raw-zmq", 1 << 20, 2, ready, done), daemon=True)
    receiver.start()
    sock = zmq.Context.instance().socket(zmq.PUSH)
    try:
        sock.connect(ready.get(timeout=30))
        weights = real_model_of(1 << 20)
        for _ in range(2):
            sending.set()
            for t in weights.values():
                sock.send(t.view(torch.uint8).numpy())
            done.get(timeout=30)
        receiver.join(timeout=30)
    finally:
        sock.close(linger=0)
        torch.set_num_threads(threads)
    assert built_while_timed and not any(built_while_timed), built_while_timed


def test_a_transfer_whose_process_dies_fails_at_once_naming_the_system():
    """A sender or receiver that exits without the times (it raised: a port, /dev/shm full)
    once left `measure` waiting out its 15-minute timeout, then raising a bare `queue.Empty`."""
    import queue
    import time
    from types import SimpleNamespace

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="raw-shm: the receiver process exited with code 1"):
        bench_weights._times(queue.Queue(), "raw-shm", sender=SimpleNamespace(exitcode=None), receiver=SimpleNamespace(exitcode=1))
    assert time.monotonic() - started < 0.5
    out = queue.Queue()
    out.put([0.25, 0.5])
    assert bench_weights._times(out, "host", sender=SimpleNamespace(exitcode=0), receiver=SimpleNamespace(exitcode=0)) == [0.25, 0.5]
