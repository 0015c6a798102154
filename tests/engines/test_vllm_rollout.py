"""The `vllm` rollout adapter's contract, on CPU, against `fake_vllm` (a fake vLLM 0.32.0 whose
signatures are checked against the snapshot of the real ones, `vllm_api_0.32.0.json`, in
test_vllm_api.py; the `fake_vllm` fixture is tests/conftest.py's).

Generation, partial rollout, continuous batching, weight updates with their checks, sleep
mode and shutdown, as `RolloutEngine` and `HFRolloutEngine` define them; every behavior
logprob is compared with a plain transformers forward pass over the same weights at the
sampling temperature."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from typing import Any

import pytest
import torch

NO_END = [10_000]
"""An end id outside the vocabulary: rows end by their budget."""


def test_the_module_imports_without_vllm_and_the_constructor_names_what_is_missing(tiny_hf_dir):
    import subprocess

    check = "import sys, tidal.engines.vllm_rollout, tidal.engines.vllm_worker; assert not any(m.split('.')[0] == 'vllm' for m in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if importlib.util.find_spec("vllm") is None:
        from tidal.engines.vllm_rollout import VLLMRolloutEngine

        with pytest.raises(ImportError, match="vLLM"):
            VLLMRolloutEngine(tiny_hf_dir, eos_id=NO_END, pad_id=0)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"temperature": 3.0}, "temperature"), ({"temperature": 0.001}, "temperature"), ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"), ({"enforce_eager": "yes"}, "enforce_eager"), ({"dtype": "int8"}, "dtype"),
        ({"eos_id": []}, "eos_id"), ({"version": -2}, "version"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_naming_them(tiny_hf_dir, kwargs, key):
    from tidal.engines.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match=key):
        VLLMRolloutEngine(tiny_hf_dir, **{"eos_id": NO_END, "pad_id": 0, **kwargs})


def test_a_folder_without_a_checkpoint_is_refused(tmp_path):
    from tidal.engines.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match="model_path"):
        VLLMRolloutEngine(tmp_path, eos_id=NO_END, pad_id=0)


# --- engines and references -------------------------------------------------------------------


@pytest.fixture
def make_engine(fake_vllm, tiny_hf_dir):
    """`make_engine(**kwargs)`: a `VLLMRolloutEngine` on the tiny checkpoint and the fake, and
    the fake `AsyncLLM` it built; all closed after the test."""
    from tidal.engines.vllm_rollout import VLLMRolloutEngine

    built = []

    def make(**kwargs: Any) -> tuple[Any, Any]:
        engine = VLLMRolloutEngine(tiny_hf_dir, **{"eos_id": NO_END, "pad_id": 0, "chunk_tokens": 2, **kwargs})
        built.append(engine)
        return engine, sys.modules["vllm.v1.engine.async_llm"].INSTANCES[-1]

    yield make
    for engine in built:
        engine.close()


@pytest.fixture
def reference(tiny_hf_dir):
    """The checkpoint as a transformers model (float32), the fake's weights at start."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of `model` with every weight moved a little (tied ones together)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return other


