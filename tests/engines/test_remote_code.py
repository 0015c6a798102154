"""A checkpoint whose model is code of its own (`model.trust_remote_code`, `remote_code_hf_dir`):
loaded without transformers stopping to ask, and built by a led group's follower in a process
that never loaded it (`tidal.engines.remote_code`, `fsdp_commands.model_recipe`)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import types

import pytest

from tidal.engines import remote_code
from tidal.engines.fsdp_commands import build_from_recipe, model_recipe
from tidal.engines.models import HFSource, recompute_activations, recomputes_activations
from tidal.engines.tokenizers import HFTokenizer


def _section(path, **keys):
    base = {"path": str(path), "dtype": "float32", "trust_remote_code": True, "attention": "sdpa", "gradient_checkpointing": False}
    return types.SimpleNamespace(**{**base, **keys})


TOKENIZER_ONLY = textwrap.dedent(
    """
    import builtins, json, sys, types
    from tidal.engines.models import HFSource

    asked = []
    builtins.input = lambda prompt="": asked.append(prompt) or "n"
    section = types.SimpleNamespace(path=sys.argv[1], dtype="float32", trust_remote_code=True, attention="sdpa", gradient_checkpointing=False)
    tokenizer = HFSource(section).load_tokenizer(sys.argv[1])
    print(json.dumps({"asked": len(asked), "ids": tokenizer.encode("What is 2+3?")}))
    """
)


def test_the_tokenizer_of_a_custom_model_loads_without_asking(remote_code_hf_dir, child_env):
    """AutoTokenizer reads the model's config too: in a process that had not loaded the model
    (a rollout actor, a resume's check) and without being told, transformers asked on the
    terminal whether to run the code (a local run waited there) and, answered no, fell back
    to a bare config with a warning."""
    out = subprocess.run([sys.executable, "-c", TOKENIZER_ONLY, str(remote_code_hf_dir)], env=child_env(None), capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {"asked": 0, "ids": HFTokenizer.from_pretrained(remote_code_hf_dir, trust_remote_code=True).encode("What is 2+3?")}
    assert "custom code" not in out.stderr and "to instantiate a model of type" not in out.stderr


def test_the_source_loads_a_custom_model(remote_code_hf_dir):
    policy = HFSource(_section(remote_code_hf_dir)).build(seed=0)
    assert type(policy.module).__name__ == "TidalTestForCausalLM"
    assert type(policy.module).__module__.startswith("transformers_modules.")


FOLLOWER = textwrap.dedent(
    """
    import json, pickle, sys
    from pathlib import Path
    from tidal.engines.fsdp_commands import build_from_recipe
    from tidal.engines.models import recomputes_activations

    command = pickle.loads(Path(sys.argv[1]).read_bytes())  # as receive_command unpickles it
    model = build_from_recipe(command["model"])
    print(json.dumps({
        "class": type(model).__name__, "module": type(model).__module__, "config": type(model.config).__name__,
        "recompute": recomputes_activations(model), "dtype": str(next(model.parameters()).dtype),
        "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
    }))
    """
)


def test_a_follower_builds_a_custom_model_in_a_process_that_never_loaded_it(remote_code_hf_dir, tmp_path, child_env):
    """A led group's follower unpickles rank 0's model class. A custom model's class lives in
    transformers' modules cache of the process that loaded it: a follower with a cache of its
    own (another node; here an empty `HF_MODULES_CACHE`) failed with `ModuleNotFoundError:
    No module named 'transformers_modules'`. The recipe carries the code files."""
    model = HFSource(_section(remote_code_hf_dir)).build(seed=0).module
    recompute_activations(model)
    recipe = model_recipe(model)
    sent = sorted(name.rsplit("/", 1)[1] for name in recipe.code if not name.endswith("/__init__.py"))
    assert sent == ["configuration_tidal_test.py"] * 2 + ["modeling_tidal_test.py"]  # the model's folder, and the config's
    (tmp_path / "command.pkl").write_bytes(pickle.dumps({"op": "init", "model": recipe}))
    cache = tmp_path / "other-node-cache"
    out = subprocess.run(
        [sys.executable, "-c", FOLLOWER, str(tmp_path / "command.pkl")], env=child_env({"HF_MODULES_CACHE": str(cache)}), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])
    assert built == {
        "class": "TidalTestForCausalLM",
        "module": type(model).__module__,
        "config": "TidalTestConfig",
        "recompute": True,
        "dtype": "torch.float32",
        "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
    }
    assert sorted(p.name for p in cache.rglob("*_tidal_test.py")) == ["configuration_tidal_test.py"] * 2 + ["modeling_tidal_test.py"]


def test_a_built_in_model_carries_no_code(tiny_hf_dir):
    """transformers' own classes are imported from the installed package: nothing is sent."""
    model = HFSource(_section(tiny_hf_dir, trust_remote_code=False)).build(seed=0).module
    recipe = model_recipe(model)
    assert recipe.code == {}
    built = build_from_recipe(recipe)
    assert type(built) is type(model) and not recomputes_activations(built)


@pytest.mark.parametrize("name", ["../evil.py", "/tmp/evil.py", "elsewhere/evil.py", "transformers_modules/../../evil.py"])
def test_code_is_installed_only_under_the_dynamic_package(name, tmp_path):
    with pytest.raises(ValueError, match="is not under transformers_modules/"):
        remote_code.install({name: "x = 1\n"})
