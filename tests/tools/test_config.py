"""Typed recipe config: docs on every field, errors that name the key, shipped recipes."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tidal.tools.config import ConfigError, RecipeConfig, config_from_yaml, iter_keys, load_config, to_yaml
from tidal.tools.config_keys import field_docs
from tidal.tools.recipes import resolve_recipe, shipped_recipes


@dataclasses.dataclass
class _Optim:
    lr: float = 1e-3
    """Learning rate."""
    betas: list = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""


@dataclasses.dataclass
class _Schema:
    """A nested schema, to exercise what the recipe schema will grow into."""

    name: str = "x"
    """Name."""
    optim: _Optim = dataclasses.field(default_factory=_Optim)
    """Optimizer settings."""
    max_staleness: int = 1
    """Versions a sample may lag."""
    note: str | None = None
    """Free text."""


def test_every_schema_field_has_a_docstring():
    for key in iter_keys(RecipeConfig):
        assert key.doc, f"config key {key.key!r} has no docstring"
    assert set(field_docs(RecipeConfig)) == {f.name for f in dataclasses.fields(RecipeConfig)}


def test_defaults_recipe_and_overrides_merge_in_order(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: from_file\nseed: 3\n")
    cfg = load_config(recipe, ["seed=4"])
    assert (cfg.name, cfg.seed, cfg.device, cfg.runtime.name) == ("from_file", 4, "auto", "local")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sed=1", "unknown key 'sed' in the command-line overrides; did you mean 'seed'?"),
        ("runtim=ray", "did you mean 'runtime'"),
        ("algoritm.num_steps=3", "unknown key 'algoritm.num_steps' in the command-line overrides; did you mean 'algorithm.num_steps' or"),
        ("algorithm.num_stps=3", "unknown key 'algorithm.num_stps' in the command-line overrides; did you mean 'algorithm.num_steps' or"),
        ("seed=abc", "key 'seed' in the command-line overrides expects int, got 'abc' of type str"),
        ("seed=1.5", "expects int, got '1.5' of type float"),
        ("seed=18446744073709551616", "seed=18446744073709551616 must be <= 18446744073709551615"),  # was torch.manual_seed's traceback, after the run directory was made
        ("runtime=rey", "key 'runtime' in the command-line overrides expects one of local | ray, got 'rey'"),
        ("device=gpu", "device='gpu' is not a platform; valid values: auto, cpu, cuda, npu, fake:<kind>:<n>"),
        ("seed", "override 'seed' is not key=value"),
        ("=3", "is not key=value"),
        ("fault.rollout_restarts=-1", "fault.rollout_restarts=-1 must be >= 0"),
        ("fault.liveness_s=-1", "fault.liveness_s=-1.0 must be >= 0"),
        ("fault.liveness_grace_s=-5", "fault.liveness_grace_s=-5.0 must be >= 0"),
        ("checkpoint_every=0", "checkpoint_every=0 must be >= 1"),
        ("task.num_numbers=0", "task.num_numbers=0 must be >= 1"),
        ("task.max_number=0", "task.max_number=0 must be >= 1"),
        ("task.max_value=-1", "task.max_value=-1 must be >= 0"),  # was a traceback from the prompt generator, after the run directory was made
        ("task.ops=x", "task.ops='x' is not a non-empty set of the operators + - *"),
        ("task.ops=+/", "task.ops='+/' is not a non-empty set of the operators + - *"),
        ("keep_checkpoints=-1", "keep_checkpoints=-1 must be >= 0"),
        ("train.threads=-1", "train.threads=-1 must be >= 0"),
        ("train.precision=fp16", "key 'train.precision' in the command-line overrides expects one of fp32 | bf16, got 'fp16'"),
        ("algorithm.num_steps=0", "algorithm.num_steps=0 must be >= 1"),
        ("algorithm.group_size=1", "algorithm.group_size=1 must be >= 2: algorithm.advantage=grpo compares"),
        ("algorithm.group_size=0", "algorithm.group_size=0 must be >= 1"),
        ("algorithm.gamma=1.5", "algorithm.gamma=1.5 must be <= 1"),
        ("algorithm.lam=-0.1", "algorithm.lam=-0.1 must be >= 0"),
        ("algorithm={advantage: gae, filter_groups: true}", "algorithm.filter_groups leaves out groups"),
        ("rollout.temperature=0", "rollout.temperature=0.0 must be > 0"),
        ("algorithm.tis_cap=0", "algorithm.tis_cap=0.0 must be > 0"),
        ("model.num_heads=5", "hidden_size must be a multiple of num_heads"),
        ("algorithm.advantage=ppo", "algorithm.advantage='ppo' is not one of grpo, grpo_no_std, rloo, dr_grpo"),
        ("algorithm.aggregation=sum", "algorithm.aggregation='sum' is not one of token_mean"),
        ("algorithm.clip_low=1", "algorithm.clip_low must be in [0, 1), got 1.0"),  # when the recipe loads, not after the warm start
        ("model.attention=flash", "key 'model.attention' in the command-line overrides expects one of sdpa | eager, got 'flash'"),
        ("task.ops=*", "task.ops=*: the value is not valid YAML"),  # a YAML alias: was a traceback
        ("name=[abc", "name=[abc: the value is not valid YAML"),
        ("seed=${name}", "seed: While dereferencing interpolation '${name}'"),
        ("train.lr=nan", "train.lr=nan must be a finite number"),  # nan <= 0 is False: it passed
        ("algorithm.clip_high=nan", "algorithm.clip_high=nan must be a finite number"),
        # a section or list entry given a wrong value is named by its full key
        ("algorithm=3", "key 'algorithm' in the command-line overrides expects a mapping of its keys (num_steps, prompts_per_step, "),
        ("model=[1,2]", "key 'model' in the command-line overrides expects a mapping of its keys (hidden_size, "),
        ("model=[1,2]", "got [1, 2] of type list"),
        ("placement.train=5", "key 'placement.train' in the command-line overrides expects a mapping of its keys (requires, count, "),
        ("algorithm=null", "key 'algorithm' in the command-line overrides expects a mapping of its keys (num_steps, "),
        ("cluster.nodes=[1]", "key 'cluster.nodes[0]' in the command-line overrides expects a mapping of its keys (name, kind, devices, tags, count), got 1 of type int"),
        ("cluster.nodes=[{name: a}, {name: b, devices: x}]", "key 'cluster.nodes[1].devices' in the command-line overrides expects int, got 'x' of type str"),
        ("cluster.nodes=[{name: a}, {name: b, devics: 2}]", "unknown key 'cluster.nodes[1].devics' in the command-line overrides; did you mean 'cluster.nodes[1].devices'?"),
        ("cluster.nodes=[{name: a, tags: x}]", "key 'cluster.nodes[0].tags' in the command-line overrides expects list of str"),
        ("cluster.nodes=[{name: a, tags: [{x: 1}]}]", "cluster.nodes[0].tags holds {'x': 1}: tags are strings"),  # OmegaConf lets a mapping into a list of str
        ("placement.rollout.requires=[{x: 1}]", "placement.rollout.requires holds {'x': 1}: requires are strings"),
        # counts: when the recipe loads (a list entry's by its path), not when the plan is made
        ("cluster.nodes=[{name: a, count: -1}]", "cluster.nodes[0].count=-1 must be >= 1"),
        ("cluster.nodes=[{name: a}, {name: b, count: 0}]", "cluster.nodes[1].count=0 must be >= 1"),
        ("placement.train.count=0", "placement.train.count=0 must be >= 1"),
        ("placement.rollout.devices_each=0", "placement.rollout.devices_each=0 must be >= 1"),
        ("train.max_nonfinite_steps=-1", "train.max_nonfinite_steps=-1 must be >= 0"),
        ("train.lr_schedule=linear", "train.lr_schedule='linear' is not one of constant, cosine"),
        ("train.warmup_steps=-1", "train.warmup_steps=-1 must be >= 0"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio=1.5 must be in [0, 1]"),
        ("eval_every=-1", "eval_every=-1 must be >= 0"),
    ],
)
def test_override_errors_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_unknown_key_in_recipe_file_names_the_file(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: x\nruntiem: ray\n")
    with pytest.raises(ConfigError, match=r"unknown key 'runtiem' in recipe '.*bad.yaml'; did you mean 'runtime'"):
        load_config(recipe)
    recipe.write_text("name: x\nalgoritm:\n  group_size: 4\n")  # a misspelt section: the key the user wrote under it
    with pytest.raises(ConfigError, match=r"unknown key 'algoritm.group_size' in recipe '.*bad.yaml'; did you mean 'algorithm.group_size'"):
        load_config(recipe)


def test_nested_keys_errors_and_suggestions():
    cfg = load_config(None, ["optim.lr=0.5", "optim.betas=[0.8,0.9]"], schema=_Schema)
    assert cfg.optim.lr == 0.5 and list(cfg.optim.betas) == [0.8, 0.9]
    with pytest.raises(ConfigError, match="unknown key 'optim.lrr'.*did you mean 'optim.lr'"):
        load_config(None, ["optim.lrr=1"], schema=_Schema)
    with pytest.raises(ConfigError, match="did you mean 'max_staleness'"):
        load_config(None, ["max_stalenes=2"], schema=_Schema)
    with pytest.raises(ConfigError, match="key 'optim.lr' .* expects float, got 'fast'"):
        load_config(None, ["optim.lr=fast"], schema=_Schema)
    keys = {k.key: k for k in iter_keys(_Schema)}
    assert keys["optim.lr"].doc == "Learning rate." and keys["note"].type == "str or null"


def test_bad_recipe_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_the_keys_table_of_docs_recipes_says_what_the_schema_says():
    """docs/recipes.md's table has a row for every key, with its documentation as `tidal
    config --keys` prints it (a docstring changed in one place and not the other drifted once)."""
    from pathlib import Path

    lines = (Path(__file__).parents[2] / "docs" / "recipes.md").read_text().splitlines()
    rows = {line.split("|")[1].strip().strip("`"): line for line in lines if line.startswith("| `")}
    for entry in iter_keys(RecipeConfig):
        assert entry.key in rows, f"docs/recipes.md has no row for {entry.key}"
        doc = " ".join(entry.doc.split()).replace("|", "\\|")
        assert f" | {doc} |" in rows[entry.key], f"docs/recipes.md's row for {entry.key} says other than its docstring: {doc[:80]}..."


def test_every_shipped_recipe_validates():
    recipes = shipped_recipes()
    assert recipes, "no shipped recipes found"
    for path in recipes:
        cfg = load_config(path)
        assert cfg.name and cfg.description, f"{path.name} needs a name and a description"
        assert isinstance(cfg, RecipeConfig), type(cfg)  # the typed schema, not OmegaConf's container
        assert config_from_yaml(to_yaml(cfg)) == cfg, path.name  # what a run directory keeps, and Ray actors get, reads back the same


def test_resolve_recipe_by_name_or_path(tmp_path):
    assert resolve_recipe("quickstart_cpu").name == "quickstart_cpu.yaml"
    assert resolve_recipe("recipes/quickstart_cpu.yaml").name == "quickstart_cpu.yaml"
    own = tmp_path / "mine.yaml"
    own.write_text("name: mine\n")
    assert resolve_recipe(str(own)) == own
    with pytest.raises(ConfigError, match="shipped recipes: .*quickstart_cpu"):
        resolve_recipe("nope")


def test_the_loss_takes_the_recipes_keys_and_token_sum_norm_the_longest_response():
    from tidal.tools.config import loss_config

    cfg = load_config(None, ["algorithm.aggregation=token_sum_norm", "rollout.max_new_tokens=7", "algorithm.clip_high=0.3"])
    loss = loss_config(cfg)
    assert (loss.aggregation, loss.max_tokens, loss.clip_high, loss.clip_low) == ("token_sum_norm", 7, 0.3, cfg.algorithm.clip_low)


def test_the_task_and_its_reward_are_checked_before_the_run_and_a_reward_module_may_sit_in_the_current_directory(tmp_path, monkeypatch):
    import sys

    from tidal.tools.run import check_runnable

    recipe = resolve_recipe("quickstart_cpu")
    for override, named in (("task.reward=exact_mach", "task.reward='exact_mach': unknown reward"), ("task.name=sorting", "task.name='sorting' is not one of"), ("task.reward=no_such_module_here:f", "cannot import module")):
        with pytest.raises(ConfigError, match=named):
            check_runnable(load_config(recipe, [override]))
    (tmp_path / "my_reward_here.py").write_text("def score(trajectory, text):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as under the `tidal` console script
    check_runnable(load_config(recipe, ["task.reward=my_reward_here:score"]))
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        check_runnable(load_config(recipe, ["task.reward=my_reward_here:nope"]))


def test_a_bad_list_entry_in_a_recipe_file_is_named_by_its_full_key(tmp_path):
    recipe = tmp_path / "nodes.yaml"
    recipe.write_text("cluster:\n  nodes:\n    - {name: a, kind: cuda, devices: 2}\n    - {name: b, kind: npu, devices: many}\n")
    with pytest.raises(ConfigError, match=r"key 'cluster.nodes\[1\].devices' in recipe '.*nodes.yaml' expects int, got 'many' of type str"):
        load_config(recipe)
    recipe.write_text("cluster:\n  nodes:\n    - {name: a, kind: cuda, devices: 2}\n    - {name: b, kind: npu, count: -1}\n")
    with pytest.raises(ConfigError, match=r"cluster.nodes\[1\].count=-1 must be >= 1"):
        load_config(recipe)
    assert load_config(None, ["cluster.nodes=[{name: a, count: 2}]", "train.max_nonfinite_steps=0"]).train.max_nonfinite_steps == 0
    recipe.write_text("rollout: fast\n")
    with pytest.raises(ConfigError, match=r"key 'rollout' in recipe '.*nodes.yaml' expects a mapping of its keys \(backend, .*got 'fast' of type str"):
        load_config(recipe)


@pytest.mark.parametrize(
    ("overrides", "prompt", "budget", "named"),
    [  # the longest prompt, <bos> included; rollout.max_new_tokens; the task keys the prompt follows from
        (["task.max_value=20", "task.ops=+-"], 1 + len("20+20="), 6, "task.max_value=20"),
        (["task.max_value=100", "task.ops='*'", "rollout.max_new_tokens=9"], 1 + len("100*100="), 9, "task.max_value=100"),
        (["task.name=countdown", "task.num_numbers=3", "task.max_number=10"], 1 + len("10 10 10>1000:"), 6, "task.num_numbers=3, task.max_number=10"),
        (["task.name=countdown", "task.num_numbers=3", "task.max_number=1"], 1 + len("1 1 1>3:"), 6, "task.max_number=1"),  # 1+1+1 beats 1*1*1
    ],
)
def test_model_max_positions_must_hold_the_longest_prompt_and_the_generation_limit(overrides, prompt, budget, named):
    longest = prompt + budget
    assert load_config(None, [*overrides, f"model.max_positions={longest}"]).model.max_positions == longest
    with pytest.raises(ConfigError) as e:
        load_config(None, [*overrides, f"model.max_positions={longest - 1}"])
    message = str(e.value)
    assert f"model.max_positions={longest - 1} is shorter than the longest sequence: {prompt} prompt tokens" in message
    assert f"+ rollout.max_new_tokens={budget} = {longest} tokens" in message and named in message


@pytest.mark.parametrize(("name", "params"), [("arithmetic", {"max_value": 12, "ops": "+-*"}), ("countdown", {"num_numbers": 2, "max_number": 3})])
def test_the_longest_prompt_bound_is_the_longest_prompt_the_task_draws(name, params):
    """The bound is exact: the task's own generator reaches it (small tasks, many draws)
    and never exceeds it."""
    from tidal.engines.tasks import TASKS
    from tidal.tools.config import longest_prompt

    cfg = load_config(None, [f"task.name={name}", *(f"task.{k}={v}" for k, v in params.items())])
    drawn = max(len(item["prompt"]) for item in TASKS[name](5000, seed=0, **params))
    assert longest_prompt(cfg) == drawn + 1  # and <bos>


def test_every_schema_class_is_importable_from_tidal_tools_config():
    """The schema lives in `config_schema`; code and recipes' users import it from `config`."""
    from tidal.flow import config as flow_config
    from tidal.tools import config, config_schema

    defined = [value for value in vars(config_schema).values() if isinstance(value, type) and value.__module__ == config_schema.__name__]
    assert len(defined) >= 14  # RecipeConfig, its sections, the enums, ConfigError (rollout and algorithm are flow's: `flow.config`)
    assert all(getattr(config, cls.__name__, None) is cls for cls in defined)
    assert (config.RolloutConfig, config.AlgorithmConfig) == (flow_config.RolloutConfig, flow_config.AlgorithmConfig)


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [("run_dir=001", "run_dir", "001"), ("name=no", "name", "no"), ("name=1e-3", "name", "1e-3"), ("description=0.10", "description", "0.10"), ("output_dir=2024_01", "output_dir", "2024_01")],
)
def test_a_string_key_keeps_the_text_of_its_override(override, key, expected):
    """YAML read `run_dir=001` as the int 1 and `name=no` as False, which the str key then
    held as '1' and 'False': another folder, another name, and no error."""
    assert getattr(load_config(None, [override]), key) == expected


def test_a_string_override_given_twice_keeps_the_last_text():
    assert load_config(None, ["name=abc", "name=001"]).name == "001"
    assert load_config(None, ["name=001", "name=abc"]).name == "abc"


@pytest.mark.parametrize(
    ("override", "expected"),
    [("seed=010", "seed=010: YAML reads it as 8"), ("seed=-010", "seed=-010: YAML reads it as -8"), ("seed=1:30", "seed=1:30: YAML reads it as 90"), ("train.lr=1:30", "train.lr=1:30: YAML reads it as 90 (octal or base 60)")],
)
def test_a_number_override_in_yaml_octal_or_base_60_is_refused(override, expected):
    """YAML 1.1 reads `010` as octal 8 and `1:30` as base 60, 90: `seed=010` ran with seed 8."""
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, [override])
    assert load_config(None, ["seed=07", "train.lr=1e-3"]).seed == 7  # the same in octal and decimal


@pytest.mark.parametrize("override", ["cluster.nodes[0].kind=cuda", "cluster.nodes.0.kind=cuda", "placement.train.requires[0]=npu", "placement.train.requires={a: 1}"])
def test_a_list_key_given_one_entry_or_a_mapping_is_a_config_error(override):
    """OmegaConf raised `TypeError: Cannot merge incompatible container types`, a traceback
    and exit 1, for an override of one list entry or a list given a mapping."""
    key = override.split("[")[0].split(".0")[0].split("=")[0]
    with pytest.raises(ConfigError, match=rf"key '{re.escape(key)}' in the command-line overrides expects a list .*, got a mapping"):
        load_config(resolve_recipe("mixed_npu_gpu"), [override])


def test_a_list_key_given_a_mapping_in_a_recipe_file_is_a_config_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("cluster:\n  nodes:\n    a: {kind: cuda}\n")
    with pytest.raises(ConfigError, match=r"key 'cluster.nodes' in recipe '.*r.yaml' expects a list of NodeConfig, got a mapping"):
        load_config(recipe)


def test_entropy_coef_must_be_finite():
    """Every other float key refused inf; `algorithm.entropy_coef=.inf` loaded and made the loss -inf."""
    with pytest.raises(ConfigError, match=r"algorithm.entropy_coef=inf must be a finite number"):
        load_config(None, ["algorithm.entropy_coef=.inf"])


def test_a_recipe_file_keeps_a_string_keys_text_and_refuses_a_number_in_octal(tmp_path):
    """The overrides' rule holds in a recipe file too: `run_dir: 001` ran in folder '1', and
    `seed: 010` ran with seed 8."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: 001\nname: no\ntask:\n  reward: 0.10\nseed: 7\n")
    cfg = load_config(recipe)
    assert (cfg.run_dir, cfg.name, cfg.task.reward, cfg.seed) == ("001", "no", "0.10", 7)
    recipe.write_text("name: '001'\ntrain:\n  lr: 1:30\n")
    with pytest.raises(ConfigError, match=re.escape(f"key 'train.lr' in recipe {str(recipe)!r} (1:30): YAML reads it as 90")):
        load_config(recipe)
    recipe.write_text("seed: 010\n")
    with pytest.raises(ConfigError, match="YAML reads it as 8"):
        load_config(recipe)


def test_the_loop_takes_the_recipes_own_sections():
    """`WorkflowConfig` holds the schema's `algorithm` and `rollout` sections as loaded:
    one declaration of each key, so the loop and the recipe cannot drift apart."""
    import typing

    from tidal.flow import config as flow_config
    from tidal.tools.rl import workflow_config

    hints = typing.get_type_hints(RecipeConfig)
    assert (hints["algorithm"], hints["rollout"]) == (flow_config.AlgorithmConfig, flow_config.RolloutConfig)
    cfg = load_config(resolve_recipe("quickstart_cpu"), ["algorithm.max_staleness=0", "rollout.max_new_tokens=5", "threads=2"])
    loop = workflow_config(cfg)
    assert loop.algorithm is cfg.algorithm and loop.rollout is cfg.rollout
    assert (loop.algorithm.max_staleness, loop.loss.max_tokens, loop.rollout_threads, loop.lease_s) == (0, 5, 2, cfg.lease_s)


def test_each_section_declares_its_own_bounds():
    """The bounds a recipe is checked against live on the section they bound (`BOUNDS`),
    and each is enforced under the key's full name, list entries too."""
    from tidal.tools.config import NodeConfig, RoleConfig, TrainConfig

    assert TrainConfig.BOUNDS.at_least["micro_batch_size"] == 1 and "grad_clip" in TrainConfig.BOUNDS.positive
    assert RoleConfig.BOUNDS.at_least["devices_each"] == 1 and NodeConfig.BOUNDS.at_least["count"] == 1
    with pytest.raises(ConfigError, match=r"^placement.rollout.devices_each=0 must be >= 1$"):
        load_config(None, ["placement.rollout.devices_each=0"])
    with pytest.raises(ConfigError, match=r"^train.grad_clip=0.0 must be > 0: gradients are clipped to this norm$"):
        load_config(None, ["train.grad_clip=0"])


def test_the_schema_imports_without_torch():
    """`tidal doctor` explains a torch that cannot import (torch_npu without CANN) only if
    the config module loads without it: every check that needs torch imports it when it runs."""
    import subprocess
    import sys

    code = "import sys, tidal.tools.config, tidal.flow.config; print(sorted(m for m in ('torch', 'tidal.flow.algorithms', 'tidal.hal.transfer') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