def expected_logprobs(model: torch.nn.Module, t: Any, temperature: float) -> list[float]:
    """Each continuation token's logprob under `model` at `temperature`, from one forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([t.prompt_ids + t.tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, -1)
    p = len(t.prompt_ids)
    return [logprobs[p - 1 + j, token].item() for j, token in enumerate(t.tokens)]


def rows(n: int, seed: int = 0) -> list[Any]:
    from tidal.flow.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    return [Trajectory(prompt_ids=torch.randint(3, 300, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()) for _ in range(n)]


# --- generate ---------------------------------------------------------------------------------


def test_the_engine_is_built_with_processed_logprobs_sleep_mode_and_the_worker_extension(make_engine):
    from tidal.engines.vllm_rollout import WORKER_EXTENSION
    from tidal.engines.vllm_worker import TidalWorkerExtension

    engine, fake = make_engine(tensor_parallel_size=2, gpu_memory_utilization=0.5, max_model_len=256, enforce_eager=True, seed=3, dtype="float32")
    args = fake.engine_args
    assert args.logprobs_mode == "processed_logprobs" and args.worker_extension_cls == WORKER_EXTENSION and args.enable_sleep_mode
    assert (args.tensor_parallel_size, args.gpu_memory_utilization, args.max_model_len, args.enforce_eager, args.seed, args.dtype) == (2, 0.5, 256, True, 3, "float32")
    assert args.model == str(engine.model_path)
    assert len(fake.workers) == 2 and all(isinstance(w, TidalWorkerExtension) for w in fake.workers)
    assert type(engine).rollout_keys == ("gpu_memory_utilization", "max_model_len", "enforce_eager") and type(engine).builds_from_checkpoint


def test_generate_records_tokens_logprobs_and_versions(make_engine, reference):
    engine, fake = make_engine(temperature=0.7, version=4)
    trajectories = rows(5)
    trajectories[2].extend([17, 18], [-1.0, -2.0], 3)  # a row a paused call left: continued from its tokens
    out = engine.generate(trajectories, max_new_tokens=9)
    assert out == trajectories
    for t in out:
        assert t.finish_reason == "length" and t.num_generated == 9
        assert len(t.tokens) == len(t.logprobs) == len(t.versions)
    assert out[2].tokens[:2] == [17, 18] and out[2].versions == [3, 3] + [4] * 7
    assert all(t.versions == [4] * 9 for k, t in enumerate(out) if k != 2)
    for t in out:
        got, want = t.logprobs, expected_logprobs(reference, t, 0.7)
        skip = 2 if t is out[2] else 0
        assert got[skip:] == pytest.approx(want[skip:], abs=1e-4)
    params = [c[2] for c in fake.calls if c[0] == "generate"]
    assert len(params) == 5
    p = params[0]
    assert (p.n, p.temperature, p.top_k, p.top_p, p.logprobs, p.detokenize, p.ignore_eos, p.stop_token_ids) == (1, 0.7, 0, 1.0, 0, False, True, NO_END)
    assert sorted(c.max_tokens for c in params) == [7, 9, 9, 9, 9]


def test_top_k_and_top_p_go_to_vllm_and_its_logprobs_are_the_trainers_under_the_same_cut(make_engine, reference):
    """The fake cuts as vLLM 0.32's sampler does (its `apply_top_k_top_p`, transcribed), and its
    processed logprobs are of the cut distribution: the torch train engine, told the same
    cut, takes the same logprobs (importance ratio 1); uncut, lower ones."""
    from tidal.engines.torch_train import TorchTrainEngine
    from tidal.flow.trajectory import to_token_batch

    engine, fake = make_engine(temperature=0.9, top_k=20, top_p=0.8)
    trajectories = engine.generate(rows(6), max_new_tokens=6)
    p = next(c[2] for c in fake.calls if c[0] == "generate")
    assert (p.top_k, p.top_p) == (20, 0.8)
    batch = to_token_batch(trajectories, pad_id=0)
    behavior = batch.behavior_logprobs[batch.loss_mask != 0]
    cut = TorchTrainEngine(copy.deepcopy(reference), temperature=0.9, top_k=20, top_p=0.8).logprobs(batch)[batch.loss_mask != 0]
    full = TorchTrainEngine(copy.deepcopy(reference), temperature=0.9).logprobs(batch)[batch.loss_mask != 0]
    assert torch.allclose(cut, behavior, atol=1e-4)
    assert (full < behavior - 1e-3).float().mean() > 0.5


def test_an_end_token_ends_a_row_with_it_and_rows_at_their_budget_are_not_sent(make_engine):
    engine, fake = make_engine(eos_id=list(range(320)))  # every token ends a row
    trajectories = rows(3)
    done_already = rows(1, seed=5)[0]
    done_already.extend([5, 6], [-1.0, -1.0], 0)
    out = engine.generate([*trajectories, done_already], max_new_tokens=2)
    assert [t.finish_reason for t in out] == ["stop", "stop", "stop", "length"]  # the last was at its budget
    assert all(len(t.tokens) == 1 for t in out[:3])
    assert len([c for c in fake.calls if c[0] == "generate"]) == 3


def test_bad_rows_are_refused_before_anything_is_sent(make_engine):
    from tidal.flow.trajectory import Trajectory

    engine, fake = make_engine()
    t = rows(1)[0]
    with pytest.raises(ValueError, match="same object"):
        engine.generate([t, t], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt token"):
        engine.generate([Trajectory(prompt_ids=[])], max_new_tokens=4)
    assert not [c for c in fake.calls if c[0] == "generate"]


def test_a_pause_keeps_the_partial_rows_and_a_later_call_continues_them_under_new_weights(make_engine, reference):
    engine, fake = make_engine(temperature=0.9)
    trajectories = rows(4)
    asked = []

    def should_pause() -> bool:
        asked.append(1)
        return True

    out = engine.generate(trajectories, max_new_tokens=60, should_pause=should_pause)
    assert asked == [1]
    assert all(t.finish_reason is None and t.num_generated < 60 for t in out)
    assert any(t.num_generated > 0 for t in out)
    assert [c[1] for c in fake.calls if c[0] == "abort"] and not fake.requests  # every request ended
    first = [len(t.tokens) for t in out]
    for t in out:
        assert t.logprobs == pytest.approx(expected_logprobs(reference, t, 0.9), abs=1e-4)
    new = perturbed(reference, seed=1)
    engine.load_weights(1, new.state_dict().items())
    out = engine.generate(trajectories, max_new_tokens=60)
    for t, k in zip(out, first):
        assert t.finish_reason == "length" and t.num_generated == 60
        assert t.versions == [0] * k + [1] * (60 - k)
        assert t.logprobs[:k] == pytest.approx(expected_logprobs(reference, t, 0.9)[:k], abs=1e-4)
        assert t.logprobs[k:] == pytest.approx(expected_logprobs(new, t, 0.9)[k:], abs=1e-4)


class Feeder:
    """A `Refill` that gives one wave of rows per `more()` call and records what ends."""

    def __init__(self, waves: list[list[Any]]) -> None:
        self.waves = list(waves)
        self.ended: list[Any] = []

    def done(self, trajectories: list[Any]) -> None:
        assert trajectories and all(t.done for t in trajectories)
        self.ended += trajectories

    def more(self) -> list[Any]:
        return self.waves.pop(0) if self.waves else []


def test_refill_hands_over_rows_as_they_end_and_adds_new_ones(make_engine, reference):
    engine, _ = make_engine(eos_id=list(range(3, 60)))  # rows end early, each at its own time
    first = rows(4)
    waves = [rows(2, seed=1), rows(3, seed=2), rows(1, seed=3)]
    feeder = Feeder(waves)
    out = engine.generate(first, max_new_tokens=12, refill=feeder)
    joined = [t for wave in waves for t in wave]
    assert out == first + joined  # the rows given, then those that joined
    assert len(feeder.ended) == len(out) and {id(t) for t in feeder.ended} == {id(t) for t in out}  # each handed over once
    for t in out:
        assert t.done and 1 <= t.num_generated <= 12
        assert t.logprobs == pytest.approx(expected_logprobs(reference, t, 1.0), abs=1e-4)


def test_a_row_refill_gives_twice_is_refused_and_the_running_rows_stop(make_engine):
    engine, fake = make_engine()
    first = rows(3)
    first[0].extend([5] * 39, [-1.0] * 39, 0)  # one token left: it ends first, the others run on

    class Twice(Feeder):
        def more(self) -> list[Any]:
            return [first[1]]  # still decoding

    with pytest.raises(ValueError, match="same object"):
        engine.generate(first, max_new_tokens=40, refill=Twice([]))
    assert first[0].finish_reason == "length" and first[1].finish_reason is None
    assert not fake.requests  # every request ended (aborted or finished)
    assert all(len(t.tokens) == len(t.logprobs) == len(t.versions) for t in first)


# --- weights ----------------------------------------------------------------------------------


def test_named_weights_are_the_checkpoints_specs_without_memory(make_engine, reference):
    from tidal.hal.transfer import expected_specs

    engine, _ = make_engine()
    weights = list(engine.named_weights())
    assert all(t.device.type == "meta" for _, t in weights)
    assert expected_specs(weights) == expected_specs(reference.state_dict().items())


def test_a_custom_model_is_built_and_updated_when_the_run_trusts_its_code(fake_vllm, remote_code_hf_dir, reference):
    """`model.trust_remote_code` reaches vLLM's engine arguments (vLLM's config loading refuses
    a checkpoint's own code otherwise, as the fake does) and the manifest the weights are
    checked against; the custom model has the checkpoint's weights and takes a new version."""
    from tidal.engines.vllm_rollout import VLLMRolloutEngine

    with pytest.raises(ValueError, match="trust_remote_code"):
        VLLMRolloutEngine(remote_code_hf_dir, eos_id=NO_END, pad_id=0)
    engine = VLLMRolloutEngine(remote_code_hf_dir, eos_id=NO_END, pad_id=0, trust_remote_code=True)
    try:
        fake = sys.modules["vllm.v1.engine.async_llm"].INSTANCES[-1]
        assert fake.engine_args.trust_remote_code is True
        engine.load_weights(1, perturbed(reference, 1).state_dict().items())
        assert engine.version == 1 and len(engine.generate(rows(2), max_new_tokens=3)[0].tokens) == 3
    finally:
        engine.close()


