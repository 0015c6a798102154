"""Prompt datasets from local files (`tidal.engines.data`), on GSM8K-format files and the local Qwen2 tokenizer."""

from __future__ import annotations

import itertools
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tidal.engines.data import DataConfig, DataError, PromptStream, load_prompts
from tidal.engines.tiny import CharTokenizer
from tidal.engines.tokenizers import HFTokenizer
from tidal.flow.rollout import group_of
from tidal.flow.store import codec


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir) -> HFTokenizer:
    return HFTokenizer.from_pretrained(tiny_hf_dir)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """datasets' Arrow copies go here, not into the user's cache."""
    return str(tmp_path_factory.mktemp("datasets-cache"))


@pytest.fixture(scope="module")
def load(tokenizer, cache_dir):
    def load_(files, keep_messages=True, **settings):
        config = DataConfig(**{"max_prompt_tokens": 10_000, **settings})
        return load_prompts([str(f) for f in files], tokenizer, config=config, cache_dir=cache_dir, keep_messages=keep_messages)

    return load_


def rows_of(path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_reads_jsonl_and_parquet_in_file_order_with_the_chat_template(load, tokenizer, gsm8k_files):
    files = [gsm8k_files["train_jsonl"], gsm8k_files["train_parquet"]]
    prompts = load(files)
    expected = [(f, k, row) for f in files for k, row in enumerate(rows_of(f))]
    assert len(prompts) == len(expected) == 80 and prompts.num_dropped == 0
    for item, (path, k, row) in zip(prompts, expected):
        assert set(item) == {"prompt", "prompt_ids", "messages", "answer", "meta"}
        assert item["meta"] == {"file": str(path), "row": k}
        assert item["messages"] == [{"role": "user", "content": row["question"]}]  # what the template rendered: a reward model renders it in its own
        assert item["answer"] == row["answer"]
        assert item["prompt_ids"] == tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}])
        assert item["prompt"] == f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n"


def test_items_carry_the_conversation_only_when_asked(load, gsm8k_files):
    """`messages` is for a reward model; without one each sample row is lighter by it."""
    assert "messages" not in load([gsm8k_files["eval_jsonl"]], keep_messages=False)[0]


def test_a_system_prompt_comes_first(load, gsm8k_files):
    item = load([gsm8k_files["eval_jsonl"]], system_prompt="Answer after ####.")[0]
    assert item["messages"][0] == {"role": "system", "content": "Answer after ####."} and item["messages"][1]["role"] == "user"
    assert item["prompt"].startswith("<|im_start|>system\nAnswer after ####.<|im_end|>\n<|im_start|>user\n")


THINKING_TEMPLATE = (  # Qwen3's switch, as its template writes it: an empty thought when thinking is off
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tiny_hf_dir, gsm8k_files, cache_dir):
    tokenizer = HFTokenizer.from_pretrained(tiny_hf_dir)
    tokenizer.tokenizer.chat_template = THINKING_TEMPLATE
    files = [str(gsm8k_files["eval_jsonl"])]
    thinking, plain = (load_prompts(files, tokenizer, config=DataConfig(chat_template_kwargs=kwargs), cache_dir=cache_dir)[0] for kwargs in ({}, {"enable_thinking": False}))
    assert thinking["prompt"].endswith("<|im_start|>assistant\n")
    assert plain["prompt"] == thinking["prompt"] + "<think>\n\n</think>\n\n"
    assert plain["prompt_ids"] == tokenizer.encode(plain["prompt"], add_bos=False) and plain["prompt_ids"] != thinking["prompt_ids"]


def test_without_the_chat_template_the_model_reads_the_raw_text(load, tokenizer, gsm8k_files):
    row = rows_of(gsm8k_files["eval_parquet"])[0]
    item = load([gsm8k_files["eval_parquet"]], chat_template=False)[0]
    assert item["prompt"] == row["question"] and item["prompt_ids"] == tokenizer.encode(row["question"])
    assert "messages" not in item  # the prompt text is all there is


