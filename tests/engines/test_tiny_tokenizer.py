"""The character tokenizer as a Hugging Face one: `hf_tokenizer` has its ids, and what
`CharTokenizer.save` writes (checkpoints, `save_model`) loads with `AutoTokenizer` and
back into `CharTokenizer`, as does the format older checkpoints hold."""

from __future__ import annotations

import json

import pytest
import transformers

from tidal.engines.tasks import arithmetic, countdown
from tidal.engines.tiny import DEFAULT_ALPHABET, CharTokenizer, build_tiny_qwen2, hf_tokenizer, save_model

TEXTS = ["3 5 7>22: (3 + 5) * 7", "  two  spaces ", "a.b?c,d:e=(f)", "12+7=?"]


def test_hf_tokenizer_has_the_char_tokenizers_ids_both_ways():
    tokenizer = CharTokenizer()
    hf = hf_tokenizer(tokenizer)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (0, 1, 2, tokenizer.vocab_size)
    texts = [item["prompt"] for item in arithmetic(200, seed=0, min_value=-20, max_value=99, ops="+-*") + countdown(100, seed=1)] + TEXTS
    encoded = hf(text=texts)["input_ids"]  # how GRPOTrainer tokenizes plain-text prompts
    assert encoded == [tokenizer.encode(t) for t in texts]
    completions = [ids[1:] + [tokenizer.eos_id, tokenizer.pad_id] for ids in encoded]
    assert hf.batch_decode(completions, skip_special_tokens=True) == [tokenizer.decode(ids) for ids in completions] == texts


def test_hf_tokenizer_rejects_a_character_outside_the_alphabet():
    with pytest.raises(Exception, match="UNK|unk"):
        hf_tokenizer(CharTokenizer())("é")


def test_a_saved_tokenizer_loads_with_auto_tokenizer_with_the_same_ids(tmp_path):
    """The saved tokenizer.json was tidal's own format, and AutoTokenizer failed on it with
    `KeyError: 'added_tokens'`."""
    tokenizer = CharTokenizer()
    tokenizer.save(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in tmp_path.iterdir()}
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.pad_token, hf.bos_token, hf.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (0, 1, 2, tokenizer.vocab_size)
    for text in TEXTS:
        ids = hf.encode(text)
        assert ids == tokenizer.encode(text)
        assert hf.decode([*ids, tokenizer.eos_id], skip_special_tokens=True) == tokenizer.decode([*ids, tokenizer.eos_id]) == text
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"  # a name transformers 4 knows too


@pytest.mark.parametrize("alphabet", [DEFAULT_ALPHABET, "ba9 ."])
def test_char_tokenizer_loads_what_it_saves_and_what_older_tidal_saved(tmp_path, alphabet):
    CharTokenizer(alphabet).save(tmp_path / "new")
    assert "added_tokens" in json.loads((tmp_path / "new" / "tokenizer.json").read_text())  # the Hugging Face format
    assert CharTokenizer.load(tmp_path / "new").alphabet == alphabet
    old = tmp_path / "old"  # what checkpoints held before: resuming one still works
    old.mkdir()
    (old / "tokenizer.json").write_text(json.dumps({"type": "tidal-char", "alphabet": alphabet, "specials": ["<pad>", "<bos>", "<eos>"]}))
    assert CharTokenizer.load(old).alphabet == alphabet


def test_char_tokenizer_load_names_a_tokenizer_json_that_is_no_character_tokenizer(tmp_path):
    hf_tokenizer(CharTokenizer("ab")).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["model"]["vocab"]["ab"] = len(data["model"]["vocab"])
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'tokenizer.json'} is not a tidal character tokenizer: token 'ab' is more than one character"):
        CharTokenizer.load(tmp_path)


def test_a_saved_model_loads_with_the_auto_classes(tmp_path):
    """The run's initial model (`save_model`) is a Hugging Face directory: weights, config,
    generation config and tokenizer."""
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
    save_model(model, tokenizer, tmp_path / "initial")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "initial").encode("1+2=") == tokenizer.encode("1+2=")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "initial")
    assert (loaded.generation_config.eos_token_id, loaded.generation_config.pad_token_id) == (tokenizer.eos_id, tokenizer.pad_id)
    assert not (tmp_path / "initial" / ".partial").exists()
