"""What each engine needs to run (`engines.registry.NEEDS`): `tidal doctor`'s engine rows, and
`tidal run` refusing, before its run directory, a local run whose engine cannot run here."""

from __future__ import annotations

import pytest

from tidal.engines import registry


def _installed(monkeypatch, *names: str) -> None:
    monkeypatch.setattr(registry, "version", lambda name: "1.0" if name in names else None)


def test_an_engine_with_nothing_more_to_need_runs_everywhere(monkeypatch):
    _installed(monkeypatch)
    for kind in ("cpu", "cuda", "npu"):
        assert registry.missing("rollout.backend", "hf", kind=kind) is None
        assert registry.missing("train.backend", "fsdp", kind=kind, fake=True) is None


def test_vllm_needs_its_package_a_device_and_on_npus_the_ascend_plugin(monkeypatch):
    _installed(monkeypatch)
    assert registry.missing("rollout.backend", "vllm", kind="cuda") == "rollout.backend=vllm needs vllm, not installed here (pip install 'tidal-rl[vllm]')"
    assert registry.missing("rollout.backend", "vllm", kind="cpu") == "rollout.backend=vllm runs on cuda or npu devices, not on a cpu platform"
    assert "not on a fake cuda platform, which computes on CPU" in registry.missing("rollout.backend", "vllm", kind="cuda", fake=True)
    _installed(monkeypatch, "vllm")
    assert registry.missing("rollout.backend", "vllm", kind="cuda") is None
    assert registry.missing("rollout.backend", "vllm", kind="npu") == "rollout.backend=vllm needs vllm-ascend, not installed here"
    _installed(monkeypatch, "vllm", "vllm-ascend")
    assert registry.missing("rollout.backend", "vllm", kind="npu") is None


def test_megatron_needs_megatron_core_and_on_real_npus_mindspeed(monkeypatch):
    _installed(monkeypatch, "megatron-core")
    assert registry.missing("train.backend", "megatron", kind="cpu") is None
    assert registry.missing("train.backend", "megatron", kind="npu", fake=True) is None  # a fake NPU computes on CPU: hal patches megatron for it
    assert registry.missing("train.backend", "megatron", kind="npu") == "train.backend=megatron needs mindspeed, not installed here"


def test_megatron_trains_in_fp32_only_where_it_computes_on_the_host(monkeypatch):
    """hal.megatron.check_precision refuses it when the engine is built, after the untrained
    evaluation; the registry says it before the run directory (and `tidal run --check`)."""
    _installed(monkeypatch, "megatron-core", "deepspeed")
    want = "train.precision=bf16: train.backend=megatron trains in fp32 on a fake cuda platform, which computes on CPU; set train.precision=fp32"
    assert registry.missing("train.backend", "megatron", kind="cuda", fake=True, precision="bf16") == want
    assert "on a cpu platform" in registry.missing("train.backend", "megatron", kind="cpu", precision="bf16")
    assert registry.missing("train.backend", "megatron", kind="cuda", fake=True, precision="fp32") is None
    assert registry.missing("train.backend", "megatron", kind="cuda", precision="bf16") is None  # on the device: megatron's own autocast
    assert registry.missing("train.backend", "deepspeed", kind="cpu", precision="bf16") is None


def test_deepspeed_needs_its_package_on_every_kind(monkeypatch):
    _installed(monkeypatch)
    assert registry.missing("train.backend", "deepspeed", kind="cpu") == "train.backend=deepspeed needs deepspeed, not installed here (pip install 'tidal-rl[deepspeed]')"
    _installed(monkeypatch, "deepspeed")
    assert registry.missing("train.backend", "deepspeed", kind="npu") is None


def test_every_needs_entry_names_a_registered_engine():
    for key, name in registry.NEEDS:
        assert name in registry.REGISTRIES[key], (key, name)