def test_a_json_file_holding_a_list_of_objects_is_read(load, tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"question": "What is 1+1?", "answer": 2}, {"question": "And 2+2?", "answer": 4}]))
    assert [item["answer"] for item in load([path])] == [2, 4]


def test_glob_patterns_are_expanded_sorted(load, tmp_path):
    for name in ("b", "a"):
        (tmp_path / f"part-{name}.jsonl").write_text(json.dumps({"question": f"q {name}", "answer": "1"}) + "\n")
    prompts = load([str(tmp_path / "part-*.jsonl")], chat_template=False)
    assert [item["prompt"] for item in prompts] == ["q a", "q b"]


def test_long_prompts_are_dropped_counted_and_logged(load, tokenizer, gsm8k_files, caplog):
    path = gsm8k_files["train_jsonl"]
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}])) for r in rows_of(path)]
    limit = sorted(lengths)[len(lengths) // 2]  # about half are longer (the long preambles and then some)
    with caplog.at_level(logging.WARNING, logger="tidal.engines.data"):
        prompts = load([path], max_prompt_tokens=limit)
    num_long = sum(n > limit for n in lengths)
    assert 0 < num_long < len(lengths)
    assert prompts.num_dropped == num_long and len(prompts) == len(lengths) - num_long
    assert all(len(item["prompt_ids"]) <= limit for item in prompts)
    assert [item["meta"]["row"] for item in prompts] == [k for k, n in enumerate(lengths) if n <= limit]
    assert f"dropped {num_long} of {len(lengths)} prompts longer than data.max_prompt_tokens={limit}" in caplog.text


def test_no_prompt_short_enough_is_an_error(load, gsm8k_files):
    with pytest.raises(DataError, match=r"none of the 10 prompts fits data.max_prompt_tokens=3 \(the longest has \d+ tokens\)"):
        load([gsm8k_files["eval_jsonl"]], max_prompt_tokens=3)


def take(stream, n):
    return [(item["meta"]["file"], item["meta"]["row"]) for item in itertools.islice(stream, n)]


def test_shuffling_is_deterministic_by_seed_and_each_epoch_visits_every_prompt_once(load, gsm8k_files):
    prompts = load([gsm8k_files["train_jsonl"], gsm8k_files["train_parquet"]])
    n = len(prompts)
    first = take(PromptStream(prompts, seed=3), 2 * n)
    assert first == take(PromptStream(prompts, seed=3), 2 * n)
    assert first != take(PromptStream(prompts, seed=4), 2 * n)
    every = sorted((item["meta"]["file"], item["meta"]["row"]) for item in prompts)
    assert sorted(first[:n]) == every == sorted(first[n:])
    assert first[:n] != first[n:]  # a new order each epoch
    assert first[:n] != every
    assert take(PromptStream(prompts, shuffle=False), n) == [(item["meta"]["file"], item["meta"]["row"]) for item in prompts]


def test_a_stream_resumes_exactly_where_its_state_was_saved(load, gsm8k_files):
    prompts = load([gsm8k_files["train_jsonl"], gsm8k_files["train_parquet"]])
    n = len(prompts)
    for consumed in (0, 7, n, 2 * n + 5):  # from the start, mid-epoch, at an epoch boundary, in a later epoch
        stream = PromptStream(prompts, seed=11)
        head = take(stream, consumed)
        state = json.loads(json.dumps(stream.state_dict()))  # as a checkpoint stores it
        rest = take(stream, 12)
        resumed = PromptStream(prompts, seed=11)
        resumed.load_state_dict(state)
        assert resumed.epoch == consumed // n
        assert take(resumed, 12) == rest
        assert head + rest == take(PromptStream(prompts, seed=11), consumed + 12)


def test_a_position_saved_over_other_prompts_or_another_seed_is_refused(load, gsm8k_files):
    prompts = load([gsm8k_files["train_jsonl"]])
    state = PromptStream(prompts, seed=0).state_dict()
    with pytest.raises(DataError, match="seed=0.*seed=1"):
        PromptStream(prompts, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="num_prompts=40.*num_prompts=80"):
        PromptStream(load([gsm8k_files["train_jsonl"], gsm8k_files["train_parquet"]]), seed=0).load_state_dict(state)


def test_a_stream_ends_after_its_epochs(load, gsm8k_files):
    prompts = load([gsm8k_files["eval_jsonl"]])
    stream = PromptStream.from_config(prompts, DataConfig(num_epochs=2, seed=5))
    assert len(list(stream)) == 2 * len(prompts) and list(stream) == []


def test_the_character_tokenizer_reads_raw_prompts(cache_dir, tmp_path):
    """The tiny model's tokenizer has no chat template: with `chat_template=false` it encodes the text (after its <bos>)."""
    path = write_jsonl(tmp_path / "sums.jsonl", [{"question": "12+7=", "answer": "19"}])
    tokenizer = CharTokenizer()
    (item,) = load_prompts([str(path)], tokenizer, config=DataConfig(chat_template=False), cache_dir=cache_dir)
    assert item["prompt_ids"] == tokenizer.encode("12+7=") and item["prompt"] == "12+7=" and item["answer"] == "19"


def test_items_travel_through_the_store_and_become_trajectories(load, gsm8k_files):
    item = load([gsm8k_files["eval_jsonl"]])[0]
    header, buffers = codec.encode(item)
    assert codec.decode(header, buffers) == item
    trajectories = group_of(0, item, 2)
    assert [t.prompt_ids for t in trajectories] == [item["prompt_ids"]] * 2
    assert trajectories[0].meta["answer"] == item["answer"]


def test_a_folder_save_to_disk_wrote_and_its_arrow_file_are_read(load, gsm8k_files, tmp_path):
    import datasets

    rows = rows_of(gsm8k_files["eval_jsonl"])
    saved = datasets.Dataset.from_list(rows)
    saved.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    for source in (tmp_path / "saved", arrow):
        prompts = load([source])
        assert [item["answer"] for item in prompts] == [row["answer"] for row in rows]
        assert [item["meta"] for item in prompts] == [{"file": str(source), "row": k} for k in range(len(rows))]


def test_a_dataset_dict_folder_names_its_splits(load, gsm8k_files, tmp_path):
    import datasets

    one = datasets.Dataset.from_list(rows_of(gsm8k_files["eval_jsonl"]))
    datasets.DatasetDict(train=one, test=one).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd' holds a DatasetDict \(several splits\); name one split's folder: '.*dd/test', '.*dd/train'"):
        load([tmp_path / "dd"])
    assert len(load([tmp_path / "dd" / "train"])) == len(one)


# bad input: each error names the file, the column and the row


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_missing_file_is_named(load, tmp_path):
    with pytest.raises(DataError, match="data.train_files: '.*nope.jsonl' does not exist"):
        load([tmp_path / "nope.jsonl"])


def test_an_unsupported_suffix_is_named(load, tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("question,answer\nq,1\n")
    with pytest.raises(DataError, match=r"prompts.csv' has suffix '.csv'; readable: .jsonl, .json, .parquet, .arrow, or a folder Dataset.save_to_disk wrote"):
        load([path])


def test_a_folder_or_an_unmatched_pattern_is_named(load, tmp_path):
    with pytest.raises(DataError, match=r"is a folder, and not one Dataset.save_to_disk wrote .*a pattern such as '.*\*.parquet'"):
        load([tmp_path])
    with pytest.raises(DataError, match=r"'.*\*.parquet' matches no file"):
        load([str(tmp_path / "*.parquet")])
    with pytest.raises(DataError, match="lists no file"):
        load([])


def test_a_missing_column_lists_the_columns_there_are(load, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "1+1?", "solution": "2"}])
    with pytest.raises(DataError, match=r"p.jsonl: no column 'question' \(data.prompt_key\); its columns: \['problem', 'solution'\]"):
        load([path])
    with pytest.raises(DataError, match=r"no column 'answer' \(data.answer_key\)"):
        load([path], prompt_key="problem")
    assert load([path], prompt_key="problem", answer_key="solution")[0]["answer"] == "2"
    assert "answer" not in load([path], prompt_key="problem", answer_key=None)[0]


