"""The engine protocols, defined beside the workflow that uses them (`tidal.flow.protocols`)."""

from tidal.flow.protocols import RewardFn, RolloutEngine, TrainEngine

__all__ = ["RewardFn", "RolloutEngine", "TrainEngine"]
