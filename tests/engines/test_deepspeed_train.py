"""The deepspeed train engine across two real processes (DeepSpeed's CPU accelerator, gloo).

One pair of worker processes (`conftest.spawn_ranks`) runs everything, in two phases. SPMD
first, under ZeRO-3: each rank calls every method with its own rows. Then led by rank 0, as
`tidal run` drives it: rank 0 alone is called with every row and rank 1 runs
`deepspeed_lead.follow()`, for ZeRO stages 1, 2 and 3 in turn. The tests compare what rank 0
saved with one `TorchTrainEngine` on all six rows, and a state moved through
`state_dict()` / `load_state_dict()` with the run that never moved.

Tolerance: float32 noise (weights within 1e-5, the loss and the gradient norm within 1e-4
relative). Every rank computes its rows' gradients and DeepSpeed adds them up in another
order than the torch engine's micro-batches do; a key projection's bias, whose gradient is
zero in exact arithmetic, turns that noise into AdamW steps of up to lr (1e-3 for it).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("deepspeed")

from tidal.engines.deepspeed_setup import deepspeed_config
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.trajectory import TokenBatch

T = CharTokenizer()
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=2, padding_free=False, kl_reference=True)
SHARDS = [[0, 1, 2, 3], [4, 5]]
"""Rows of each SPMD rank: rank 0 has 2 micro-batches (the second with no loss token), rank 1
one, whose rows have no advantage (a dummy pass in policy steps)."""
PLAN = [{"aggregation": "token_mean"}, {"aggregation": "seq_mean_token_mean"}, "sft", {"aggregation": "token_sum_norm", "max_tokens": 8}, {"aggregation": "token_mean", "scale": 0.0}, {"aggregation": "token_mean", "seq_mask_low": 0.5, "seq_mask_high": 2.0}, {"aggregation": "token_mean", "kl_coef": 0.5}]
"""Policy losses with three aggregations, a supervised step, a step with all advantages zero
(no row runs anywhere; AdamW still steps), one with sequence masking and one with a KL term
(every row runs; under SPMD ZeRO-3 rank 1's one micro-batch against rank 0's two makes a
dummy pass with a reference pass in it)."""
NUM_RL_STEPS = sum(step != "sft" for step in PLAN)
RESUME = [{"aggregation": "token_mean", "kl_coef": 0.5}, "sft"]
"""Steps taken after a state moved, by the engine that saved it and by the one that loaded it."""
STAGES = (1, 2, 3)
RECOMPUTED = 2
"""The first steps of `PLAN` a led ZeRO-3 engine whose model recomputes activations takes."""

WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from tidal.engines.deepspeed_lead import follow
    from tidal.engines.deepspeed_train import DeepSpeedTrainEngine
    from tidal.engines.fsdp_lead import stop_followers
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    import rank_worker  # beside this script (conftest.spawn_ranks)

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)

    def engine(seed, **options):
        return DeepSpeedTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=seed, **data["model"]), **data["engine"], **options)

    def run(e, plan, batch, advantages):
        return rank_worker.run_plan(e, batch, advantages, plan)

    export = rank_worker.export

    # SPMD, ZeRO-3: every rank calls every method with its own rows
    rows = data["shards"][rank]
    mine, my_advantages = TokenBatch(*(t[rows] for t in data["batch"])), data["advantages"][rows]
    e = engine(0, zero_stage=3)
    asked_cache = set()
    e.module.register_forward_pre_hook(lambda module, args, kwargs: asked_cache.add(kwargs.get("use_cache")), with_kwargs=True)
    spmd = {"metrics": run(e, data["plan"], mine, my_advantages), "version": e.version}
    spmd["use_cache"] = asked_cache
    spmd["logprobs"] = e.logprobs(mine)
    spmd["weights"] = export(e)
    spmd["specs"] = e.named_weights().specs()  # no collective
    spmd["partitioned"] = sum(p.numel() == 0 for p in e.module.parameters())  # ZeRO-3 slices: an empty tensor beside its slice
    spmd["reference_sizes"] = [(p.numel(), p.ds_tensor.numel(), p.ds_numel) for p in e.reference.parameters()]
    from deepspeed.comm import comm as ds_comm

    spmd["shm_op_built"] = ds_comm.cdb.shm_comm_op is not None
    try:  # before any collective: rank 1 raises too
        DeepSpeedTrainEngine(e.module, zero_stage=3)
    except ValueError as err:
        spmd["wrapped_twice"] = str(err)
    spmd["state"] = e.state_dict()
    spmd["resume_metrics"] = run(e, data["resume"], mine, my_advantages)
    spmd["continued"] = export(e)
    torch.save(spmd["metrics"], work / f"metrics{rank}.pt")
    del e

    # Led by rank 0, ZeRO-1, -2 and -3: rank 1 follows
    if rank:
        torch.save(follow(), work / f"follow{rank}.pt")
    else:
        batch, advantages = TokenBatch(*data["batch"]), data["advantages"]
        led = {}
        for stage in data["stages"]:
            out = led[stage] = {}
            e = engine(0, zero_stage=stage, rank0_leads=True)
            out["metrics"] = run(e, data["plan"], batch, advantages)
            out["version"] = e.version
            out["logprobs"] = e.logprobs(batch)
            out["weights"] = export(e)
            stopped = iter(e.named_weights())
            out["first"] = next(stopped)[0]
            stopped.close()  # a pass stopped early: ZeRO-3's followers still make (and rank 0 finishes) its gathers
            out["specs"] = e.named_weights().specs()
            state = e.state_dict()
            out["state"] = state
            e.park()  # as rank 0's seat parks it for a rollout guest (rank 1's seat would park its own)
            e.unpark()
            out["parked_state"] = e.state_dict()
            out["resume_metrics"] = run(e, data["resume"], batch, advantages)
            out["continued"] = export(e)
            other = engine(7, zero_stage=stage, rank0_leads=True)  # the followers replace their engine too
            other.load_state_dict(state)
            out["loaded_version"] = other.version
            out["loaded"] = export(other)
            out["reloaded_metrics"] = run(other, data["resume"], batch, advantages)
            out["reloaded"] = export(other)
            from_torch = engine(9, zero_stage=stage, rank0_leads=True)
            from_torch.load_state_dict(data["torch_state"])
            out["from_torch_version"] = from_torch.version
            out["from_torch_settings"] = {key: from_torch.optimizer.param_groups[0][key] for key in ("lr", "weight_decay", "fused")}
            run(from_torch, data["resume"], batch, advantages)
            out["from_torch"] = export(from_torch)
            del e, other, from_torch
        recomputing = build_tiny_qwen2(data["vocab_size"], seed=0, **data["model"])
        recomputing.gradient_checkpointing_enable()  # model.gradient_checkpointing: rank 1's model must recompute too
        e = DeepSpeedTrainEngine(recomputing, **data["engine"], zero_stage=3, rank0_leads=True)
        led["recomputed_metrics"] = run(e, data["plan"][: data["recomputed"]], batch, advantages)
        del e
        strict = engine(11, zero_stage=3, rank0_leads=True, max_nonfinite_steps=0)
        try:  # every rank skips the step and raises (the followers too: the option went with `init`)
            strict.train_step(batch, advantages * float("nan"), loss=PolicyLossConfig())
        except FloatingPointError as err:
            led["nonfinite"] = str(err)
        led["after_nonfinite"] = strict.state_dict()  # collectives: rank 1 still follows
        del strict
        reset = engine(0, zero_stage=1, rank0_leads=True)  # ZeRO-1: AdamW's state reached through views
        run(reset, data["plan"][:1], batch, advantages)
        reset.load_state_dict(led["after_nonfinite"])  # no optimizer state: a fresh AdamW's
        led["reset_state"] = reset.state_dict()
        run(reset, data["resume"][:1], batch, advantages)
        led["reset"] = export(reset)
        del reset
        fresh = engine(11, zero_stage=1, rank0_leads=True)
        run(fresh, data["resume"][:1], batch, advantages)
        led["fresh"] = export(fresh)
        stop_followers()
        torch.save({"spmd": spmd, "led": led}, work / "result.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (see tests/engines/test_fsdp_train.py)
    """
)