@pytest.mark.parametrize("via", ["shared file", "messages"])
def test_a_weight_update_reaches_every_worker_and_each_reports_the_version(make_engine, reference, monkeypatch, via):
    """Through a host file every worker maps (asked once), in buckets of at least the largest
    tensor (the second written over the first after the workers loaded it); or, where a
    worker cannot map this host's files, inside the messages. Two versions each."""
    from tidal.engines import vllm_weights

    monkeypatch.setattr(vllm_weights, "SHARED_BUCKET_BYTES", 4096)  # several buckets of the tiny model
    engine, fake = make_engine(tensor_parallel_size=2)
    if via == "messages":
        monkeypatch.setattr(fake.workers[1], "tidal_maps", lambda path: False)
    before = len(fake.calls)
    for version, seed in ((7, 2), (8, 3)):
        new = perturbed(reference, seed=seed)
        engine.load_weights(version, ((n, t.to(torch.bfloat16)) for n, t in new.state_dict().items()))  # any floating dtype
        assert engine.version == version
        assert [w.tidal_weight_version() for w in fake.workers] == [version, version]
        want = {n: t.to(torch.bfloat16).float() for n, t in new.state_dict().items()}
        for worker in fake.workers:
            got = worker.get_model().hf_state()
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    calls = fake.calls[before:]
    loads = ("collective_rpc", "tidal_load_shared" if via == "shared file" else "tidal_load_bucket")
    assert calls[0] == ("collective_rpc", "tidal_maps") and calls.count(calls[0]) == 1
    assert calls[-2:] == [("collective_rpc", "tidal_commit_weights"), ("reset_prefix_cache",)]
    assert set(calls[1:-2]) == {loads, *calls[-2:]} and calls.count(loads) > (2 if via == "shared file" else 1)
    assert engine._weights.shared is (via == "shared file")


