"""Every policy-loss option is a recipe key under `algorithm.`: it reaches the loss the
trainer uses, its defaults keep the loss the recipes trained with before, a bad value is a
`ConfigError` naming the key, and `tidal config --keys` documents it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml

from tidal.flow.algorithms import PolicyLossConfig
from tidal.tools.config import ConfigError, RecipeConfig, iter_keys, load_config, loss_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.train import workflow_config

FROM_OTHER_KEYS = {"max_tokens": "rollout.max_new_tokens", "proximal_is_policy": "algorithm.decoupled"}
"""PolicyLossConfig fields a recipe sets through another key."""

NEW_VALUES = {"level": "sequence", "seq_mask_low": 0.5, "seq_mask_high": 2.0, "kl_estimator": "k2", "dual_clip": 3.0, "clip_low": 0.1, "clip_high": 0.4, "aggregation": "seq_mean_token_sum", "tis_cap": 5.0, "kl_coef": 0.1, "entropy_coef": 0.01}
"""A value other than the default for every loss field a recipe sets under its own name."""


def test_every_loss_field_has_a_documented_recipe_key():
    docs = {entry.key: entry.doc for entry in iter_keys(RecipeConfig)}
    for field in dataclasses.fields(PolicyLossConfig):
        key = FROM_OTHER_KEYS.get(field.name, f"algorithm.{field.name}")
        assert docs.get(key), f"PolicyLossConfig.{field.name} has no documented recipe key {key}"
    assert set(NEW_VALUES) == {f.name for f in dataclasses.fields(PolicyLossConfig)} - set(FROM_OTHER_KEYS)


def test_each_key_reaches_the_trainers_loss():
    cfg = load_config(resolve_recipe("quickstart_cpu"), [f"algorithm.{k}={v}" for k, v in NEW_VALUES.items()])
    loss = workflow_config(cfg).loss
    assert {k: getattr(loss, k) for k in NEW_VALUES} == NEW_VALUES


def test_the_defaults_are_the_loss_recipes_trained_with_before():
    # What `loss_config` built before these keys existed: clip, aggregation, cap, KL weight.
    for recipe in sorted(resolve_recipe("quickstart_cpu").parent.glob("*.yaml")):
        cfg = load_config(recipe)
        a = cfg.algorithm
        before = PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, aggregation=a.aggregation, tis_cap=a.tis_cap, kl_coef=a.kl_coef, max_tokens=cfg.rollout.max_new_tokens)
        assert loss_config(cfg) == before, recipe.name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.level=group"], r"algorithm.level='group' is not one of token, sequence"),
        (["algorithm.kl_estimator=k4"], r"algorithm.kl_estimator='k4' is not one of k1, k2, k3"),
        (["algorithm.dual_clip=1.0"], r"algorithm.dual_clip must be > 1 or null, got 1.0"),
        (["algorithm.dual_clip=0"], r"algorithm.dual_clip must be > 1 or null, got 0"),
        (["algorithm.dual_clip=.inf"], r"algorithm.dual_clip=inf must be a finite number"),
        (["algorithm.dual_clip=.nan"], r"algorithm.dual_clip=nan must be a finite number"),
        (["algorithm.dual_clip=high"], r"key 'algorithm.dual_clip' in the command-line overrides expects float or null, got 'high'"),
        (["algorithm.seq_mask_high=0"], r"algorithm.seq_mask_high=0.0 must be > 0"),
        (["algorithm.entropy_coef=-0.1"], r"algorithm.entropy_coef must be >= 0, got -0.1"),
        (["algorithm.seq_mask_low=.nan"], r"algorithm.seq_mask_low=nan must be a finite number"),
        (["algorithm.seq_mask_low=2", "algorithm.seq_mask_high=1"], r"algorithm.seq_mask_low \(2.0\) must be <= algorithm.seq_mask_high \(1.0\)"),
    ],
)
def test_a_bad_loss_value_is_a_config_error_naming_its_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_loss_error_names_the_recipe_key_of_each_field_it_names():
    from tidal.tools.config import loss_error

    assert str(loss_error(ValueError("max_tokens must be a positive int for aggregation 'token_sum_norm', got 0"))).startswith("rollout.max_new_tokens must be")
    assert str(loss_error(ValueError("tis_cap must be > 0 or None, got -1"))) == "algorithm.tis_cap must be > 0 or null, got -1"
    assert str(loss_error(ValueError("seq_mask_low (2.0) must be <= seq_mask_high (1.0)"))) == "algorithm.seq_mask_low (2.0) must be <= algorithm.seq_mask_high (1.0)"


def test_tidal_config_keys_lists_the_loss_keys_with_their_meaning(tidal_cli):
    out = tidal_cli("config", "--keys")
    assert out.returncode == 0, out.stderr
    for key, word in (("level", "GSPO"), ("seq_mask_low", "geometric"), ("seq_mask_high", "geometric"), ("kl_estimator", "k3"), ("dual_clip", "clip_ratio_c"), ("entropy_coef", "entropy_coeff")):
        assert f"algorithm.{key}" in out.stdout
        assert word in out.stdout.split(f"algorithm.{key}", 1)[1].split("algorithm.", 1)[0], key


def test_a_tiny_run_trains_gspo_with_dual_clip_and_sequence_masking(tidal_cli, tmp_path):
    """The real `tidal run`, a few seconds: the options land in the resolved config and
    `dual_clip_fraction` (a metric only a loss with dual-clip reports) in every step's
    metrics. `decoupled=false` puts the ratio against the behavior policy, where the clip
    and dual-clip act (decoupled, the ratio is 1 within a step)."""
    options = ["algorithm.level=sequence", "algorithm.aggregation=seq_mean_token_mean", "algorithm.dual_clip=3.0", "algorithm.seq_mask_low=0.01", "algorithm.seq_mask_high=100", "algorithm.decoupled=false"]
    # A reward of the text's parity: every group of the untrained model's samples has both
    # values (an all-equal group has no signal, its rows no pass and no loss metrics).
    (tmp_path / "parity_reward.py").write_text("def score(trajectory, text):\n    return float(sum(map(ord, text)) % 2)\n")
    small = ["sft.steps=0", "task.num_eval_prompts=8", "algorithm.num_steps=3", "algorithm.prompts_per_step=4", "algorithm.group_size=4", "task.reward=parity_reward:score", "tensorboard=false", "threads=1", "--no-progress"]
    run_dir = tmp_path / "run"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *options, *small, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    algo = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]
    assert (algo["level"], algo["dual_clip"], algo["seq_mask_low"], algo["seq_mask_high"]) == ("sequence", 3.0, 0.01, 100.0)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    for step in steps:
        assert 0.0 <= step["dual_clip_fraction"] <= 1.0 and 0.0 <= step["seq_masked_fraction"] <= 1.0, step
        assert math.isfinite(step["loss"]), step
