"""`eval_every`: held-out accuracy during RL, in metrics.jsonl and summary.json, without
changing what the run trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SMALL = [
    "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
    "algorithm.max_staleness=0", "algorithm.num_steps=4", "threads=1", "tensorboard=false", "rollout.max_new_tokens=3",
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def _run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*SMALL, f"run_dir={run_dir}", *overrides])
    return train(cfg, made, progress=False)


def test_every_nth_step_records_held_out_accuracy_and_the_run_trains_as_without(runs, tmp_path, monkeypatch):
    from tidal.tools import train as train_module

    evaluated = []
    evaluate = train_module.evaluate
    monkeypatch.setattr(train_module, "evaluate", lambda model, *args, **kwargs: evaluated.append(model) or evaluate(model, *args, **kwargs))
    plain, periodic = tmp_path / "plain", tmp_path / "periodic"
    _run(plain)
    del evaluated[:]
    summary = _run(periodic, "eval_every=2")
    steps = runs.steps(periodic)
    accuracies = [m.get("held_out_accuracy") for m in steps]
    assert [a is not None for a in accuracies] == [False, True, False, True]
    assert all(0.0 <= a <= 1.0 for a in accuracies if a is not None)
    assert summary["accuracy_after"] == accuracies[-1]  # the last step's evaluation is the final one
    assert len(evaluated) == 2 + 2  # before and after the warm start, then steps 2 and 4 (none again at the end)
    assert [{k: v for k, v in m.items() if k != "held_out_accuracy"} for m in steps] == runs.steps(plain)  # greedy: nothing else changed
    assert (periodic / "progress.png").exists()
    assert json.loads((periodic / "summary.json").read_text())["accuracy_after"] == accuracies[-1]


def test_sampled_evaluations_change_nothing_the_run_trains_and_repeat_themselves(runs, tmp_path):
    """`eval.samples=4 eval.temperature=1.0`: each held-out prompt is answered four times from the
    evaluation's own generator, so the run trains as without evaluations (its random streams are
    untouched, here with a rollout that samples), and two such runs measure the same accuracies."""
    sampled = ["eval_every=2", "eval.samples=4", "eval.temperature=1.0", "eval.top_p=0.9"]
    plain, first, second = tmp_path / "plain", tmp_path / "first", tmp_path / "second"
    _run(plain)
    summary = _run(first, *sampled)
    _run(second, *sampled)
    steps = runs.steps(first)
    assert [{k: v for k, v in m.items() if k not in ("held_out_accuracy", "held_out_pass_at_n", "held_out_maj_at_n")} for m in steps] == runs.steps(plain)
    assert runs.steps(second) == steps
    accuracies = [m["held_out_accuracy"] for m in steps if "held_out_accuracy" in m]
    passes = [m["held_out_pass_at_n"] for m in steps if "held_out_accuracy" in m]
    assert len(accuracies) == 2 and all(a * 16 == round(a * 16) for a in accuracies)  # 4 prompts x 4 answers
    assert all(p * 4 == round(p * 4) and p >= a for p, a in zip(passes, accuracies))  # pass@4 over 4 prompts, never below mean@4
    assert (summary["accuracy_after"], summary["pass_at_n_after"]) == (accuracies[-1], passes[-1])
    majorities = [m["held_out_maj_at_n"] for m in steps if "held_out_accuracy" in m]  # the arithmetic verifier's answers are read: a vote per prompt
    assert all(v * 4 == round(v * 4) and v <= p for v, p in zip(majorities, passes)) and summary["maj_at_n_after"] == majorities[-1]