def test_the_shared_bucket_is_reused_and_goes_with_the_engine(make_engine, reference):
    """One host file for every version (no file left behind per version); none after close."""
    engine, fake = make_engine()
    engine.load_weights(1, reference.state_dict().items())
    path = engine._weights._file.path
    engine.load_weights(2, perturbed(reference, seed=1).state_dict().items())
    assert engine._weights._file.path == path and path.exists() and fake.workers[0].tidal_weight_version() == 2
    engine.close()
    assert not path.exists()


def test_a_worker_that_reports_another_version_fails_the_update(make_engine, reference, monkeypatch):
    engine, fake = make_engine(tensor_parallel_size=2)
    monkeypatch.setattr(fake.workers[1], "tidal_commit_weights", lambda version: version - 1)
    with pytest.raises(RuntimeError, match=r"workers report versions \[3, 2\]"):
        engine.load_weights(3, reference.state_dict().items())
    assert engine.version == 0
    assert ("reset_prefix_cache",) not in fake.calls


def _refusals(reference: torch.nn.Module) -> list[tuple[list[tuple[str, torch.Tensor]], str]]:
    sd = reference.state_dict()
    k = "model.layers.0.self_attn.k_proj.weight"
    twin = {**sd, "lm_head.weight": sd["lm_head.weight"] + 1}
    return [
        ([(n, t) for n, t in sd.items() if n != k], rf"missing \['{k}'\].*qkv_proj"),
        ([*sd.items(), ("model.extra.weight", torch.zeros(2))], r"unknown \['model.extra.weight'\]"),
        ([*sd.items(), ("model.norm.weight", sd["model.norm.weight"])], r"given twice \['model.norm.weight'\]"),
        ([(n, t[:-1] if n == "model.norm.weight" else t) for n, t in sd.items()], r"wrong shape \['model.norm.weight'\]"),
        ([(n, t.long() if n == "model.norm.weight" else t) for n, t in sd.items()], r"wrong dtype \['model.norm.weight'\]"),
        (list(twin.items()), "'lm_head.weight' is tied to 'model.embed_tokens.weight'"),
    ]


