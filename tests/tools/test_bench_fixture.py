"""The locally built checkpoint of `tidal bench e2e --workload longtail`."""

from __future__ import annotations

from safetensors.torch import load_file

from tidal.tools.bench.fixture import build_tiny_hf_checkpoint, longtail_workload


def test_longtail_workload_scales_the_end_token_row_is_deterministic_and_is_built_once(tmp_path):
    import json

    files = longtail_workload(tmp_path / "cache")
    assert files == {"model": tmp_path / "cache" / "model", "train": tmp_path / "cache" / "train.jsonl"}
    assert len(files["train"].read_text().splitlines()) == 64
    end_id = json.loads((files["model"] / "config.json").read_text())["eos_token_id"]
    scaled = load_file(files["model"] / "model.safetensors")["model.embed_tokens.weight"]
    plain = load_file(build_tiny_hf_checkpoint(tmp_path / "plain") / "model.safetensors")["model.embed_tokens.weight"]
    assert scaled[end_id].allclose(12.0 * plain[end_id]) and scaled[end_id + 1].equal(plain[end_id + 1])  # only the end token's row

    stamp = (files["model"] / "model.safetensors").stat().st_mtime_ns
    assert longtail_workload(tmp_path / "cache") == files and (files["model"] / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    again = longtail_workload(tmp_path / "other")
    assert (again["model"] / "model.safetensors").read_bytes() == (files["model"] / "model.safetensors").read_bytes()
    assert again["train"].read_text() == files["train"].read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left behind
