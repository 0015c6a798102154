"""The fsdp train engine across two real processes (FSDP2, gloo on CPU).

One pair of worker processes (a script written into a temporary folder and run by
`conftest.spawn_ranks`: a plain `pytest` run cannot import `tests.*` in a child) trains, exports, checkpoints and resumes; the
tests compare what rank 0 saved with a single-process `TorchTrainEngine`. A second pair
runs the engine led by rank 0 (`rank0_leads=True`, as `tidal run` does): rank 0 alone is
called with every row, rank 1 runs `follow()`.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.distributed as dist

from tidal.engines.fsdp_train import TORCHRUN_VARS, FSDPTrainEngine
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch

T = CharTokenizer()
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=2, padding_free=False, kl_reference=True)
"""Padded micro-batches: the float32 tolerances below were set for them. Padding-free ones
(the default) across two ranks: tests/engines/test_fsdp_padding_free.py, in float64."""
SHARDS = [[0, 1, 2, 3], [4, 5]]
"""Rows of each rank: rank 0 has 2 micro-batches (the second with no loss token), rank 1 one."""
PLAN = [{"aggregation": "token_mean"}, {"aggregation": "seq_mean_token_mean"}, "sft", {"aggregation": "token_sum_norm", "max_tokens": 8}, {"aggregation": "token_mean", "scale": 0.0}, {"aggregation": "token_mean", "seq_mask_low": 0.5, "seq_mask_high": 2.0}, {"aggregation": "token_mean", "kl_coef": 0.5}]
"""The steps both engines take: policy losses with three aggregations, a supervised step,
a step whose advantages are all zero (no row runs anywhere; AdamW still steps), one with
sequence masking (decided before the rows are shared out), and one with a KL term (the
sharded reference: every row runs, rank 1's one micro-batch against rank 0's two, so a
dummy pass joins a reference pass)."""
NUM_RL_STEPS = sum(step != "sft" for step in PLAN)
RESUME = [{"aggregation": "token_mean", "kl_coef": 0.5}, "sft"]
"""The steps taken after the checkpoint, once by the saver and once by a fresh engine that loaded it."""

# Both worker scripts end with `os._exit(0)` once rank 0 has written its results and the
# group is destroyed. CI saw rank 1 abort once after the final barrier with 'terminate
# called without an active exception' (not reproduced in 31 tries since). The likely cause:
# engines and DTensors the script still holds keep FSDP's gloo group alive past
# `destroy_process_group()`, so it is torn down during interpreter finalization, after rank
# 0 (the TCPStore's host) may have exited (cf. pytorch PR 179291 on gloo objects destroyed
# during finalization). Nothing the tests check happens after that point.

WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from tidal.engines.fsdp_train import FSDPTrainEngine
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    import rank_worker  # beside this script (conftest.spawn_ranks)

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)
    rows = data["shards"][rank]
    batch = TokenBatch(*(t[rows] for t in data["batch"]))
    advantages = data["advantages"][rows]

    def engine(seed):
        return FSDPTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=seed, **data["model"]), **data["engine"])

    def run(e, plan):
        return rank_worker.run_plan(e, batch, advantages, plan)

    export = rank_worker.export

    e = engine(0)
    fused = {"built": e.optimizer.param_groups[0]["fused"]}
    sizes = {"reference_here": sum(p.to_local().numel() for p in e.reference.parameters()), "reference": sum(p.numel() for p in e.reference.parameters())}
    out = {"metrics": run(e, data["plan"]), "version": e.version}
    out["logprobs"] = e.logprobs(batch)
    out["weights"] = export(e)
    out["specs"] = e.named_weights().specs()  # no collective: rank 1 does not make this call
    out["state"] = e.state_dict()
    e.save_checkpoint(work / "ckpt")
    out["resume_metrics"] = run(e, data["resume"])
    out["continued"] = export(e)
    fresh = engine(5)
    fresh.load_checkpoint(work / "ckpt")
    out["loaded_version"] = fresh.version
    fused["checkpoint"] = fresh.optimizer.param_groups[0]["fused"]
    out["reloaded_metrics"] = run(fresh, data["resume"])
    out["reloaded"] = export(fresh)
    other = engine(7)
    other.load_state_dict(data["torch_state"])
    out["from_torch_version"] = other.version
    fused["torch_state"] = other.optimizer.param_groups[0]["fused"]
    out["fused"] = fused
    out["sizes"] = sizes
    out["from_torch_settings"] = {key: other.optimizer.param_groups[0][key] for key in ("lr", "weight_decay")}
    run(other, data["resume"])
    out["from_torch"] = export(other)
    torch.save(out["metrics"], work / f"metrics{rank}.pt")  # each rank's own view of the steps
    if rank == 0:
        torch.save(out, work / "result.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: see the comment above WORKER
    """
)