def test_doctor_lists_every_engine_with_its_packages_and_whether_it_runs_here(monkeypatch):
    from tidal.tools.doctor import engines

    _installed(monkeypatch, "deepspeed")
    rows = {(r["key"], r["engine"]): r for r in engines(kind="cpu", fake=False)}
    assert set(rows) == {(key, name) for key in ("rollout.backend", "train.backend") for name in registry.REGISTRIES[key]}
    assert rows["train.backend", "deepspeed"]["packages"] == {"deepspeed": "1.0"} and rows["train.backend", "deepspeed"]["usable"]
    assert rows["rollout.backend", "hf"] == {"key": "rollout.backend", "engine": "hf", "packages": {}, "usable": True, "why": "runs on cpu"}
    if ("rollout.backend", "vllm") in rows:
        vllm = rows["rollout.backend", "vllm"]
        assert vllm["packages"] == {"vllm": "not installed", "vllm-ascend": "not installed"} and not vllm["usable"]
    assert all(not r["usable"] and r["why"] == "no platform could load" for r in engines(kind=None, fake=False))


def test_doctor_json_has_the_engine_rows(tidal_cli, tmp_path):
    import json

    out = tidal_cli("doctor", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["engines"]
    assert {"key": "rollout.backend", "engine": "hf", "packages": {}, "usable": True, "why": "runs on cpu"} in rows


def test_a_local_run_whose_engine_cannot_run_here_is_refused_before_its_run_directory(monkeypatch, tmp_path):
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    _installed(monkeypatch)
    with pytest.raises(ConfigError, match=r"train\.backend=deepspeed needs deepspeed, not installed here"):
        prepare_run(resolve_recipe("quickstart_cpu"), ["train.backend=deepspeed", f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    _installed(monkeypatch, "megatron-core")
    with pytest.raises(ConfigError, match=r"train\.precision=bf16: train\.backend=megatron trains in fp32 on a cpu platform"):
        prepare_run(resolve_recipe("quickstart_cpu"), ["train.backend=megatron", "train.precision=bf16", f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_a_run_with_lora_adapters_needs_peft(monkeypatch, tmp_path):
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    _installed(monkeypatch)
    with pytest.raises(ConfigError, match=r"train\.lora_rank=8 needs peft, not installed here \(pip install 'tidal-rl\[lora\]'\)"):
        prepare_run(resolve_recipe("quickstart_cpu"), ["train.lora_rank=8", f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_a_ray_run_on_a_ray_of_its_own_is_refused_before_its_run_directory_on_each_roles_kind(monkeypatch, tmp_path):
    """A Ray run that starts its own Ray puts every actor on this machine: its engines are
    checked here, each role on the device kinds its plan gives it. A fake cluster's devices
    compute on CPU: `--check` there checks the config and the plan, as the production
    recipes' do (tests/tools/test_production_recipes.py)."""
    from tidal.tools.config import ConfigError
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _installed(monkeypatch, "megatron-core")
    ray_run = ["runtime=ray", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"train\.precision=bf16: train\.backend=megatron trains in fp32 on a cpu platform"):
        prepare_run(resolve_recipe("quickstart_cpu"), [*ray_run, "train.backend=megatron", "train.precision=bf16"])
    assert not (tmp_path / "run").exists()
    gpu_box = ["cluster.nodes=[{name: box, kind: cuda, devices: 2}]", "placement.train.count=1", "placement.rollout.count=1"]
    with pytest.raises(ConfigError, match=r"train\.backend=deepspeed needs deepspeed, not installed here"):
        prepare_run(resolve_recipe("quickstart_cpu"), [*ray_run, *gpu_box, "train.backend=deepspeed"])
    assert not (tmp_path / "run").exists()
    cfg, _ = prepare_run(resolve_recipe("quickstart_cpu"), [*ray_run, *gpu_box, "cluster.fake=true", "train.backend=deepspeed"])
    assert cfg.train.backend == "deepspeed"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster it joins: its nodes' probes check (tools.cluster)
    cfg, _ = prepare_run(resolve_recipe("quickstart_cpu"), ["runtime=ray", f"run_dir={tmp_path / 'joined'}", *gpu_box, "train.backend=deepspeed"])
    assert cfg.train.backend == "deepspeed"