def test_weights_that_do_not_match_the_checkpoint_are_refused_naming_them_and_nothing_is_sent(make_engine, reference):
    engine, fake = make_engine()
    for weights, message in _refusals(reference):
        before = list(fake.calls)
        with pytest.raises(ValueError, match=message):
            engine.load_weights(1, weights)
        assert fake.calls == before and engine.version == 0
        assert [w.tidal_weight_version() for w in fake.workers] == [None]


def test_the_fake_refuses_tensors_in_collective_rpc_and_the_adapter_sends_bytes(make_engine):
    """The reason tensors travel packed: real vLLM 0.32 would hand a worker an untyped list."""
    from tidal.engines.vllm_worker import pack_tensor, unpack_tensor

    engine, fake = make_engine()

    async def send(arg: Any) -> Any:
        return await fake.collective_rpc("tidal_weight_version", args=(arg,) if arg is not None else ())

    with pytest.raises(TypeError, match="tensor"):
        engine._call(send(torch.zeros(2)))
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = (torch.arange(6).reshape(2, 3) % 2).to(dtype)
        name, back = unpack_tensor(pack_tensor("w", t))
        assert name == "w" and back.dtype == dtype and torch.equal(back, t)
    assert unpack_tensor(pack_tensor("e", torch.zeros(0, 3)))[1].shape == (0, 3)


# --- sleep mode and shutdown ----------------------------------------------------------------


def test_sleep_and_wake_up_in_order_and_what_each_state_allows(make_engine, reference):
    engine, fake = make_engine()
    start = len(fake.calls)
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(rows(1), max_new_tokens=3)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.load_weights(1, reference.state_dict().items())
    engine.wake_up(["weights"])
    engine.load_weights(1, reference.state_dict().items())  # new weights before the KV cache returns
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(rows(1), max_new_tokens=3)
    engine.wake_up(["kv_cache"])
    assert engine.generate(rows(1), max_new_tokens=3)[0].num_generated == 3
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="level-2"):
        engine.generate(rows(1), max_new_tokens=3)
    engine.load_weights(2, reference.state_dict().items())
    t = engine.generate(rows(1), max_new_tokens=3)[0]
    assert t.versions == [2, 2, 2] and t.logprobs == pytest.approx(expected_logprobs(reference, t, 1.0), abs=1e-4)
    order = [c[:2] for c in fake.calls[start:] if c[0] in ("sleep", "wake_up", "generate") or c[1:] == ("tidal_commit_weights",)]
    assert [c[0] if c[0] != "collective_rpc" else "load" for c in order] == ["sleep", "wake_up", "load", "wake_up", "generate", "sleep", "wake_up", "load", "generate"]
    assert order[1] == ("wake_up", ["weights"]) and order[3] == ("wake_up", ["kv_cache"]) and order[6] == ("wake_up", None)
    with pytest.raises(ValueError, match="level"):
        engine.sleep(3)
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(["scheduling"])


