"""`tools/metrics.py`: metrics.jsonl always, TensorBoard scalars when installed."""

from __future__ import annotations

import json
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tidal.tools.metrics import MetricsLog, scalars


def _step(step: int, reward: float) -> dict:
    return {"step": step, "time": 1.0e9 + step, "reward": reward, "samples": 128, "converged": False, "version_gap": {"0": 300, "1": 20}, "wait_s": {"train": 0.5}, "groups": [0, 1]}


def _read(folder) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_scalars_are_the_numbers_nested_mappings_flattened_and_not_step_time_flags_or_lists():
    assert list(scalars(_step(3, 0.25))) == [("reward", 0.25), ("samples", 128.0), ("version_gap/0", 300.0), ("version_gap/1", 20.0), ("wait_s/train", 0.5)]


def test_every_step_reaches_jsonl_and_tensorboard_and_a_restart_replaces_the_steps_it_redoes(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.write(_step(step, reward=step / 10))
        assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step  # on disk before close: a crash keeps it
    log.write_final({"held_out_accuracy": {"before_rl": 0.25, "after_rl": 0.75}}, step=5)
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    first = _read(tmp_path / "tensorboard")
    assert first["reward"] == [(s, pytest.approx(s / 10)) for s in range(1, 6)] and first["samples"][-1] == (5, 128.0)
    assert first["held_out_accuracy/after_rl"] == [(5, 0.75)]

    again = MetricsLog(tmp_path, first_step=4)  # a trainer restarted from step 3's checkpoint
    for step in (4, 5, 6):
        again.write(_step(step, reward=1.0))
    again.close()
    rewards = _read(tmp_path / "tensorboard")["reward"]
    assert [s for s, _ in rewards] == [1, 2, 3, 4, 5, 6]  # 4 and 5 once each: the earlier attempt's are dropped
    assert dict(rewards)[4] == 1.0 and dict(rewards)[3] == pytest.approx(0.3)



def test_a_run_resumed_into_a_new_directory_has_the_earlier_steps_in_its_tensorboard_too(tmp_path):
    earlier = [_step(step, reward=step / 10) for step in (1, 2, 3)]
    log = MetricsLog(tmp_path / "new", first_step=4, earlier=earlier)
    for step in (4, 5):
        log.write(_step(step, reward=1.0))
    log.close()
    rewards = _read(tmp_path / "new" / "tensorboard")["reward"]
    assert rewards == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3)), (4, 1.0), (5, 1.0)]

    again = MetricsLog(tmp_path / "new", first_step=5, earlier=[*earlier, _step(4, reward=1.0)])  # resumed in its own directory: its folder has them
    again.write(_step(5, reward=0.5))
    again.close()
    assert [s for s, _ in _read(tmp_path / "new" / "tensorboard")["reward"]] == [1, 2, 3, 4, 5]


def test_without_tensorboard_installed_or_wanted_only_jsonl(tmp_path, monkeypatch):
    (tmp_path / "off").mkdir()
    off = MetricsLog(tmp_path / "off", tensorboard=False)
    off.write(_step(1, 0.5))
    off.close()
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed: `import tensorboard...` raises ImportError
    (tmp_path / "missing").mkdir()
    missing = MetricsLog(tmp_path / "missing")
    missing.write(_step(1, 0.5))
    missing.close()
    for run in ("off", "missing"):
        assert sorted(p.name for p in (tmp_path / run).iterdir()) == ["metrics.jsonl"]
        assert json.loads((tmp_path / run / "metrics.jsonl").read_text())["reward"] == 0.5


def test_metrics_jsonl_is_standard_json_when_a_number_is_nan_or_infinite(tmp_path):
    """Python's json writes NaN and Infinity, which jq and other strict parsers refuse: a
    diverged loss made the whole file unreadable to them. They are written as null."""
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({**_step(1, float("nan")), "loss": float("inf"), "groups": [float("-inf"), 2.5]})
    log.close()

    def strict(constant: str) -> None:
        raise ValueError(f"not standard JSON: {constant}")

    line = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=strict)
    assert line["reward"] is None and line["loss"] is None and line["groups"] == [None, 2.5]
    assert line["samples"] == 128 and line["version_gap"] == {"0": 300, "1": 20}


def test_the_last_metrics_line_is_read_from_the_tail_and_a_line_being_written_is_none(tmp_path):
    """The Ray driver's progress bar read the whole file every second and parsed any last
    line ending in "}", which a line cut after a nested dict does too."""
    from tidal.tools.metrics import last_metrics

    path = tmp_path / "metrics.jsonl"
    assert last_metrics(path) is None
    path.write_text("".join(f'{{"step": {s}, "reward": 0.5, "pad": "{"x" * 200}"}}\n' for s in range(1, 2001)))  # ~450 KB
    assert last_metrics(path)["step"] == 2000
    with open(path, "a") as f:
        f.write('{"step": 2001, "wait_s": {"train": 0.5}')  # cut short after a nested "}"
    assert last_metrics(path) is None
