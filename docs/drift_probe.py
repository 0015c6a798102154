"""The drift probe of 2026-11-28 (docs/benchmarks.md, "Strict rewards and the async drift").

Runs the quickstart with instrumentation and writes, per RL step: |proximal - behavior|
by version gap, the behavior logprobs checked against the weights of the version each
token is tagged with, rows of mixed versions, EOS probabilities and weights; and the
held-out accuracy under the strict and the lenient (first integer anywhere) rules.
JUNK=0.3 makes the warm start append a letter-led junk suffix to 30% of its answers: a
policy that has begun to drift. Not part of the package: it patches internals as they were
at e988e6c (`tools.train.evaluate`, `tools.train._answer_trajectories`,
`TorchTrainEngine.train_step`); check out that commit to run it as it ran.

    cd docs && JUNK=0.3 python drift_probe.py out.json seed=1 algorithm.num_steps=300 task.reward=drift_probe_lenient:arithmetic
"""
import json, sys, statistics
sys.path.insert(0, __import__("os").path.dirname(__file__))
import torch
from tidal.engines import torch_train
from tidal.tools import train as train_mod
from tidal.engines.rewards import arithmetic as strict
import drift_probe_lenient as lenient

out_path, overrides = sys.argv[1], sys.argv[2:]
log = []
orig_step = torch_train.TorchTrainEngine.train_step

def step(self, batch, advantages, *, loss, proximal_logprobs=None):
    with torch.no_grad():
        prox = self.logprobs(batch).float()
    mask = batch.loss_mask.bool()
    behav = batch.behavior_logprobs.float()
    diff = (prox - behav)
    rec = {"version": self.version}
    for gap in (0, 1, 2):
        sel = mask & (batch.versions == self.version - gap)
        if sel.any():
            d = diff[sel]
            rec[f"gap{gap}_n"] = int(sel.sum()); rec[f"gap{gap}_absmean"] = float(d.abs().mean()); rec[f"gap{gap}_absmax"] = float(d.abs().max()); rec[f"gap{gap}_mean"] = float(d.mean())
    # rows with mixed versions
    v = torch.where(mask, batch.versions, -10)
    mixed = [len(set(r[m].tolist())) > 1 for r, m in zip(batch.versions, mask)]
    rec["mixed_rows"] = sum(mixed)
    # EOS token stats: positions where the target token is EOS
    eos = mask & (batch.input_ids[:, 1:] == 2)
    if eos.any():
        rec["eos_behav_p"] = float(behav[eos].exp().mean()); rec["eos_prox_p"] = float(prox[eos].exp().mean())
        rec["eos_w_mean"] = float(diff[eos].exp().mean())
    rec["len"] = float(mask.sum(1).float().mean())
    prev = getattr(self, "_prev_state", None)
    if prev is not None:  # behavior logprobs vs the weights of the version the tokens say made them
        sel = mask & (batch.versions == self.version - 1)
        if sel.any():
            now = {k: t.clone() for k, t in self.model.state_dict().items()}
            self.model.load_state_dict(prev)
            with torch.no_grad():
                old = self.logprobs(batch).float()
            self.model.load_state_dict(now)
            d = (old - behav)[sel]
            rec["tagged_absmean"] = float(d.abs().mean()); rec["tagged_absmax"] = float(d.abs().max())
    self._prev_state = {k: t.clone() for k, t in self.model.state_dict().items()}
    log.append(rec)
    return orig_step(self, batch, advantages, loss=loss, proximal_logprobs=proximal_logprobs)

torch_train.TorchTrainEngine.train_step = step
orig_eval = train_mod.evaluate
evals = []
def evaluate(model, tokenizer, items, reward, **kw):
    s = orig_eval(model, tokenizer, items, strict, **kw)
    l = orig_eval(model, tokenizer, items, lenient.arithmetic, **kw)
    evals.append({"strict": s, "lenient": l})
    return s
train_mod.evaluate = evaluate

import os, random
JUNK = float(os.environ.get("JUNK", "0"))
if JUNK:  # a warm start that appends junk to a share of its answers: a policy that has drifted already
    orig_answers = train_mod._answer_trajectories
    rng = random.Random(0)
    def answers(items, tokenizer):
        junked = [{**it, "answer": str(it["answer"]) + rng.choice("abc") + "".join(rng.choice("abc0123456789") for _ in range(2))} if rng.random() < JUNK else it for it in items]
        return orig_answers(junked, tokenizer)
    train_mod._answer_trajectories = answers

from tidal.tools.recipes import resolve_recipe
from tidal.tools.run import prepare_run
import tempfile, pathlib
with tempfile.TemporaryDirectory() as tmp:
    cfg, run_dir = prepare_run(resolve_recipe("quickstart_cpu"), [*overrides, f"run_dir={tmp}/run", "tensorboard=false", "checkpoint_every=1000"])
    summary = train_mod.train(cfg, run_dir, progress=False)
    metrics = [json.loads(l) for l in open(pathlib.Path(tmp) / "run" / "metrics.jsonl")]
lens = [m["response_len"] for m in metrics if "response_len" in m]
json.dump({"overrides": overrides, "evals": evals, "steps": log, "response_len": lens, "samples_per_s": summary.get("samples_per_s")}, open(out_path, "w"))
print(out_path, overrides, evals[-1], "len first/last50:", statistics.mean(lens[:50]), statistics.mean(lens[-50:]), "sps", summary.get("samples_per_s"))