LED_WORKER = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    import threading

    from tidal.engines.fsdp_lead import follow, stop_followers
    from tidal.engines.fsdp_train import FSDPTrainEngine
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform

    import rank_worker  # beside this script (conftest.spawn_ranks)
    from tidal.hal.transfer.host import HostReceiver, HostSender

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    if rank:
        from contextlib import contextmanager

        from tidal.flow.timeshare import Offloader
        from tidal.hal import select_platform

        fake = select_platform("fake:cpu:1").platform  # its offload copies for real: the shards really move
        parks = []

        class Parked:
            # a seat whose guest takes the devices between any two commands: the shards and AdamW
            # moments go to host memory after each command and come back before the next

            def __init__(self, engine):
                parked = torch.nn.ModuleList([engine.model, engine.reference])  # the sharded reference moves too
                self.offloader = Offloader(fake, parked, engine.optimizer, moved=engine.after_offload_move)
                self.park()

            def park(self):
                self.offloader.park()
                parks.append(self.offloader.num_bytes)

            @contextmanager
            def turn(self):
                self.offloader.unpark()
                try:
                    yield
                finally:
                    self.park()

            def close(self):
                self.offloader.unpark()

        done = follow(Parked)  # builds and steps whatever rank 0 does
        torch.save({**done, "parks": parks}, work / f"follow{rank}.pt")
    else:
        data = torch.load(work / "data.pt", weights_only=False)
        batch, advantages = TokenBatch(*data["batch"]), data["advantages"]

        def engine(seed):
            return FSDPTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=seed, **data["model"]), rank0_leads=True, **data["engine"])

        def run(e, plan):
            return rank_worker.run_plan(e, batch, advantages, plan)

        e = engine(0)
        out = {"metrics": run(e, data["plan"]), "version": e.version}
        out["logprobs"] = e.logprobs(batch)
        out["one_row"] = e.logprobs(batch.select([0]))  # rank 1's share is empty
        out["weights"] = [(name, tensor.clone()) for name, tensor in e.named_weights()]
        source = e.named_weights()
        out["specs"] = source.specs()
        stopped = iter(source)
        out["first"] = next(stopped)[0]
        stopped.close()  # a pass stopped early: rank 1 still makes (and rank 0 finishes) its gathers
        receiver = HostReceiver(current_platform())
        sender = HostSender(current_platform(), bucket_bytes=4096)  # several buckets, several tensors in some
        sender.connect(receiver.address)
        out["streamed"] = []
        for version in (1, 2):  # the second pass: a version sent again after a rollout actor restarted
            got = {}
            receiving = threading.Thread(target=lambda: got.update(weights=receiver.receive(120)))
            receiving.start()
            out["buckets"] = len(sender.send(version, source).buckets)
            receiving.join()
            out["streamed"].append((got["weights"].version, got["weights"].tensors))
        sender.close()
        receiver.close()
        state = e.state_dict()
        other = engine(7)  # the followers replace their engine too
        other.load_state_dict(state)
        out["loaded_version"] = other.version
        out["loaded"] = [(name, tensor.clone()) for name, tensor in other.named_weights()]
        run(other, data["resume"])
        out["continued"] = [(name, tensor.clone()) for name, tensor in other.named_weights()]
        strict = FSDPTrainEngine(build_tiny_qwen2(data["vocab_size"], seed=11, **data["model"]), rank0_leads=True, max_nonfinite_steps=0, **data["engine"])
        try:  # every rank raises at this step (the followers too: the option went with `init`)
            strict.train_step(batch, advantages * float("nan"), loss=PolicyLossConfig())
        except FloatingPointError as e:
            out["nonfinite"] = str(e)
        out["after_nonfinite"] = strict.state_dict()  # collectives: rank 1 still follows, as `tidal run`'s checkpoint needs
        stop_followers()
        torch.save(out, work / "result.pt")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: see the comment above WORKER
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