def _model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, seed=seed, **MODEL)


@pytest.fixture(scope="module")
def reference(six_rows, run_torch) -> dict:
    """The same steps by one `TorchTrainEngine` on all six rows (`conftest.six_row_batch`)."""
    batch, advantages = six_rows
    engine = TorchTrainEngine(_model(0), **ENGINE)
    metrics = run_torch(engine, batch, advantages, PLAN)
    return {"engine": engine, "batch": batch, "advantages": advantages, "metrics": metrics, "logprobs": engine.logprobs(batch), "weights": list(engine.named_weights())}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, reference: dict, spawn, write_data) -> dict:
    """What rank 0 of the worker pair saved, each rank's SPMD metrics, and rank 1's `follow()` summary."""
    work = tmp_path_factory.mktemp("deepspeed")
    torch_state = reference["engine"].state_dict()  # copied now, by torch.save
    for group in torch_state["optimizer"]["param_groups"]:
        group.update(fused=False, lr=0.5, weight_decay=0.5)  # as a run with other settings, on a platform without fused AdamW, saves it
    write_data(work, reference["batch"], reference["advantages"], shards=SHARDS, plan=PLAN, resume=RESUME, stages=STAGES, recomputed=RECOMPUTED, model=MODEL, engine=ENGINE, vocab_size=T.vocab_size, torch_state=torch_state)
    spawn(work, WORKER)
    result = torch.load(work / "result.pt", weights_only=False)
    return {**result, "rank_metrics": [torch.load(work / f"metrics{rank}.pt") for rank in range(2)], "follower": torch.load(work / "follow1.pt")}