def test_a_colocated_seat_parks_it_with_a_level_1_sleep_and_unparks_it_whole(make_engine, reference):
    from tidal.flow.protocols import ParksItself

    engine, fake = make_engine()
    assert isinstance(engine, ParksItself)
    start = len(fake.calls)
    engine.park()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(rows(1), max_new_tokens=3)
    engine.unpark()
    assert engine.generate(rows(1), max_new_tokens=3)[0].versions == [0, 0, 0]  # the weights came back from host memory
    assert [c[:2] for c in fake.calls[start:] if c[0] in ("sleep", "wake_up")] == [("sleep", 1), ("wake_up", None)]


def test_close_shuts_vllm_down_once_and_stops_the_loop(make_engine, reference):
    engine, fake = make_engine()
    engine.close()
    engine.close()
    assert fake.calls.count(("shutdown",)) == 1 and not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(rows(1), max_new_tokens=3)
    with pytest.raises(RuntimeError, match="closed"):
        engine.load_weights(1, reference.state_dict().items())


def test_the_fake_enforces_what_real_vllm_does(fake_vllm, tiny_hf_dir):
    """What the adapter must get right, the fake refuses as vLLM does (or more loudly)."""
    import asyncio

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    with pytest.raises(ValueError, match="logprobs_mode"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_hf_dir), logprobs_mode="processed"))
    with pytest.raises(AssertionError, match="conflicts"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_hf_dir), worker_extension_cls="vllm.v1.worker.worker_base.WorkerBase"))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=2.5)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_hf_dir)))
    params = SamplingParams(max_tokens=2, logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)

    async def run() -> None:
        with pytest.raises(RuntimeError, match="sleep mode"):
            await llm.sleep(1)
        with pytest.raises(TypeError, match="SamplingParams"):
            async for _ in llm.generate({"prompt_token_ids": [5, 6]}, dataclasses.asdict(params), "r0"):
                pass
        outputs = [o async for o in llm.generate({"prompt_token_ids": [5, 6]}, params, "r1")]
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == 2 and outputs[-1].finished

    asyncio.run(run())
    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(llm.reset_prefix_cache())  # another loop


def test_a_dev_shm_without_room_for_the_bucket_sends_inside_the_messages(make_engine, reference, monkeypatch, caplog):
    """Docker's 64 MB /dev/shm holds no 512 MB bucket: a warning, and the version still arrives."""
    from tidal.hal.transfer import shared_file

    engine, fake = make_engine()
    engine.load_weights(1, reference.state_dict().items())  # the workers map this host's files

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine._weights, "_file", None)
    monkeypatch.setattr(shared_file.os, "posix_fallocate", full)
    new = perturbed(reference, seed=4)
    with caplog.at_level("WARNING"):
        engine.load_weights(2, new.state_dict().items())
    assert "cannot hold" in caplog.text and "inside vLLM's messages" in caplog.text and engine._weights.shared is False
    assert fake.calls[-3] == ("collective_rpc", "tidal_load_bucket") and fake.workers[0].tidal_weight_version() == 2
    got = fake.workers[0].get_model().hf_state()
    assert all(torch.equal(got[n], t) for n, t in new.state_dict().items())