def _write_data(write_data, work, reference: dict, shards: list[list[int]] = SHARDS) -> None:
    """The data both worker scripts load: the reference's rows and advantages, and the torch engine's state."""
    torch_state = reference["engine"].state_dict()  # copied now, by torch.save
    for group in torch_state["optimizer"]["param_groups"]:
        group["fused"] = False  # as a platform without fused AdamW (an NPU) saves it
        group.update(lr=0.5, weight_decay=0.5)  # as a run with other settings saves it: the engine keeps its own
    write_data(work, reference["batch"], reference["advantages"], shards=shards, plan=PLAN, resume=RESUME, model=MODEL, engine=ENGINE, vocab_size=T.vocab_size, torch_state=torch_state)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory, reference: dict, spawn, write_data) -> dict:
    """What rank 0 of a 2-process FSDP run saved (see WORKER)."""
    work = tmp_path_factory.mktemp("fsdp")
    _write_data(write_data, work, reference)
    spawn(work, WORKER)
    return {**torch.load(work / "result.pt", weights_only=False), "rank_metrics": [torch.load(work / f"metrics{rank}.pt") for rank in range(2)]}


@pytest.fixture(scope="module")
def led_run(tmp_path_factory: pytest.TempPathFactory, reference: dict, spawn, write_data) -> dict:
    """What rank 0 of a 2-process group led by rank 0 saved, and what rank 1's `follow()` returned."""
    work = tmp_path_factory.mktemp("led")
    _write_data(write_data, work, reference)
    spawn(work, LED_WORKER)
    follower = torch.load(work / "follow1.pt")
    return {**torch.load(work / "result.pt", weights_only=False), "follower_parks": follower.pop("parks"), "follower": follower}


def test_two_rank_steps_equal_one_full_batch_torch_step(fsdp_run, reference):
    assert fsdp_run["version"] == reference["engine"].version == NUM_RL_STEPS  # sft steps keep the version
    _assert_same_weights(fsdp_run["weights"], reference["weights"])
    _assert_same_logprobs(fsdp_run["logprobs"], reference["logprobs"][SHARDS[0]], reference["batch"].select(SHARDS[0]))
    for got, want in zip(fsdp_run["metrics"], reference["metrics"], strict=True):
        assert set(got) == set(want)
        # The torch engine groups rows of similar length into micro-batches, so its micro-batches
        # differ from the ranks' (see the led test): only batch-level values compare.
        for key in ("loss", "grad_norm", "num_tokens", "lr", *(["kl"] if "kl" in want else [])):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
        assert got.get("skipped_rows") == want.get("skipped_rows") in (None, 0.0, 4.0, 5.0, 6.0)  # policy steps: rows 2-5 (rank 1 ran none), and one masked out, or all; none with a KL term


def test_the_kl_reference_is_sharded_over_the_ranks(fsdp_run):
    """Each rank holds its shard of the frozen reference, not a whole copy (a model's weights
    per device were a 7B model's 30 GB in float32); its KL step equals the torch engine's (above)."""
    sizes = fsdp_run["sizes"]
    assert sizes["reference"] == sum(p.numel() for p in _model(0).parameters())
    assert sizes["reference_here"] <= sizes["reference"] / 2 + 64  # rank 0's half (a dimension that does not split evenly rounds up)