def _assert_same_weights(got: list, want: list) -> None:
    got = dict(got)
    for name, expected in want:
        atol = 1e-3 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(got[name], expected, atol=atol, rtol=0, msg=name)


def _assert_same_logprobs(got: torch.Tensor, want: torch.Tensor, batch: TokenBatch) -> None:
    """Equal where a response token is predicted (the torch engine leaves prompt and padding positions at 0)."""
    response = (batch.loss_mask.cumsum(1) > 0) & (batch.attention_mask[:, 1:] != 0)
    assert response.any()
    torch.testing.assert_close(got[response], want[response], atol=1e-5, rtol=0)


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), step
        for key in ("loss", "grad_norm", "num_tokens", "lr"):  # per-micro-batch diagnostics depend on how rows are cut
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), (step, key)
        assert g.get("skipped_rows") == w.get("skipped_rows"), step
        assert g.get("seq_masked_fraction") == w.get("seq_masked_fraction"), step


def _assert_equal_exports(a: list, b: list) -> None:
    assert [name for name, _ in a] == [name for name, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert torch.equal(x, y), name


def test_zero3_spmd_steps_equal_one_full_batch_torch_step(ranks, reference):
    spmd = ranks["spmd"]
    assert spmd["partitioned"] > 0  # ZeRO-3 really sliced the weights (the biases and norms stay whole)
    assert spmd["version"] == reference["engine"].version == NUM_RL_STEPS  # sft steps keep the version
    _assert_same_weights(spmd["weights"], reference["weights"])
    _assert_same_logprobs(spmd["logprobs"], reference["logprobs"][SHARDS[0]], reference["batch"].select(SHARDS[0]))
    _assert_same_metrics(spmd["metrics"], reference["metrics"])
    assert ranks["rank_metrics"][0] == ranks["rank_metrics"][1] == spmd["metrics"]  # every rank reports the whole batch's


def test_the_zero3_kl_reference_is_partitioned_and_saved_whole(ranks, reference):
    """Under ZeRO-3 each rank holds a slice of the frozen reference, as of the policy, not a
    whole copy; `state_dict()` gathers it whole (the warm start's weights, which the KL steps
    above were taken against: their losses equal the torch engine's), and a moved or parked
    state carries it (`test_a_state_moved_between_engines_goes_on_exactly` takes KL steps)."""
    sizes = ranks["spmd"]["reference_sizes"]
    sliced = [(here, whole) for numel, here, whole in sizes if numel == 0]
    assert sliced and all(here <= whole // 2 + 1 for here, whole in sliced)  # a half each (rounded up)
    want = reference["engine"].state_dict()["reference"]
    for state in (ranks["spmd"]["state"], *(ranks["led"][stage]["state"] for stage in STAGES)):
        assert state["reference"].keys() == want.keys()
        assert all(torch.equal(state["reference"][name], tensor) for name, tensor in want.items())


def test_train_forwards_build_no_kv_cache(ranks):
    """Every forward of the steps asked for no KV cache (transformers' default built one each
    pass, and logged "`use_cache=True` is incompatible with gradient checkpointing")."""
    assert ranks["spmd"]["use_cache"] == {False}


def test_a_model_deepspeed_wraps_already_is_refused(ranks):
    assert "the model is DeepSpeed's already" in ranks["spmd"]["wrapped_twice"]


def test_deepspeed_built_no_shared_memory_op(ranks):
    """The op DeepSpeed's CPU accelerator JIT-compiles when its communication starts (on each
    fresh machine: every CI run), which ZeRO never uses: `deepspeed_setup` patches it off."""
    assert ranks["spmd"]["shm_op_built"] is False


@pytest.mark.parametrize("stage", STAGES)
def test_led_steps_equal_one_full_batch_torch_step(ranks, reference, stage):
    """Rank 0 alone is called with all six rows; rank 1 trains on its share through `follow()`."""
    led = ranks["led"][stage]
    assert led["version"] == NUM_RL_STEPS
    _assert_same_weights(led["weights"], reference["weights"])
    _assert_same_logprobs(led["logprobs"], reference["logprobs"], reference["batch"])
    _assert_same_metrics(led["metrics"], reference["metrics"])
    assert reference["metrics"][-2]["seq_masked_fraction"] == 0.75
    assert reference["metrics"][-1]["kl"] > 0


@pytest.mark.parametrize("stage", STAGES)
def test_exported_weights_and_specs_are_the_unsharded_models(ranks, stage):
    unsharded = _model(0).state_dict()
    want = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in unsharded.items()]
    led = ranks["led"][stage]
    for exported, specs in ((led["weights"], led["specs"]), (ranks["spmd"]["weights"], ranks["spmd"]["specs"])):
        assert [(s.name, s.dtype, s.shape) for s in specs] == want  # tied names included, whole shapes without a gather
        assert [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in exported] == want
    assert led["first"] == want[0][0]


@pytest.mark.parametrize("stage", STAGES)
def test_a_state_moved_between_engines_goes_on_exactly(ranks, stage):
    """`state_dict()` into a fresh engine (other random weights on every rank): the same weights,
    and the same steps after it, bit for bit, as the engine that saved it."""
    led = ranks["led"][stage]
    assert led["loaded_version"] == NUM_RL_STEPS
    _assert_equal_exports(led["loaded"], led["weights"])
    _assert_equal_exports(led["reloaded"], led["continued"])
    assert led["reloaded_metrics"] == led["resume_metrics"]
    assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(led["weights"], led["continued"]))  # the resumed steps did train


