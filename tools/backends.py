"""The engine registry's names, as tools/ has always imported them (`tidal.engines.registry` is their home)."""

from tidal.engines.registry import MULTI_RANK, REGISTRIES, ROLLOUT, TRAIN, load, unknown

__all__ = ["MULTI_RANK", "REGISTRIES", "ROLLOUT", "TRAIN", "load", "unknown"]