def test_every_rank_reports_the_whole_batchs_sequence_masked_fraction(fsdp_run, led_run, reference):
    """The masking step drops 3 of the 4 rows with a loss token: one of rank 0's two, both of
    rank 1's. Every rank's metrics are the whole batch's, as the torch engine's and the led
    group's (SPMD ranks once reported their own rows' fraction: 0.5 and 1.0)."""
    want = reference["metrics"][-2]["seq_masked_fraction"]
    assert want == 0.75
    assert [metrics[-2]["seq_masked_fraction"] for metrics in fsdp_run["rank_metrics"]] == [want, want]
    assert fsdp_run["rank_metrics"][0] == fsdp_run["metrics"]
    assert led_run["metrics"][-2]["seq_masked_fraction"] == want


def test_exported_weights_are_the_unsharded_models(fsdp_run, reference):
    exported = fsdp_run["weights"]
    unsharded = _model(0).state_dict()
    assert [name for name, _ in exported] == list(unsharded)  # every name, in order, tied ones included
    for name, tensor in exported:
        assert type(tensor) is torch.Tensor and tensor.shape == unsharded[name].shape and tensor.dtype == unsharded[name].dtype, name
    _assert_same_weights(exported, list(reference["engine"].model.state_dict().items()))


def test_checkpoint_resume_repeats_the_same_steps(fsdp_run):
    assert fsdp_run["loaded_version"] == NUM_RL_STEPS
    assert [n for n, _ in fsdp_run["continued"]] == [n for n, _ in fsdp_run["reloaded"]]
    for (name, a), (_, b) in zip(fsdp_run["continued"], fsdp_run["reloaded"]):
        assert torch.equal(a, b), name
    assert fsdp_run["resume_metrics"] == fsdp_run["reloaded_metrics"]
    moved = any(not torch.equal(a, b) for (_, a), (_, b) in zip(fsdp_run["weights"], fsdp_run["continued"]))
    assert moved  # the resumed steps did train


def test_state_dict_loads_into_the_torch_engine(fsdp_run, reference, run_torch):
    """`state_dict()` is the torch engine's format: a torch engine continues where FSDP stopped."""
    engine = TorchTrainEngine(_model(9), **ENGINE)
    engine.load_state_dict(fsdp_run["state"])
    assert engine.version == NUM_RL_STEPS
    run_torch(engine, reference["batch"], reference["advantages"], RESUME)
    _assert_same_weights(list(engine.named_weights()), fsdp_run["continued"])


def test_torch_engine_state_loads_into_fsdp(fsdp_run):
    """The other way round: FSDP engines that loaded the torch engine's state continue as FSDP did."""
    assert fsdp_run["from_torch_version"] == NUM_RL_STEPS
    _assert_same_weights(fsdp_run["from_torch"], fsdp_run["continued"])


def test_adamw_is_fused_where_the_platform_says_so_whatever_saved_the_state(fsdp_run):
    """The CPU platform's optimizer options (fused AdamW, on the sharded parameters too), kept
    through a checkpoint and through a state saved where AdamW was not fused."""
    assert fsdp_run["fused"] == {"built": True, "checkpoint": True, "torch_state": True}


def test_a_loaded_state_keeps_the_engines_own_lr_and_weight_decay(fsdp_run):
    """A state saved with lr and weight decay 0.5 (a run resumed with other `train.*` keys)
    brings its moments, not its settings: the continued run equals one that never changed."""
    assert fsdp_run["from_torch_settings"] == {"lr": ENGINE["lr"], "weight_decay": ENGINE["weight_decay"]}


def _assert_same_weights(got: list, want: list) -> None:
    """Equal up to float noise. A key projection's bias has no gradient in exact arithmetic (it
    shifts every score of a query alike), so AdamW turns rounding noise, which depends on the
    order of the sums, into steps of up to lr: those biases get a looser bound."""
    got = dict(got)
    for name, expected in want:
        atol = 1e-3 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(got[name], expected, atol=atol, rtol=0, msg=name)


def _assert_same_logprobs(got: torch.Tensor, want: torch.Tensor, batch: TokenBatch) -> None:
    """Equal where a response token is predicted: the torch engine packs rows of different
    lengths (`torch_train._pack`) and leaves prompt positions, and the positions that predict
    padding, at 0. Rows 0, 1, 4 and 5 have responses (of 1-6 tokens)."""
    response = (batch.loss_mask.cumsum(1) > 0) & (batch.attention_mask[:, 1:] != 0)
    assert response.any()
    torch.testing.assert_close(got[response], want[response], atol=1e-5, rtol=0)