def test_an_empty_file_or_dataset_is_named(load, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl: the file is empty"):
        load([empty])
    no_rows = tmp_path / "none.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), no_rows)
    with pytest.raises(DataError, match="none.parquet: no rows"):
        load([no_rows])


def test_a_prompt_that_is_not_text_names_its_row_and_type(load, tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"question": "fine", "answer": "1"}, {"question": "fine", "answer": "2"}, {"question": 17, "answer": "3"}])
    with pytest.raises(DataError, match=r"mixed.jsonl: row 2, column 'question': the prompt is int 17, not text"):
        load([path])
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"question": ["fine", None], "answer": ["1", "2"]}), nulls)
    with pytest.raises(DataError, match=r"nulls.parquet: row 1, column 'question': the prompt is NoneType None, not text"):
        load([nulls])
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"question": "  ", "answer": "1"}])
    with pytest.raises(DataError, match=r"blank.jsonl: row 0, column 'question': the prompt is empty"):
        load([blank])


def test_a_null_answer_names_its_row(load, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "1"}, {"question": "q", "answer": None}])
    with pytest.raises(DataError, match=r"a.jsonl: row 1, column 'answer': the answer is null"):
        load([path])


def test_a_line_that_is_not_json_names_the_file_and_row(load, tmp_path):
    path = write_jsonl(tmp_path / "broken.jsonl", [{"question": "q", "answer": "1"}, '{"question": '])
    with pytest.raises(DataError, match=r"broken.jsonl: cannot be read as json: .*row 1"):
        load([path])


