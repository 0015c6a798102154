"""The tokenizer protocol and its Hugging Face adapter, on the locally built Qwen2 checkpoint (`tiny_hf_dir`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from tidal.engines.tiny import CharTokenizer
from tidal.engines.tokenizers import HFTokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir) -> HFTokenizer:
    return HFTokenizer.from_pretrained(tiny_hf_dir)


def test_the_checkpoint_loads_with_the_auto_classes(tiny_hf_dir):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    assert isinstance(model, transformers.Qwen2ForCausalLM)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size <= 64
    assert model.config.vocab_size == len(hf_tokenizer)
    assert (tiny_hf_dir / "model.safetensors").is_file()
    im_end, endoftext = hf_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert model.generation_config.eos_token_id == [im_end, endoftext]
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.pad_token == "<|endoftext|>"
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True)
    assert ids == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    logits = model(torch.tensor([hf_tokenizer.encode(ids, add_special_tokens=False)])).logits
    assert logits.shape[-1] == len(hf_tokenizer) and torch.isfinite(logits).all()


def test_hf_tokenizer_has_every_member_of_the_protocol(tokenizer, tiny_hf_dir):
    assert isinstance(tokenizer, Tokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    im_end, endoftext = hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizer.eos_ids == [im_end, endoftext]  # the tokenizer's own first, then generation_config.json's, once each
    assert tokenizer.pad_id == endoftext
    assert tokenizer.vocab_size == len(hf)


def test_encode_and_decode_give_the_text_back(tokenizer):
    text = "Tom has 1,234 apples and buys 56 more.\n#### 1,290  (twice  spaced)"
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    unseen = "Zoë's naïve café: ∑ 3² = 9"  # bytes the BPE never merged still round-trip
    assert tokenizer.decode(tokenizer.encode(unseen)) == unseen


def test_the_chat_template_renders_the_user_turn_and_the_assistant_header(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    ids = tokenizer.apply_chat_template(messages)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids, skip_special=False) == text
    assert tokenizer.render_chat(messages) == text
    assert ids.count(tokenizer.eos_ids[0]) == 2  # <|im_end|> is one special token, not its characters
    assert tokenizer.decode(ids) == "system\nBe brief.\nuser\nWhat is 2+3?\nassistant\n"


def test_without_a_generation_config_the_end_ids_are_the_tokenizer_s(tiny_hf_dir, tmp_path):
    folder = shutil.copytree(tiny_hf_dir, tmp_path / "ckpt")
    (folder / "generation_config.json").unlink()
    tokenizer = HFTokenizer.from_pretrained(folder)
    assert tokenizer.eos_ids == [transformers.AutoTokenizer.from_pretrained(folder).eos_token_id]


def test_pad_falls_back_to_the_first_end_id(tiny_hf_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    hf.pad_token = None
    tokenizer = HFTokenizer(hf, extra_eos_ids=[7])
    assert tokenizer.pad_id == hf.eos_token_id == tokenizer.eos_ids[0]
    assert tokenizer.eos_ids == [hf.eos_token_id, 7]


def test_a_tokenizer_with_no_end_token_is_refused(tiny_hf_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    hf.eos_token = None
    with pytest.raises(ValueError, match="no end token"):
        HFTokenizer(hf)


def test_a_tokenizer_without_a_chat_template_says_how_to_do_without(tiny_hf_dir, tmp_path):
    folder = shutil.copytree(tiny_hf_dir, tmp_path / "ckpt")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer.from_pretrained(folder)
    with pytest.raises(ValueError, match="no chat template.*chat_template=false"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere.*does not exist"):
        HFTokenizer.from_pretrained(tmp_path / "nowhere")


def test_the_character_tokenizer_agrees_with_the_protocol_where_it_has_the_members():
    """CharTokenizer (engines/tiny.py) has encode, decode, pad_id and vocab_size with the
    protocol's meaning; it has a single `eos_id` and no chat template (not checked here:
    wiring it to the protocol is another change)."""
    tokenizer = CharTokenizer()
    ids = tokenizer.encode("12+7=")
    assert ids[0] == tokenizer.bos_id and tokenizer.decode(ids) == "12+7="
    assert tokenizer.decode(ids, skip_special=False) == "<bos>12+7="
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert isinstance(tokenizer.pad_id, int)