def test_led_by_rank0_equals_one_full_batch_torch_step(led_run, reference):
    """Rank 0 alone is called with all six rows; rank 1 trains on its share through `follow()`."""
    assert led_run["version"] == NUM_RL_STEPS
    _assert_same_weights(led_run["weights"], reference["weights"])
    _assert_same_logprobs(led_run["logprobs"], reference["logprobs"], reference["batch"])  # every row, in order
    _assert_same_logprobs(led_run["one_row"], reference["logprobs"][:1], reference["batch"].select([0]))
    for got, want in zip(led_run["metrics"], reference["metrics"], strict=True):
        assert set(got) == set(want)
        # Rows fall into other micro-batches here (3 + 3 rows) than in the torch engine (2 + 2 + 2):
        # the loss and the gradient do not depend on that; per-micro-batch diagnostics such as
        # ratio_mean are weighted by micro-batch and do.
        for key in ("loss", "grad_norm", "num_tokens", "lr", *(["kl"] if "kl" in want else [])):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
        assert got.get("skipped_rows") == want.get("skipped_rows") in (None, 0.0, 4.0, 5.0, 6.0)


def test_a_follower_parks_its_shards_between_commands(led_run):
    """Rank 1 parks its shards (and AdamW moments once it stepped; a step frees its gradients) through hal's
    offload after every command and onloads them before the next; every led test's results
    (equal to the torch engine's) were computed so, parks after logprobs included (every
    rank reshards after a forward without backward, so the parked root is sharded too)."""
    parks = led_run["follower_parks"]
    steps = sum(1 if step == "sft" else 2 for step in PLAN + RESUME)  # a policy step's logprobs, then its step
    num_commands = steps + 2 + 6 + 2 + 2  # LED_WORKER's 2 logprobs, 6 passes over the weights, state_dict and load_state_dict, the non-finite step and its state_dict
    assert len(parks) == num_commands + 3 and min(parks) > 0  # and a park once each engine is built
    assert max(parks) > 2 * parks[0]  # after a step: + two AdamW moments per shard


def test_led_engines_rebuild_load_state_and_continue(led_run, fsdp_run):
    """A second engine on rank 0 (the followers build theirs) loads the first one's state and goes on
    exactly as the SPMD engine did after the same steps."""
    assert led_run["loaded_version"] == NUM_RL_STEPS
    assert [n for n, _ in led_run["loaded"]] == [n for n, _ in led_run["weights"]]
    for (name, a), (_, b) in zip(led_run["loaded"], led_run["weights"]):
        assert torch.equal(a, b), name
    _assert_same_weights(led_run["continued"], fsdp_run["continued"])
    # rank 1 built both engines, took every step on its half of the rows that ran and made every
    # pass over the weights rank 0 started: 4 exports, the stopped pass and both streamed ones.
    # Rank 0 shares out only the rows with advantage (0 and 1: one each), or none, in policy steps
    # without a KL term (with one, every row); the sequence-masked step keeps one of them, and an
    # uneven split's extra row stays on rank 0.
    rows = [3 if step == "sft" or "kl_coef" in step else 0 if step.get("scale") == 0 or "seq_mask_low" in step else 1 for step in PLAN + RESUME]
    assert led_run["follower"] == {"engines": 3, "steps": len(PLAN) + len(RESUME), "rows": sum(rows), "exports": 6, "critic_steps": 0}  # the third: below


def test_a_led_step_that_raises_for_non_finite_gradients_leaves_the_followers_following(led_run):
    """Every rank raises `FloatingPointError` at the same step (max_nonfinite_steps=0); rank 1's
    `follow()` goes on, so rank 0 can still gather the unchanged state for a checkpoint (it
    used to end there, and rank 0's checkpoint failed on the closed connection)."""
    assert "at 1 optimizer steps in a row, the last at version 0; train.max_nonfinite_steps=0" in led_run["nonfinite"]
    state = led_run["after_nonfinite"]
    assert state["version"] == 0 and state["optimizer"]["state"] == {}  # nothing stepped
    initial = _model(11).state_dict()
    assert state["model"].keys() == initial.keys() and all(torch.equal(t, initial[name]) for name, t in state["model"].items())