def test_a_file_that_is_not_parquet_is_named(load, tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet at all")
    with pytest.raises(DataError, match="fake.parquet: cannot be read as parquet"):
        load([path])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_prompt_tokens": 0}, "data.max_prompt_tokens must be >= 1"),
        ({"num_epochs": 0}, "data.num_epochs must be >= 1 or null"),
        ({"answer_key": "question"}, "data.answer_key and data.prompt_key are both 'question'"),
        ({"prompt_key": ""}, "data.prompt_key must name a column"),
        ({"system_prompt": "hi", "chat_template": False}, "data.system_prompt needs data.chat_template=true"),
        ({"chat_template_kwargs": {"enable_thinking": False}, "chat_template": False}, "data.chat_template_kwargs needs data.chat_template=true"),
        ({"chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False}}, "data.chat_template_kwargs: add_generation_prompt, tokenize are set by tidal itself"),
    ],
)
def test_bad_settings_name_their_key(load, gsm8k_files, settings, message):
    with pytest.raises(DataError, match=message):
        load([gsm8k_files["eval_jsonl"]], **settings)


def test_data_errors_are_value_errors():
    assert issubclass(DataError, ValueError)


# --- verl's preprocessed files: a conversation in `prompt`, the answer in `reward_model.ground_truth` ---


def _verl_rows(gsm8k_files) -> list[dict]:
    """GSM8K rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for k, row in enumerate(rows_of(gsm8k_files["eval_jsonl"])):
        solution = row["answer"].rpartition("####")[2].strip().replace(",", "")
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": row["question"] + ' Let\'s think step by step and output the final answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": "test", "index": k, "answer": row["answer"], "question": row["question"]},
        })  # fmt: skip
    return rows


@pytest.fixture
def verl_file(tmp_path, gsm8k_files):
    path = tmp_path / "verl-gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(gsm8k_files)), path)
    return path


VERL = {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth"}


def test_verls_preprocessed_files_are_read_as_they_are(load, tokenizer, verl_file, gsm8k_files):
    """A conversation in the prompt column is rendered with the chat template as it is; a
    dotted answer_key reads a field of a struct column."""
    rows = _verl_rows(gsm8k_files)
    prompts = load([verl_file], **VERL)
    assert len(prompts) == len(rows) == 10
    for item, row in zip(prompts, rows):
        assert item["prompt_ids"] == tokenizer.apply_chat_template(row["prompt"]) and item["messages"] == list(row["prompt"])
        assert item["prompt"] == f"<|im_start|>user\n{row['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
        assert item["answer"] == row["reward_model"]["ground_truth"] and item["answer"].isdigit()
    nested = load([verl_file], prompt_key="extra_info.question", answer_key="extra_info.answer")  # two fields of one struct column
    assert [item["answer"] for item in nested] == [row["extra_info"]["answer"] for row in rows]
    with_system = load([verl_file], **VERL, system_prompt="Be brief.")[0]
    assert with_system["prompt_ids"] == tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *rows[0]["prompt"]])


@pytest.mark.parametrize(
    ("change", "settings", "message"),
    [
        (lambda r: r, {"answer_key": "reward_model.truth"}, r"no field 'truth' in column 'reward_model' \(data.answer_key='reward_model.truth'\); its fields: \['ground_truth', 'style'\]"),
        (lambda r: r, {"answer_key": "ability.level"}, r"no field 'level' in column 'ability' \(data.answer_key='ability.level'\); its fields: none \(not a struct\)"),
        (lambda r: r, {"chat_template": False}, r"row 0, column 'prompt': the prompt is a conversation, which only a chat template renders: set data.chat_template=true"),
        (lambda r: {**r, "prompt": [{"role": "system", "content": "x"}, *r["prompt"]]}, {"system_prompt": "y"}, r"row 0, column 'prompt': the conversation has a system turn of its own, and data.system_prompt is set too"),
        (lambda r: {**r, "prompt": [{"role": "user", "content": None}]}, {}, r"row 0, column 'prompt': message 0 of the conversation is \{'role': 'user', 'content': None\}, not \{role: text, content: text\}"),
        (lambda r: {**r, "prompt": []}, {}, r"row 0, column 'prompt': the prompt is list \[\], not text nor a conversation"),
    ],
    ids=["missing-field", "not-a-struct", "no-template", "two-system-turns", "bad-message", "empty-conversation"],
)
def test_a_conversation_or_field_that_cannot_be_read_is_named(load, tmp_path, gsm8k_files, change, settings, message):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([change(r) for r in _verl_rows(gsm8k_files)][:1] + _verl_rows(gsm8k_files)[1:]), path)
    with pytest.raises(DataError, match=message):
        load([path], **{**VERL, **settings})


def test_reading_reports_progress_over_every_files_rows(tokenizer, cache_dir, tmp_path, monkeypatch):
    """`on_progress(rows checked, rows)`: at 0 once the files are read, every PROGRESS_EVERY
    rows while prompts are measured (dropped ones count), and at the end."""
    from tidal.engines import data

    monkeypatch.setattr(data, "PROGRESS_EVERY", 4)
    paths = []
    for f, n in enumerate((7, 6)):
        paths.append(tmp_path / f"part-{f}.jsonl")
        paths[-1].write_text("".join(json.dumps({"question": "x" * (3 if k else 300), "answer": "#### 1"}) + "\n" for k in range(n)))
    calls = []
    prompts = load_prompts([str(p) for p in paths], tokenizer, config=DataConfig(chat_template=False, max_prompt_tokens=100), cache_dir=cache_dir, on_progress=lambda done, total: calls.append((done, total)))
    assert len(prompts) == 11  # the first row of each file is too long
    assert calls == [(0, 13), (4, 13), (8, 13), (12, 13), (13, 13)]