def _assert_identical(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_identical(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("stage", STAGES)
def test_a_parked_engine_gets_its_state_back_exactly(ranks, stage):
    """`park()` / `unpark()` (what a colocated seat calls): the whole state after it is the state
    before, AdamW's moments included (ZeRO-1 and -2 checkpoints read them through views that
    DeepSpeed's `reload_states` drops), and the steps after it are those of an engine that
    never parked (`test_a_state_moved_between_engines_goes_on_exactly`: `continued` is the
    parked engine's, `reloaded` the other's)."""
    led = ranks["led"][stage]
    _assert_identical(led["parked_state"], led["state"])
    assert led["parked_state"]["optimizer"]["state"]  # there were moments to lose


@pytest.mark.parametrize("stage", STAGES)
def test_state_dict_is_the_torch_engines_format_both_ways(ranks, reference, stage, run_torch):
    """A torch engine continues where DeepSpeed stopped, and DeepSpeed engines that loaded the
    torch engine's state (saved with other settings) continue as DeepSpeed did, keeping their own lr."""
    led = ranks["led"][stage]
    state = led["state"]
    want = reference["engine"].state_dict()
    assert state["model"].keys() == want["model"].keys()
    assert state["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    assert state["optimizer"]["param_groups"][0]["params"] == want["optimizer"]["param_groups"][0]["params"]
    engine = TorchTrainEngine(_model(9), **ENGINE)
    engine.load_state_dict(state)
    assert engine.version == NUM_RL_STEPS
    run_torch(engine, reference["batch"], reference["advantages"], RESUME)
    _assert_same_weights(list(engine.named_weights()), led["continued"])
    assert led["from_torch_version"] == NUM_RL_STEPS
    assert led["from_torch_settings"] == {"lr": ENGINE["lr"], "weight_decay": ENGINE["weight_decay"], "fused": True}
    _assert_same_weights(led["from_torch"], led["continued"])


def test_a_led_model_that_recomputes_activations_trains_as_one_that_does_not(ranks):
    """rank 0's model has `gradient_checkpointing` on (`model.gradient_checkpointing`, which
    gsm8k_qwen sets): rank 1 builds its model recomputing too. It built one that did not, and
    under ZeRO-3 the ranks' backward passes then made different gathers: the group hung at
    its first step. Recomputing changes nothing else: the steps are the same."""
    led = ranks["led"]
    _assert_same_metrics(led["recomputed_metrics"], led[3]["metrics"][:RECOMPUTED])


def test_a_followers_model_is_built_as_rank_0s():
    """The recipe a led group's followers build from carries what the config does not."""
    from tidal.engines.fsdp_commands import build_from_recipe, model_recipe
    from tidal.engines.models import recompute_activations, recomputes_activations

    for recompute in (False, True):
        model = _model(0)
        if recompute:
            recompute_activations(model)
        built = build_from_recipe(model_recipe(model))
        assert type(built) is type(model) and recomputes_activations(built) is recompute
        assert built.config.to_dict() == model.config.to_dict()


def test_a_state_without_optimizer_state_gives_a_fresh_adamw(ranks):
    """An engine that stepped loads a state saved before any step: its next step is a fresh
    engine's, bit for bit (moments and step reset in place, where ZeRO-1 keeps views of them)."""
    assert ranks["led"]["reset_state"]["optimizer"]["state"] == {}
    _assert_equal_exports(ranks["led"]["reset"], ranks["led"]["fresh"])


def test_followers_build_every_engine_and_take_every_step(ranks):
    """Rank 1 built every engine rank 0 built (three per stage, then three more), took each
    step on its share of the rows that ran (rank 0 shares out only rows with advantage: one of
    two in policy steps, none when all are zero or when sequence masks leave one, which an
    uneven split keeps on rank 0; 3 of 6 in supervised steps and those with a KL term), and made ZeRO-3's
    passes over the weights in step: six, the stopped one included. ZeRO-1 and -2 export from
    rank 0 alone."""
    rows = [3 if step == "sft" or "kl_coef" in step else 0 if step.get("scale") == 0 or "seq_mask_low" in step else 1 for step in PLAN]
    resume_rows = sum(3 if step == "sft" or "kl_coef" in step else 1 for step in RESUME)
    assert ranks["follower"] == {
        "engines": 3 * len(STAGES) + 4,  # and the recomputing one, the strict one, the reset one and a fresh one
        "steps": len(STAGES) * (len(PLAN) + 3 * len(RESUME)) + RECOMPUTED + 3,  # the strict engine's step raised: not counted
        "rows": len(STAGES) * (sum(rows) + 3 * resume_rows) + sum(rows[:RECOMPUTED]) + 1 + 2 * 3,  # the reset engine's first step; its KL step and the fresh one's share out every row
        "exports": 6,
        "critic_steps": 0,  # it builds a critic where rank 0 does (tests/engines/test_led_critic.py)
    }


def test_a_step_with_non_finite_gradients_is_skipped_on_every_rank(ranks):
    """max_nonfinite_steps=0: DeepSpeed skips the step, every rank raises, and rank 1 still follows,
    so rank 0 gathers the unchanged state (what `tidal run` checkpoints before it stops)."""
    assert "at 1 optimizer steps in a row, the last at version 0; train.max_nonfinite_steps=0" in ranks["led"]["nonfinite"]
    state = ranks["led"]["after_nonfinite"]
    assert state["version"] == 0 and state["optimizer"]["state"] == {}  # nothing stepped
    initial = _model(11).state_dict()
    assert state["model"].keys() == initial.keys() and all(torch.equal(t, initial[name]) for name, t in state["model"].items())


@pytest.mark.parametrize("stage", [0, 4, "3"])
def test_a_zero_stage_other_than_1_2_3_is_refused(stage):
    with pytest.raises(ValueError, match="zero_stage must be one of 1, 2, 3"):
        deepspeed_config(zero_stage=stage, grad_clip=1.0, model=_model(0))


def test_zero3_keeps_small_parameters_whole_and_slices_the_rest():
    """Hugging Face Accelerate's `auto` values from the model's hidden size."""
    zero = deepspeed_config(zero_stage=3, grad_clip=1.0, model=_model(0))["zero_optimization"]
    assert zero == {"stage": 3, "reduce_bucket_size": 32 * 32, "stage3_prefetch_bucket_size": int(0.9 * 32 * 32), "stage3_param_persistence_threshold": 320}


def test_deepspeeds_accelerator_is_the_one_the_platform_computes_on():
    """hal names it (`DS_ACCELERATOR`): the vendor's own, and the host's for a fake platform."""
    from tidal.hal import describe

    assert [describe(kind, device_count=1).deepspeed_accelerator for kind in ("cuda", "npu", "cpu")] == ["cuda", "npu", "cpu"]
    assert describe("cuda", device_count=8, fake=True).deepspeed_accelerator == "cpu"
    assert "deepspeed_accelerator" not in describe("npu", device_count=1).to_dict()  # not a field: descriptors travel as before


def test_another_accelerator_set_for_deepspeed_is_refused(monkeypatch):
    from tidal.engines.deepspeed_setup import import_deepspeed
    from tidal.hal import current_platform

    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match="DS_ACCELERATOR=cuda, but this process computes on the cpu platform, whose DeepSpeed accelerator is 'cpu'"):
        import_deepspeed(current_platform())
