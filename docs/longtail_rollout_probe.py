"""The long-tail rollout probe of 2026-11-28 (docs/benchmarks.md, "The `longtail` workload").

Measures the `hf` rollout engine alone on the longtail workload's checkpoint and prompts
(`tidal.tools.bench.fixture.longtail_workload`), one torch thread, no training: samples/s
when each batch of `ROWS` samples (prompts x 4) runs until its longest sample ends
(static batches, as a synchronous step generates), against continuous batching, where
a group's slots are refilled with the next prompt's samples as soon as they are free
(`generate(..., refill=...)`). Both decode the same number of prompts in the same order
with the same sampling settings; the median of `REPEATS` runs is printed. The ratio is
the most that streaming around the long tail can give the rollout stage on this model
and machine; `tidal bench e2e --workload longtail` measures the whole loop.

    python docs/longtail_rollout_probe.py [ROWS=32] [BATCHES=6] [REPEATS=3]
"""

import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.flow.trajectory import Trajectory
from tidal.tools.bench.fixture import longtail_workload

ROWS, BATCHES, REPEATS = (int(a) for a in (sys.argv[1:] + ["32", "6", "3"][len(sys.argv) - 1 :])[:3])
GROUP, BUDGET = 4, 256

torch.set_num_threads(1)
files = longtail_workload()
model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(files["model"])
rows = [json.loads(line) for line in open(files["train"])]
prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False))["input_ids"] for r in rows]
engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id or 0, chunk_tokens=32)
num_prompts = BATCHES * ROWS // GROUP


def group(k: int) -> list[Trajectory]:
    return [Trajectory(prompt_ids=list(prompts[k % len(prompts)])) for _ in range(GROUP)]


def static() -> tuple[float, float]:
    start, tokens = time.perf_counter(), 0
    for b in range(BATCHES):
        batch = [t for k in range(b * ROWS // GROUP, (b + 1) * ROWS // GROUP) for t in group(k)]
        engine.generate(batch, max_new_tokens=BUDGET)
        tokens += sum(t.num_generated for t in batch)
    seconds = time.perf_counter() - start
    return num_prompts * GROUP / seconds, tokens / seconds


class Feeder:
    """Refills free slots a group at a time with the next prompts (`flow.protocols.Refill`)."""

    def __init__(self) -> None:
        self.next, self.live, self.samples, self.tokens = ROWS // GROUP, ROWS, 0, 0

    def done(self, trajectories: list[Trajectory]) -> None:
        self.live -= len(trajectories)
        self.samples += len(trajectories)
        self.tokens += sum(t.num_generated for t in trajectories)

    def more(self) -> list[Trajectory]:
        out = []
        while self.next < num_prompts and self.live + GROUP <= ROWS:
            out += group(self.next)
            self.next += 1
            self.live += GROUP
        return out


def continuous() -> tuple[float, float]:
    feeder = Feeder()
    start = time.perf_counter()
    engine.generate([t for k in range(ROWS // GROUP) for t in group(k)], max_new_tokens=BUDGET, refill=feeder)
    seconds = time.perf_counter() - start
    return feeder.samples / seconds, feeder.tokens / seconds


results = {"static": [], "continuous": []}
for r in range(REPEATS):
    for name, run in (("static", static), ("continuous", continuous)):
        torch.manual_seed(r)
        results[name].append(run())
for name, runs in results.items():
    samples = [s for s, _ in runs]
    print(f"{name:>10}: {statistics.median(samples):6.1f} samples/s (runs {', '.join(f'{s:.1f}' for s in samples)}), {statistics.median(t for _, t in runs):7.0f} tokens/s")
ratio = statistics.median(s for s, _ in results["continuous"]) / statistics.median(s for s, _ in results["static"])
print(f"continuous / static: {ratio:.2f}x at {ROWS} rows")