def test_weight_source_specs_are_the_unsharded_models(fsdp_run, led_run):
    """`named_weights().specs()`: names, dtypes and global shapes, read from the shards without gathering."""
    want = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in _model(0).state_dict().items()]
    for specs in (fsdp_run["specs"], led_run["specs"]):
        assert [(s.name, s.dtype, s.shape) for s in specs] == want


def test_led_weight_source_streams_through_a_transport_twice(led_run):
    """Rank 0 streams the led engine's source over the host transport, bucket by bucket, twice (each
    pass gathers anew, rank 1 in step, also after a pass stopped early): both versions arrive equal
    to the un-sharded weights."""
    assert led_run["first"] == led_run["weights"][0][0]
    assert led_run["buckets"] > 3
    assert [version for version, _ in led_run["streamed"]] == [1, 2]
    for _, tensors in led_run["streamed"]:
        assert list(tensors) == [name for name, _ in led_run["weights"]]
        for name, want in led_run["weights"]:
            assert torch.equal(tensors[name], want), name


def test_a_sharded_model_is_not_wrapped_twice(tmp_path):
    from tidal.hal import current_platform

    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        engine = FSDPTrainEngine(_model(0))
        with pytest.raises(ValueError, match="sharded already"):
            FSDPTrainEngine(engine.model)
    finally:
        dist.destroy_process_group()


def test_bf16_precision_runs_the_sharded_models_matmuls_in_bf16(tmp_path, six_rows):
    from tidal.hal import current_platform

    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        batch, advantages = six_rows
        fp32, bf16 = (FSDPTrainEngine(_model(0), **ENGINE, precision=p) for p in ("fp32", "bf16"))
        seen: set[torch.dtype] = set()
        for module in bf16.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
        mask = batch.loss_mask != 0
        want, got = fp32.logprobs(batch), bf16.logprobs(batch)
        assert seen == {torch.bfloat16} and got.dtype == torch.float32
        assert 0 < (got - want)[mask].abs().max() < 0.1
        grads: list[set[torch.dtype]] = []
        step = bf16.optimizer.step
        bf16.optimizer.step = lambda: grads.append({p.grad.dtype for p in bf16.model.parameters()}) or step()
        bf16.train_step(batch, advantages, loss=PolicyLossConfig())
        assert grads == [{torch.float32}] and all(p.dtype == torch.float32 for p in bf16.model.parameters())
    finally:
        dist.destroy_process_group()


def test_missing_process_group_is_a_clear_error(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"initialised torch.distributed process group.*init_process_group.*RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        FSDPTrainEngine(_model(0))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        FSDPTrainEngine(_model(0))


def test_registered_as_the_fsdp_backend():
    from tidal.tools import backends

    assert backends.load("train.backend", "fsdp") is FSDPTrainEngine


@pytest.mark.gpu
def test_one_rank_on_a_real_gpu_takes_the_torch_engines_steps(tmp_path, reference, spawn, write_data):
    """FSDP2 over NCCL on one real GPU (a group of one holding every row) trains, exports,
    checkpoints and resumes as the single-process torch engine does on CPU."""
    _write_data(write_data, tmp_path, reference, shards=[[0, 1, 2, 3, 4, 5]])
    spawn(tmp_path, WORKER, world=1, device="cuda")
    run = torch.load(tmp_path / "result.pt", weights_only=False, map_location="cpu")
    assert run["version"] == reference["engine"].version == NUM_RL_STEPS
    got = dict(run["weights"])
    for name, expected in reference["weights"]:  # float32 on another device: sums in another order
        atol = 3e-2 if name.endswith("k_proj.bias") else 1e-4  # see _assert_same_weights
        torch.testing.assert_close(got[name], expected, atol=atol, rtol=0, msg=name)
    assert run["loaded_version"] == NUM_RL_STEPS
    _assert_same_weights(run["reloaded"], run["continued"])  # the checkpoint resumed exactly
