"""The engines, wrappers and test fakes satisfy the capability protocols they are used under
(`tidal.flow.protocols`), and lack the ones they must not claim."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.flow.test_ray_rollouts import _PostingWiring, _SendingWiring
from tests.flow.test_timeshare import PassEngine
from tests.flow.test_workflow import _LosesAVersion
from tidal.engines.hf_rollout import HFRolloutEngine
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow import protocols
from tidal.flow.protocols import (
    Collective,
    Distributed,
    HoldsModel,
    HoldsOptimizer,
    HoldsReference,
    MovesAfterOffload,
    Pads,
    Positioned,
    PostsWeights,
    Reclaimable,
    ResendsWeights,
    SharesWeights,
    StepsInTurns,
    SupervisedStep,
)
from tidal.flow.ray.rollouts import RemoteRollouts
from tidal.flow.ray.wiring import CollectiveWiring, HostWiring, IpcWiring
from tidal.flow.rollout import LocalRollouts
from tidal.flow.timeshare import Seat, SharedRolloutEngine, SharedTrainEngine
from tidal.flow.turns import Turns

TOKENIZER = CharTokenizer()


def _model() -> torch.nn.Module:
    return build_tiny_qwen2(TOKENIZER.vocab_size, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, max_positions=16, seed=0)


def _seat(turns: Turns, name: str) -> Seat:
    return Seat(turns, name, park=lambda: None, unpark=lambda: None)


def _has(obj: object, *wanted: type) -> list[str]:
    """Which of the `wanted` protocols `obj` does not satisfy (empty: all)."""
    return [p.__name__ for p in wanted if not isinstance(obj, p)]


def _lacks(obj: object, *unwanted: type) -> list[str]:
    return [p.__name__ for p in unwanted if isinstance(obj, p)]


CAPABILITIES = [v for v in vars(protocols).values() if inspect.isclass(v) and getattr(v, "_is_runtime_protocol", False)]


def test_every_capability_protocol_is_runtime_checkable_and_documented():
    names = {p.__name__ for p in CAPABILITIES}
    assert names >= {"SupervisedStep", "SharesWeights", "Collective", "Distributed", "StepsInTurns", "HoldsModel", "HoldsReference", "HoldsOptimizer", "MovesAfterOffload", "Pads", "Reclaimable", "ResendsWeights", "PostsWeights", "Positioned"}
    assert all(p.__doc__ and len(p.__doc__) > 40 for p in CAPABILITIES), [p.__name__ for p in CAPABILITIES if not p.__doc__]


def test_the_hf_rollout_engine_and_its_time_shared_seat():
    engine = HFRolloutEngine(_model(), eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id)
    assert not _has(engine, HoldsModel, Pads)  # what a seat parks; the trainer's padding
    assert not _lacks(engine, Reclaimable, HoldsOptimizer, MovesAfterOffload)
    shared = SharedRolloutEngine(engine, _seat(Turns(), "rollout"))
    assert not _has(shared, Reclaimable, HoldsModel, Pads)
    assert shared.pad_id == TOKENIZER.pad_id and shared.model is engine.model
    for name in ("reclaimed", "model", "pad_id", "wait_turn"):  # declared, not forwarded: isinstance sees them on Python >= 3.12 too
        assert inspect.getattr_static(shared, name, None) is not None, name


def test_the_torch_train_engine_and_its_time_shared_seat():
    engine = TorchTrainEngine(_model(), lr=1e-3, kl_reference=True)
    assert not _has(engine, SupervisedStep, SharesWeights, HoldsModel, HoldsReference, HoldsOptimizer)
    assert not _lacks(engine, Distributed, Collective, MovesAfterOffload, StepsInTurns)
    assert isinstance(TorchTrainEngine(_model(), lr=1e-3), HoldsReference)  # reference None: still declared
    shared = SharedTrainEngine(engine, _seat(Turns(), "train"))
    assert not _has(shared, StepsInTurns, SupervisedStep, HoldsModel)
    assert not shared._collective_engine
    for name in ("turn_for_step", "sft_step", "model"):
        assert inspect.getattr_static(shared, name, None) is not None, name


def test_the_fsdp_train_engine_class():
    fsdp_train = pytest.importorskip("tidal.engines.fsdp_train")  # needs torch's FSDP2
    cls = fsdp_train.FSDPTrainEngine
    assert not _has(cls, Distributed, Collective, SupervisedStep, MovesAfterOffload)  # checked on the class (`tools.train`)
    assert not _lacks(cls, SharesWeights, StepsInTurns)


def test_a_collective_engine_makes_its_seat_take_turns():
    for collective in (True, False):
        shared = SharedTrainEngine(PassEngine(collective), _seat(Turns(), "train"))
        assert isinstance(shared.engine, Collective) and not isinstance(shared.engine, Distributed)
        assert shared._collective_engine is collective


def test_rollout_groups():
    assert isinstance(_LosesAVersion(local=None, lost=0), ResendsWeights)
    assert not issubclass(LocalRollouts, ResendsWeights)  # one process: its worker never loses its weights
    remote = RemoteRollouts(rollouts=object(), server=None, wiring=None, actors=[], info_path="info.json", seats=[])
    assert isinstance(remote, ResendsWeights) and inspect.getattr_static(remote, "weights_wanted", None) is not None


def test_weight_wirings():
    assert issubclass(IpcWiring, PostsWeights) and isinstance(_PostingWiring(), PostsWeights)
    assert not issubclass(HostWiring, PostsWeights) and not issubclass(CollectiveWiring, PostsWeights)
    assert not isinstance(_SendingWiring(), PostsWeights)


def test_prompt_sources():
    from tidal.engines.data import PromptStream
    from tidal.tools.config import load_config
    from tidal.tools.prompts import Prompts
    from tidal.tools.recipes import resolve_recipe

    assert isinstance(PromptStream(None, position=5), Positioned)  # a file's prompts
    assert isinstance(Prompts(load_config(resolve_recipe("quickstart_cpu"), []), TOKENIZER, set(), position=5), Positioned)  # the task's stream (tools)
    assert not isinstance(iter([]), Positioned)  # a plain iterable: the checkpoint records no position


def test_a_seat_parks_what_its_engine_declares():
    from tidal.flow.colocate import Sharing
    from tidal.hal import select_platform

    class Sharded:  # `HoldsModel`, `HoldsOptimizer`, `MovesAfterOffload`
        def __init__(self) -> None:
            self.model = torch.nn.Linear(2, 2)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.moves = 0

        def after_offload_move(self) -> None:
            self.moves += 1

    sharing = Sharing(Turns(), select_platform("fake:cuda:1").platform)
    try:
        engine, rollout_engine = Sharded(), Sharded()
        sharing.train(engine)
        sharing.rollout(rollout_engine)
        (_, _, train_parks), (_, _, rollout_parks) = sharing._seats
        assert train_parks.module is engine.model and train_parks.optimizer is engine.optimizer
        assert rollout_parks.optimizer is None  # a rollout seat parks no optimizer
        train_parks.park()
        train_parks.unpark()
        assert engine.moves == 2
        with pytest.raises(ValueError, match="no `model` to park"):
            sharing.rollout(object())
    finally:
        sharing.close()


def test_a_critic_shares_the_trainers_seat_and_goes_on_inside_its_turn():
    """A critic seated where a train engine is shares its seat: both states park and come back
    together, and a critic call inside the trainer's turn (a multi-rank engine holds it from its
    step through its weight pass) goes on in that turn instead of waiting for one of its own."""
    from tidal.flow.colocate import Sharing
    from tidal.flow.protocols import Critic
    from tidal.hal import select_platform

    class Held:  # `HoldsModel`, `HoldsOptimizer`, and a `Critic` where it values
        def __init__(self) -> None:
            self.model = torch.nn.Linear(2, 2)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    class ValueHeld(Held):
        def values(self, batch):
            return torch.ones(2)

        def train_step(self, batch, returns, old_values):
            return {}

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    turns = Turns()
    sharing = Sharing(turns, select_platform("fake:cuda:1").platform)
    try:
        engine, critic = Held(), ValueHeld()
        assert isinstance(critic, Critic) and not isinstance(engine, Critic)
        trainer = sharing.train(engine)
        shared = sharing.critic(critic)
        assert shared.seat is trainer.seat
        (_, _, train_parks), (label, seat, critic_parks) = sharing._seats
        assert label == "critic" and seat is trainer.seat and critic_parks.module is critic.model
        with trainer.seat.turn():
            assert shared.values(None).tolist() == [1.0, 1.0]  # in the trainer's turn: no second acquire
        parking = sharing._parkings[id(trainer.seat)]
        parking.park()
        assert train_parks._handle is not None and critic_parks._handle is not None  # both moved together
        parking.unpark()
        assert sharing.summary()["seats"].keys() == {"train", "critic"}
        sharing.unseat(shared)
        assert sharing.summary()["seats"].keys() == {"train"} and parking.moves == [(train_parks.park, train_parks.unpark)]
    finally:
        sharing.close()
