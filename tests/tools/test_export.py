"""`tidal export RUN_DIR OUT_DIR`: a run's checkpoint as a Hugging Face model directory that
transformers loads unchanged and that generates what the trainer's weights generate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tidal.engines.tasks import arithmetic
from tidal.engines.tiny import CharTokenizer
from tidal.tools import export as export_module
from tidal.tools.checkpoint import load_checkpoint
from tidal.tools.cli import main

SHORT = ["algorithm.num_steps=2", "sft.steps=2", "task.num_eval_prompts=10", "checkpoint_every=1", "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quickstart run of two RL steps with a checkpoint after each, through the real CLI."""
    from tests.conftest import run_tidal

    run = tmp_path_factory.mktemp("export") / "run"
    out = run_tidal("run", "quickstart_cpu", f"run_dir={run}", *SHORT)
    assert out.returncode == 0, out.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000002"
    return run


def _greedy(model: torch.nn.Module, prompts: list[list[int]], *, pad_id: int, eos_id: int) -> list[list[int]]:
    """Each prompt's greedy continuation (up to 8 tokens), one prompt at a time: no padding."""
    model.eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id)[0, len(ids) :].tolist() for ids in prompts]


def test_an_export_loads_with_transformers_and_generates_what_the_checkpoint_generates(run_dir, tmp_path, tidal_cli):
    out_dir = tmp_path / "hf"
    done = tidal_cli("export", str(run_dir), str(out_dir))
    assert done.returncode == 0, done.stderr
    assert "exported step-000002" in done.stdout
    assert {p.name for p in out_dir.iterdir()} == {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left beside it

    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    generation = json.loads((out_dir / "generation_config.json").read_text())
    _, trained, tokenizer, _, _ = load_checkpoint(run_dir / "checkpoints" / "step-000002", attention="eager")  # as `resume=` loads it
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (tokenizer.eos_id, tokenizer.pad_id)

    texts = [item["prompt"] for item in arithmetic(20, seed=5, min_value=0, max_value=9, ops="+-")]
    ids = [tokenizer.encode(text) for text in texts]
    assert [hf_tokenizer.encode(text) for text in texts] == ids
    assert [hf_tokenizer.decode(x, skip_special_tokens=True) for x in ids] == [tokenizer.decode(x) for x in ids] == texts
    exported = _greedy(model, ids, pad_id=generation["pad_token_id"], eos_id=generation["eos_token_id"])
    assert exported == _greedy(trained, ids, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
    assert any(exported)


def test_export_step_takes_that_checkpoint_and_force_replaces_an_export(run_dir, tmp_path, capsys):
    out_dir = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out_dir), "--step", "1"]) == 0
    weights = load_file(out_dir / "model.safetensors")
    first = load_file(run_dir / "checkpoints" / "step-000001" / "model.safetensors")
    assert weights.keys() == first.keys() and all(torch.equal(weights[k], first[k]) for k in weights)

    assert main(["export", str(run_dir), str(out_dir)]) == 2  # there is one there now
    assert f"tidal export: error: OUT_DIR {str(out_dir)!r} exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), str(out_dir), "--force"]) == 0
    assert (out_dir / "model.safetensors").read_bytes() == (run_dir / "checkpoints" / "step-000002" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    assert main(["export", str(run_dir), str(tmp_path / "other"), "--step", "7"]) == 2
    assert f"{str(run_dir)!r} has no checkpoint step-000007 (--step 7); it has step-000001, step-000002" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_export_refuses_a_run_without_a_checkpoint_and_a_folder_in_the_way(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")  # what `tidal run --check` leaves
    assert main(["export", str(run), str(tmp_path / "hf")]) == 2
    assert f"tidal export: error: {run} has no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["export", str(tmp_path / "nowhere"), str(busy)]) == 2
    assert "run directory" in capsys.readouterr().err and (busy / "notes.txt").read_text() == "mine"


def test_an_export_that_fails_leaves_nothing_and_a_replaced_one_as_it_was(run_dir, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "_write_generation_config", broken)  # the last file written
    with pytest.raises(OSError, match="No space left"):
        export_module.export(run_dir, tmp_path / "a" / "b" / "hf")
    assert list(tmp_path.iterdir()) == []  # neither the export nor the folders made for it

    kept = tmp_path / "hf"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    with pytest.raises(OSError, match="No space left"):
        export_module.export(run_dir, kept, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and [p.name for p in kept.iterdir()] == ["config.json"]


def test_an_older_checkpoints_tokenizer_is_exported_as_a_hugging_face_one(run_dir, tmp_path):
    """A checkpoint from before tidal saved Hugging Face tokenizers has its own tokenizer.json
    only: the export writes one AutoTokenizer loads, with the same ids."""
    old = tmp_path / "run"
    shutil.copytree(run_dir / "checkpoints" / "step-000002", old / "checkpoints" / "step-000002")
    (old / "checkpoints" / "latest").write_text("step-000002\n")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (old / "checkpoints" / "step-000002" / name).unlink()
    tokenizer = CharTokenizer()
    (old / "checkpoints" / "step-000002" / "tokenizer.json").write_text(json.dumps({"type": "tidal-char", "alphabet": tokenizer.alphabet, "specials": ["<pad>", "<bos>", "<eos>"]}))
    export_module.export(old, tmp_path / "hf")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").encode("4+5=") == tokenizer.encode("4+5=")


def test_a_custom_model_is_exported_with_its_code_when_the_run_trusted_it(remote_code_hf_dir, tmp_path, capsys):
    """A checkpoint of a `model.trust_remote_code` run keeps the model's code files (transformers
    saves them beside the weights): the export copies them and runs them to check the load,
    as the run did; told not to trust it, it refuses, naming the option, before loading."""
    run = tmp_path / "run"
    shutil.copytree(remote_code_hf_dir, run / "checkpoints" / "step-000001")
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    (run / "config.yaml").write_text("model:\n  trust_remote_code: true\n")
    export_module.export(run, tmp_path / "hf")
    assert {"configuration_tidal_test.py", "modeling_tidal_test.py"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)).__name__ == "TidalTestForCausalLM"

    (run / "config.yaml").write_text("model:\n  trust_remote_code: false\n")
    assert main(["export", str(run), str(tmp_path / "hf2")]) == 2
    err = capsys.readouterr().err
    assert "auto_map: AutoConfig: configuration_tidal_test.TidalTestConfig" in err and "pass --trust-remote-code" in err
    assert not (tmp_path / "hf2").exists()
    assert main(["export", str(run), str(tmp_path / "hf2"), "--trust-remote-code"]) == 0
    for garbled in ("model: [unclosed\n", "- a list\n", "model: 3\n"):  # not the run's say: untrusted
        (run / "config.yaml").write_text(garbled)
        assert main(["export", str(run), str(tmp_path / "hf4")]) == 2
        assert "pass --trust-remote-code" in capsys.readouterr().err
    (run / "config.yaml").write_text("model:\n  trust_remote_code: true\n")
    assert main(["export", str(run), str(tmp_path / "hf3"), "--no-trust-remote-code"]) == 2
    assert "pass --trust-remote-code" in capsys.readouterr().err


def test_the_help_documents_export(tidal_cli):
    assert "export" in tidal_cli("--help").stdout
    text = " ".join(tidal_cli("export", "--help").stdout.split())
    for words in ("RUN_DIR", "OUT_DIR", "--step N", "--force", "AutoModelForCausalLM.from_pretrained(OUT_DIR)", "generation_config.json", "exits with 2", "--trust-remote-code"):
        assert words in text, words
